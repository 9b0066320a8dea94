"""What runs in each worker process of `nf.processes`: one rank of a torch.distributed world.

A `Worker` actor joins the world (`nf.init`) and runs the calls the notebook sends, in the order
sent, each as the same code would run on that rank under torchrun; what a call makes is kept in
the worker's table under the name the notebook will use for it. A `Control` actor beside it answers
while a call runs: an interrupt drops the calls queued behind the current one (a call cut off in the
middle of a collective would leave the other ranks waiting in it, so the current one finishes).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pathlib
import pickle
import socket
import sys
import sysconfig
import threading
import traceback
from typing import Any

import torch
from monarch.actor import Actor, endpoint
from torch.distributed.tensor import DTensor

from ndfunc._src.processes import wire
from ndfunc._src.runtime import init, rank, shutdown
from ndfunc._src.sharding.mesh import Mesh, set_mesh
from ndfunc._src.sharding.rules import axis_rules
from ndfunc._src.transfer import sharding_of



class _Gate:
    """What the two actors of a worker process share: the Control actor pauses the Worker before
    its next call, learns the last call it started, and lets it go on without the calls dropped."""

    def __init__(self):
        self.condition = threading.Condition()
        self.paused = False
        self.started = 0
        self.dropped: set[int] = set()

    def enter(self, call: int) -> bool:
        """Wait while paused; whether `call` may run (it was not dropped)."""
        with self.condition:
            self.condition.wait_for(lambda: not self.paused)
            if call in self.dropped:
                self.dropped.discard(call)
                return False
            self.started = call
            return True


_GATE = _Gate()

_LIBRARIES = (str(pathlib.Path(torch.__file__).resolve().parent), str(pathlib.Path(wire.__file__).resolve().parents[2]),
    str(pathlib.Path(sysconfig.get_paths()["stdlib"]).resolve()), str(pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()))


class EarlierCallFailed(RuntimeError):
    """A call read a value that an earlier call was to make, but that call failed or was interrupted."""


def call_method(obj, name: str, *args, **kwargs):
    """`obj.name(*args, **kwargs)`, for the notebook's handles of objects that live here."""
    return getattr(obj, name)(*args, **kwargs)


