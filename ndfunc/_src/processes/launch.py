"""Monarch's part of `nf.processes`: start the worker processes on this host and stop them.

The processes are spawned by a `Launcher` actor living in this process rather than by the
notebook itself: an owner is told when a process it spawned dies, and Monarch's root client ends
the whole Python process on such news (its default fault hook). The launcher takes the news
instead, so a dead worker is an error in the notebook, and the kernel lives on.
"""

from __future__ import annotations

import itertools
import os

from monarch.actor import Actor, default_bootstrap_cmd, endpoint, this_host, this_proc

from ndfunc._src.processes.worker import Control, Worker

_names = itertools.count()


class Launcher(Actor):
    """Owns one set of worker processes."""

    def __init__(self):
        self.procs = None
        self.failures: list[str] = []

    @endpoint
    def start_workers(self, n: int, hosts, device: str, threads: int):
        axis = "gpus" if device == "cuda" else "procs"
        # the threads set before torch starts, as torchrun sets them: OpenMP's pool is then that size
        command = default_bootstrap_cmd().with_env({"OMP_NUM_THREADS": str(threads)})
        self.procs = (hosts or this_host()).spawn_procs(per_host={axis: n}, name=f"ndfunc{os.getpid()}x{next(_names)}",
                                                        bootstrap_command=command)
        return self.procs.spawn("worker", Worker), self.procs.spawn("control", Control)

    @endpoint
    def stop_workers(self) -> None:
        if self.procs is not None:
            self.procs.stop().get()

    @endpoint
    def failures_seen(self) -> list[str]:
        return list(self.failures)

    def __supervise__(self, failure) -> bool:
        self.failures.append(str(failure))
        return True  # handled: the notebook finds the dead process itself (controller.check_alive)


def spawn(n: int, hosts, device: str, threads: int):
    """(launcher, future): a fresh launcher, and the future of the (workers, controls) actor meshes
    it starts, for the caller to wait on as it waits on every call."""
    launcher = this_proc().spawn(f"ndfunc_launcher{os.getpid()}x{next(_names)}", Launcher)
    return launcher, launcher.start_workers.call_one(n, hosts, device, threads)


def by_rank(mesh):
    """A mesh `spawn` made, over one axis `rank` (hosts, then the processes of each)."""
    return mesh.flatten("rank")


def stop(launcher):
    """The future of the launcher's processes stopped."""
    return launcher.stop_workers.call_one()
