"""The workers' processes as the notebook watches them: started, waited on, shown, ended.

Every wait polls: between polls the ranks' printed output is shown and their processes are looked
at, so a dead worker is an error here within a poll or two, never a wait in a collective until its
timeout. Monarch's blocking get runs on a daemon thread of its own: a kernel's cell runs inside an
asyncio loop, where a get warns on every call, and a get that never returns must not keep the
interpreter from exiting.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import pathlib
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import torch

from ndfunc._src import forward

_POLL_S = 0.05  # how often a wait looks at the ranks' output and their processes
_REMOTE_POLL_S = 1.0  # how often it asks Monarch about processes on other hosts


class WorkerDiedError(RuntimeError):
    """A worker process of `nf.processes` ended: the ranks left cannot go on without it."""


class Watch:
    """Starting, watching and ending one set of worker processes (Monarch's part is `launch`)."""

    def __init__(self, owner, launch):
        self.owner, self.launch = owner, launch
        self.pids: list[int | None] = []
        self.outputs: dict[int, object] = {}  # rank -> its output file, open for reading
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="ndfunc-processes-"))
        self.workers = self.controls = self.launcher = None
        self.closing = False
        self.asked_monarch = self.checked = 0.0

    def start(self, per_host: int, hosts, device: str, threads: int | None, timeout: float | None) -> None:
        world = per_host * self.owner.num_hosts
        threads = threads or (1 if per_host > 1 else torch.get_num_threads())
        self.launcher, started = self.launch.spawn(per_host, hosts, device, threads)
        self.workers, self.controls = self.wait_for(started, single=True)
        ranks = self.launch.by_rank(self.workers)
        # torchrun's environment: rank 0's host and a port free there, each rank's place on its host
        master, port = ("127.0.0.1", free_port()) if hosts is None else self.wait_for(
            ranks.slice(rank=0).address.call_one(), single=True)
        backend = "nccl" if device == "cuda" else "gloo"
        futures = []
        for r in range(world):
            env = {"RANK": str(r), "LOCAL_RANK": str(r % per_host), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(per_host), "GROUP_RANK": str(r // per_host), "MASTER_ADDR": master,
                   "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "ndfunc"}
            futures.append(ranks.slice(rank=r).join.call_one(
                env, [p for p in sys.path if p], os.getcwd(), str(self.directory / f"rank{r}.out"), threads, backend,
                timeout))
        here = socket.gethostname()
        # a process on this host is watched here; one elsewhere through Monarch (`check_alive`)
        self.pids = [pid if host == here else None for host, pid in (self.wait_for(f, single=True) for f in futures)]

    def close(self, clean: bool) -> None:
        """End every worker. `clean`: the block ended as it should, so the calls still running are
        waited for (and the first that failed raised, once the workers are ended)."""
        if self.closing:
            return
        error = None
        try:
            if clean and self.workers is not None:
                try:
                    self.drain()
                except BaseException as e:  # noqa: B036 - raised once every worker is ended
                    error = e
                    self.drain(raise_errors=False)
                self.wait_for(self.workers.leave.call(), seconds=30)
        except BaseException as e:  # noqa: B036 - raised once every worker is ended
            error = error or e
        finally:
            self.closing = True
            self.flush_output()
            alive = [pid for pid in self.pids if pid is not None and _ours(pid)]
            if self.launcher is not None:
                try:
                    self.wait_for(self.launch.stop(self.launcher), single=True, seconds=10)
                except Exception as e:  # noqa: B036 - what Monarch could not stop is ended below, or said
                    if any(pid is None for pid in self.pids):
                        print(f"{self.owner!r}: Monarch did not stop the workers on other hosts ({e}); "
                              f"end them there.", file=sys.stderr)
            for pid in alive:  # those Monarch left (a worker stuck in a collective)
                if _ours(pid):
                    os.kill(pid, signal.SIGKILL)
            for f in self.outputs.values():
                f.close()
            self.outputs.clear()
            shutil.rmtree(self.directory, ignore_errors=True)
        if error is not None:
            raise error

    def wait_for(self, future, single: bool = False, seconds: float | None = None, interruptible: bool = True):
        """The replies (rank by rank) of a call, watching the ranks' output and processes meanwhile.
        `interruptible=False`: a wait of the interrupt itself, which a second interrupt ends."""
        deadline = None if seconds is None else time.monotonic() + seconds
        try:
            got = future if isinstance(future, concurrent.futures.Future) else get_on_a_thread(future)
            while True:
                try:
                    value = got.result(timeout=_POLL_S)
                    break
                except TimeoutError:
                    pass
                self.flush_output()
                if interruptible:
                    self.check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{self.owner!r}: the workers did not answer within {seconds} s.")
        except (KeyboardInterrupt, WorkerDiedError, TimeoutError):
            raise
        except Exception as e:
            self.check_alive()
            if type(e).__name__ == "SupervisionError":  # Monarch's word that a process ended
                self.lost(str(e))
            raise RuntimeError(f"{self.owner!r}: a call to the workers failed: {e}") from e
        finally:
            self.flush_output()
        return value if single else [v for _, v in sorted(value.items(), key=lambda kv: kv[0].rank)]

    def check_alive(self) -> None:
        now = time.monotonic()
        if self.closing or now - self.checked < _POLL_S:  # (asked at every call: a poll's pace is enough)
            return
        self.checked = now
        dead = [(r, pid) for r, pid in enumerate(self.pids) if pid is not None and not _alive(pid)]
        if dead:
            self.lost("the process of " + ", ".join(f"rank {r} (pid {pid})" for r, pid in dead) + " has ended")
        if None in self.pids and now - self.asked_monarch > _REMOTE_POLL_S:
            self.asked_monarch = now
            failures = get_on_a_thread(self.launcher.failures_seen.call_one()).result(timeout=10)
            if failures:
                self.lost(f"Monarch reports a worker failed: {failures[0]}")

    def lost(self, what: str) -> None:
        """Stop every worker and say why: the ranks left cannot go on without the one that ended."""
        owner = self.owner
        owner._session = None
        forward.pop(owner)
        self.close(clean=False)
        raise WorkerDiedError(f"{owner!r}: {what}. The other ranks cannot go on without it, so every worker was "
                              f"stopped and the arrays they held are gone; start again with {owner!r}.")

    def flush_output(self) -> None:
        """Print what the shown ranks printed since last time, whole lines only."""
        if self.closing and not self.outputs:
            return
        for r in self.owner.output:
            f = self.outputs.get(r)
            if f is None:
                try:
                    f = self.outputs[r] = open(self.directory / f"rank{r}.out", "rb")
                except FileNotFoundError:
                    continue
            start = f.tell()
            data = f.read()
            end = data.rfind(b"\n") + 1  # the rest waits for its line's end
            f.seek(start + end)
            if not end:
                continue
            text = data[:end].decode(errors="replace")
            if len(self.owner.output) > 1 or r != 0:
                text = "".join(f"[rank {r}] {line}" for line in text.splitlines(keepends=True))
            print(text, end="", flush=True)


def get_on_a_thread(future) -> concurrent.futures.Future:
    """A Monarch future's value, got (once: a get consumes it) on a daemon thread."""
    got: concurrent.futures.Future = concurrent.futures.Future()

    def get():
        try:
            got.set_result(future.get())
        except BaseException as e:  # noqa: B036 - handed to the waiter
            got.set_exception(e)

    threading.Thread(target=get, name="ndfunc-wait", daemon=True).start()
    return got


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` for rank 0's rendezvous, below the kernel's ephemeral range: between
    this pick and rank 0's bind, a socket the system numbers itself (gloo's, another job's) cannot
    take it."""
    low, _ = _ephemeral_range()
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port for the workers' rendezvous below {low} on {host}.")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _ours(pid: int) -> bool:
    """Whether `pid` is still a live Monarch worker (not a process that took its number since)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return _alive(pid) and b"monarch" in f.read()
    except OSError:
        return False