class Worker(Actor):
    """One rank: joins the world, then runs the notebook's calls against its table of values."""

    def __init__(self):
        self.table: dict[Any, Any] = {}
        self.failed: dict[int, str] = {}  # call -> why it made nothing
        self.meshes: dict[int, Any] = {}  # id(DeviceMesh) -> the name the notebook knows its Mesh by
        self.rank = 0
        self.kept = 0  # results of the current call kept so far
        self.layouts: dict = {}  # (mesh, placements, rank) -> (spec, mesh descriptor)

    @endpoint
    def join(self, env: dict[str, str], path: list[str], cwd: str, output: str, threads: int, backend: str | None,
             timeout: float | None) -> tuple[str, int]:
        os.environ.update(env)
        # the notebook's modules and relative paths mean here what they mean there
        sys.path[:0] = [p for p in path if p not in sys.path]
        os.chdir(cwd)
        os.makedirs(os.path.dirname(output), exist_ok=True)  # (on another host, made there)
        out = open(output, "ab", buffering=0)
        for fd in (1, 2):  # what this process prints, C++ included, goes to its file: the notebook shows it
            os.dup2(out.fileno(), fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        torch.set_num_threads(threads)
        init(backend=backend, timeout=timeout)
        self.rank = rank()
        return socket.gethostname(), os.getpid()

    @endpoint
    def address(self) -> tuple[str, int]:
        """This host's name and a port free on it: where rank 0 serves the world's rendezvous."""
        from ndfunc._src.processes.watch import free_port

        return socket.gethostname(), free_port("")

    @endpoint
    def run(self, call: int, frees: list, defines: list | None, command: bytes, reply: bool, fetch: str | None):
        for ref in frees:
            self.table.pop(ref, None)
        try:
            for ref, data in defines or ():
                self.table[ref] = wire.loads(data, self._resolve)
            if not _GATE.enter(call):
                self.failed[call] = "it was interrupted before it ran"
                return ("cancelled", None)
            fn, args, kwargs, (mesh, rules) = wire.loads(command, self._resolve)
            with set_mesh(mesh) if mesh is not None else contextlib.nullcontext(), axis_rules(rules):
                result = fn(*args, **kwargs)
            self.kept = 0
            if fetch is not None:  # by value: rank 0's, or every rank's
                return ("ok", wire.dumps(result) if self.rank == 0 or fetch == "each" else None)
            if not (reply and self.rank == 0):  # kept in the same order, described to no one
                wire.dumps(result, lambda obj: self._describe(obj, call, quietly=True))
                return ("ok", None)
            return ("ok", wire.dumps(result, lambda obj: self._describe(obj, call)))
        except BaseException as e:  # noqa: B036 - a KeyboardInterrupt here is the call's, reported as it
            self.failed[call] = f"it failed on rank {self.rank}: {type(e).__name__}: {e}"
            return ("error", _report(e, self.rank))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()

    @endpoint
    def leave(self) -> None:
        self.table.clear()
        shutdown()

    def _resolve(self, pid):
        ref = pid[1]
        try:
            return self.table[ref]
        except KeyError:
            call = ref[0] if isinstance(ref, tuple) and isinstance(ref[0], int) else None
            why = self.failed.get(call, "it was freed, or made where this worker never saw it")
            raise EarlierCallFailed(f"a value this call reads ({ref!r}) is not on rank {self.rank}: {why}. Make it "
                                    f"again (run the cells that make it).") from None

    def _describe(self, obj, call: int, quietly: bool = False):
        """A descriptor for what stays here (None: `obj` goes by value); `k` numbers a call's results
        in the order pickle meets them, alike on every rank, so the notebook can name them before
        they exist (JAX's asynchronous dispatch). `quietly`: kept, not described (the notebook
        knows what a call of this signature makes)."""
        if isinstance(obj, Mesh):
            return ("mesh", self._mesh_ref(obj), tuple(obj.shape.items()), obj.device_type)
        if isinstance(obj, torch.Tensor):
            ref = self._keep(obj, call)
            spec, mesh = self._layout(obj) if isinstance(obj, DTensor) else (None, None)  # (its mesh named on every rank)
            if quietly:
                return ("kept",)
            return ("array", ref, tuple(obj.shape), obj.dtype, spec, mesh)
        if wire.is_value(obj):
            return None
        ref = self._keep(obj, call)
        if quietly:
            return ("kept",)
        names = {}
        for name in dir(obj):
            if name.startswith("__") and name != "__call__":
                continue
            static = inspect.getattr_static(obj, name, None)
            names[name] = callable(static) and not isinstance(static, property)
        return ("object", ref, type(obj).__name__, names)

    def _keep(self, obj, call: int):
        ref = (call, self.kept)
        self.kept += 1
        self.table[ref] = obj
        return ref

    def _layout(self, x: DTensor):
        """(spec, mesh descriptor) of a DTensor, worked out once per mesh, placements and rank."""
        key = (id(x.device_mesh), x.placements, x.ndim)
        known = self.layouts.get(key)
        if known is None:
            sharding = sharding_of(x)
            known = self.layouts[key] = (sharding.spec, self._describe(sharding.mesh, 0))
        return known

    def _mesh_ref(self, mesh: Mesh):
        ref = self.meshes.get(id(mesh.device_mesh))
        if ref is None:
            ref = self.meshes[id(mesh.device_mesh)] = ("mesh", len(self.meshes))
            self.table[ref] = mesh
        return ref


class Control(Actor):
    """Answers while the worker beside it runs a call: an interrupt, in two steps, so that every
    rank drops the same calls (a call one rank started and another dropped would leave the first
    waiting in its collectives)."""

    @endpoint
    def pause(self) -> int:
        """Hold the worker before its next call; the last call it started."""
        with _GATE.condition:
            _GATE.paused = True
            return _GATE.started

    @endpoint
    def resume(self, dropped: list[int]) -> None:
        with _GATE.condition:
            _GATE.dropped.update(dropped)
            _GATE.paused = False
            _GATE.condition.notify_all()


def _report(e: BaseException, rank: int) -> dict:
    """What the notebook needs to raise `e` as it was: the exception (pickled, where it can be), its
    remote traceback, and the user's own line it came from (the innermost frame outside the
    libraries)."""
    frames = traceback.extract_tb(e.__traceback__)
    user = None
    for frame in reversed(frames):
        path = frame.filename
        if not str(pathlib.Path(path).resolve()).startswith(_LIBRARIES) and not path.startswith("<frozen"):
            user = (frame.filename, frame.lineno, frame.name)
            break
    try:
        exc = pickle.dumps(e)
        pickle.loads(exc)
    except Exception:  # an exception whose pickle does not load back is raised by name instead
        exc = None
    return {"rank": rank, "type": type(e).__name__, "message": str(e), "exception": exc, "user": user,
            "traceback": "".join(traceback.format_exception(e))}
