"""One running set of workers, as the notebook knows them: the calls sent and their handles.

A call is pickled with handles as their names (`wire`), sent to every worker, and either waited
for or, where a call of the same signature told what it makes, answered at once with handles
named before the workers make them (JAX's asynchronous dispatch). The calls not waited for are
`Pending`; whatever waits raises the first that failed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import weakref
from typing import Any

import optree
import torch

from ndfunc._src.forward import handles_in
from ndfunc._src.processes import wire
from ndfunc._src.processes.handles import Array, ProcessMesh, Remote
from ndfunc._src.processes.watch import Watch, get_on_a_thread
from ndfunc._src.sharding.mesh import get_mesh
from ndfunc._src.sharding.named_sharding import NamedSharding
from ndfunc._src.sharding.rules import current_rules

# Calls are numbered across every session of this process, so a handle of a session that ended
# can never name a value of a later one.
_CALLS = itertools.count(1)
# a plain tensor this big (a corpus a data loader's callbacks read) is sent once and named after, as a
# jitted step is, rather than with every call that reads it
_SENT_ONCE_BYTES = 1 << 20
_MOST_PENDING = 256  # calls not waited for, past which a call waits for the older half
_PLAIN = frozenset({str, int, float, bool, type(None), tuple, list, dict, bytes, torch.dtype, torch.Size})


@dataclasses.dataclass
class Pending:
    """A call sent and not yet waited for: what it reads, and what it was given to consume."""

    call: int
    future: Any  # Monarch's, until a wait takes it: then the waiter's (a Monarch future is got once)
    reads: set  # the calls whose results it reads
    donated: list  # handles of the arrays it consumes: freed once it ran, usable again if it did not

    def waitable(self):
        if not isinstance(self.future, concurrent.futures.Future):
            self.future = get_on_a_thread(self.future)
        return self.future


class Session(Watch):
    """The calls of one `nf.processes` block, from its start to its stop."""

    def __init__(self, owner, launch):
        super().__init__(owner, launch)
        self.frees: list = []
        self.first_call = next(_CALLS)  # a handle this session gave out names a call from here on
        self.gone: set = set()  # refs of arrays given to a step to consume
        self.sent_once: dict[int, tuple[Any, Any, int]] = {}  # id(object) -> (ref, weakref to it, its version)
        self.meshes: dict[Any, ProcessMesh] = {}
        self.shardings: dict[tuple, NamedSharding] = {}
        self.skeletons: dict[Any, tuple[bytes, int]] = {}  # call signature -> (rank 0's reply, its call)
        self.pending: list[Pending] = []

    def holds(self, handle) -> bool:
        return not self.closing and self.made(handle) and handle._ref not in self.gone

    def made(self, handle) -> bool:
        """Whether this session gave `handle` out (not an ended one, whose names it never reuses)."""
        ref = handle._ref
        if isinstance(handle, ProcessMesh):
            return self.meshes.get(ref) is handle
        return isinstance(ref[0], int) and ref[0] >= self.first_call

    # -- calls -----------------------------------------------------------------------------------

    def call(self, fn, args, kwargs, asynchronous: bool, fetch: str | None, donated: list, signature):
        self.check_alive()
        self.flush_output()
        call = next(_CALLS)
        new: list = []
        reads: set = set()
        mesh = get_mesh()  # what `with mesh:` and axis rules set here hold there too
        context = (mesh if isinstance(mesh, ProcessMesh) else None, current_rules())
        command = wire.dumps((fn, args, kwargs, context), lambda obj: self.persistent_id(obj, new, reads))
        defines = self.define(new)
        key = None
        if asynchronous and fetch is None:
            key = self.signature(fn, args, kwargs, signature, context)
        skeleton = self.skeletons.get(key) if key is not None else None
        frees, self.frees = self.frees, []
        future = self.workers.run.call(call, frees, defines, command, skeleton is None, fetch)
        consumed = handles_in(donated, Array)
        self.gone.update(x._ref for x in consumed)
        self.pending.append(Pending(call, future, reads, consumed))
        if skeleton is not None:
            if len(self.pending) > _MOST_PENDING:
                self.drain(len(self.pending) // 2)
            data, first = skeleton
            return wire.loads(data, lambda pid: self.handle(pid, call_of=(first, call)))
        replies = self.drain()  # the workers run in order: the calls before this one fail first
        if fetch == "each":
            return [wire.loads(data) for _, data in replies]
        if fetch is not None:
            return wire.loads(replies[0][1])
        data = replies[0][1]
        result = wire.loads(data, lambda pid: self.handle(pid, call_of=None))
        if key is not None and all(isinstance(x, (Array, type(None))) for x in optree.tree_leaves(
                result, none_is_leaf=True)):
            self.skeletons[key] = (data, call)
        return result

    def persistent_id(self, obj, new: list, reads: set):
        if type(obj) in _PLAIN:  # most of what a call's arguments hold: asked of every object pickled
            return None
        if isinstance(obj, (Array, Remote, ProcessMesh)):
            if obj._owner is not self.owner or not self.holds(obj):
                raise ValueError(_gone(obj, self))
            if isinstance(obj._ref[0], int):
                reads.add(obj._ref[0])
            return ("ref", obj._ref)
        if type(obj) is torch.Tensor and obj.nbytes >= _SENT_ONCE_BYTES:
            version = obj._version  # written in place since it was sent: sent again
        elif getattr(type(obj), "__ndfunc_twin__", False):
            version = 0
        else:
            return None
        known = self.sent_once.get(id(obj))
        if known is None or known[1]() is not obj or known[2] != version:
            if known is not None and known[1]() is obj:
                self.frees.append(known[0])  # the copy of the old version
            ref = ("once", next(_CALLS))
            self.sent_once[id(obj)] = known = (ref, weakref.ref(obj), version)
            weakref.finalize(obj, self.forget, id(obj), ref)
            new.append((ref, obj))
        return ("ref", known[0])

    def define(self, new: list) -> list | None:
        """What is sent once, each pickled on its own: one found while pickling another (a corpus in a
        step's closure) is defined before it, so every name resolves when loaded."""
        if not new:
            return None
        defines = []
        for ref, obj in new:  # (`new` grows as it is walked: what one holds is appended)
            defines.append((ref, wire.dumps(obj, lambda o, obj=obj: None if o is obj else
                                            self.persistent_id(o, new, set()))))
        return defines[::-1]

    def forget(self, key: int, ref) -> None:
        """What was sent once is gone here: its copy on the workers goes with the next call."""
        known = self.sent_once.get(key)
        if known is not None and known[0] == ref:
            del self.sent_once[key]
        self.frees.append(ref)

    def signature(self, fn, args, kwargs, given, context):
        """What decides a call's results' shapes, dtypes and shardings; None where it cannot be told."""
        if given is not None:
            return (fn, given, context)
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        key = [fn, spec, context]
        for x in leaves:
            if isinstance(x, Array):
                key.append(("array", tuple(x.shape), x.dtype, x.sharding))
            elif isinstance(x, torch.Tensor):
                key.append(("tensor", tuple(x.shape), x.dtype, x.device))
            elif isinstance(x, (Remote, ProcessMesh)):
                key.append(("ref", x._ref))
            elif id(x) in self.sent_once:
                key.append(("ref", self.sent_once[id(x)][0]))
            else:
                key.append((type(x), x))
        key = tuple(key)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def handle(self, pid, call_of):
        kind, ref = pid[0], pid[1]
        if kind == "mesh":
            mesh = self.meshes.get(ref)
            if mesh is None:
                mesh = self.meshes[ref] = ProcessMesh(self.owner, ref, pid[2], pid[3])
            return mesh
        if call_of is not None and ref[0] == call_of[0]:
            ref = (call_of[1], ref[1])
        if kind == "array":
            _, _, shape, dtype, spec, mesh = pid
            sharding = None
            if spec is not None:  # one NamedSharding per layout, not one per array of every call
                sharding = self.shardings.get((mesh[1], spec))
                if sharding is None:
                    sharding = self.shardings[(mesh[1], spec)] = NamedSharding(self.handle(mesh, call_of), spec)
            return Array(self.owner, ref, shape, dtype, sharding)
        return Remote(self.owner, ref, pid[2], pid[3])

    # -- waiting ---------------------------------------------------------------------------------

    def drain(self, count: int | None = None, raise_errors: bool = True) -> list | None:
        """Wait for the first `count` calls not waited for (all by default), in order; raise the
        first that failed (the root cause: later failures only read what it never made). The last
        one's replies, rank by rank."""
        count = len(self.pending) if count is None else count
        done, self.pending = self.pending[:count], self.pending[count:]
        failed = replies = None
        for i, p in enumerate(done):
            try:
                replies = self.wait_for(p.waitable())
            except KeyboardInterrupt:
                self.pending = done[i:] + self.pending
                self.interrupt()
                raise
            statuses = [status for status, _ in replies]
            if "ok" not in statuses or "error" in statuses:  # it did not run: what it consumed stands
                self.gone.difference_update(x._ref for x in p.donated)
            else:
                self.frees.extend(x._ref for x in p.donated)
            if failed is None and "error" in statuses:
                failed = replies
        if failed is not None and raise_errors:
            raise _rebuild([(r, report) for r, (status, report) in enumerate(failed) if status == "error"],
                           self.owner)
        return replies

    def interrupt(self) -> None:
        """Drop the calls sent and not started, but for those that consume arrays (a training step:
        its results are the only copy of the state) and those whose results they read: the workers
        stop before their next call, say which they started last, and go on without the dropped."""
        try:
            started = max(self.wait_for(self.controls.pause.call(), seconds=10, interruptible=False))
        except BaseException:  # noqa: B036 - a worker that died: the wait that follows says so
            started = None
        keep: set = set()
        for p in reversed(self.pending):
            if started is None or p.call <= started or p.donated or p.call in keep:
                keep.add(p.call)
                keep.update(p.reads)
        dropped = [p.call for p in self.pending if p.call not in keep]
        self.pending = [p for p in self.pending if p.call in keep]  # (a dropped call consumed nothing)
        try:
            self.wait_for(self.controls.resume.call(dropped), seconds=10, interruptible=False)
        except BaseException:  # noqa: B036
            pass


def _gone(handle, session) -> str:
    what = type(handle).__name__
    if handle._owner is not session.owner or not session.made(handle) or session.closing:
        return (f"this {what} lived on the workers of {handle._owner!r}, which have stopped: its blocks are gone. "
                f"Fetch values with nf.device_get before leaving the block.")
    return (f"this {what} was donated to a step (donate_argnums): its buffers now hold the step's results. "
            f"Use what the step returned instead.")


def _rebuild(failed: list, owner) -> BaseException:
    """The first failing rank's exception, as raised there, with a note naming the rank and the
    user's line (read here, where the notebook's cells are)."""
    import linecache
    import pickle

    rank, report = failed[0]
    exc = None
    if report["exception"] is not None:
        try:
            exc = pickle.loads(report["exception"])
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{report['type']}: {report['message']}")
    where = ""
    if report["user"] is not None:
        filename, lineno, name = report["user"]
        line = linecache.getline(filename, lineno).strip()
        where = f", at {filename}:{lineno} in {name}" + (f": {line}" if line else "")
    others = [r for r, _ in failed[1:]]
    also = f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    exc.add_note(f"raised on rank {rank} of {owner!r}{where}{also}")
    exc.__cause__ = _RemoteTraceback(report["traceback"])
    return exc


class _RemoteTraceback(Exception):
    """The traceback on the rank, shown as the cause of the exception raised here."""

    def __str__(self) -> str:
        return "\n" + self.args[0]

