"""`nf.processes(n)`: this process (a notebook's kernel) as the single controller of n real ranks.

Monarch starts the worker processes on this host and carries the calls; each worker joins one
torch.distributed world through `nf.init` and runs what the notebook sends as its rank would under
torchrun: the same `make_mesh`, `device_put`, `nf.jit` step, each rank lowering its own program
(a lowering is pure, so every rank makes the same one; the ranks' agreement check runs before a
step first runs, as under torchrun). Values stay on the ranks; the notebook holds handles.

Dispatch is JAX's: a call whose signature was seen before returns its handles at once, and the
workers run the calls in the order sent; whatever waits (a fetch, a call seen for the first time)
raises the first failure of the calls before it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import os
import pathlib
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import weakref
from typing import Any

import optree
import torch
import torch.distributed as dist

from ndfunc._src import forward
from ndfunc._src.processes import wire
from ndfunc._src.processes.handles import Array, ProcessMesh, Remote
from ndfunc._src.runtime import is_simulated
from ndfunc._src.sharding.named_sharding import NamedSharding

_POLL_S = 0.05  # how often a wait looks at the ranks' output and their processes
# a plain tensor this big (a corpus a data loader's callbacks read) is sent once and named after, as a
# jitted step is, rather than with every call that reads it
_SENT_ONCE_BYTES = 1 << 20


class WorkerDiedError(RuntimeError):
    """A worker process of `nf.processes` ended: the ranks left cannot go on without it."""


class processes:
    """Start `n` worker processes on this host, one rank each, and drive them from here.

    By default one per visible GPU (NCCL), else `n` CPU processes (gloo). Inside the block (or
    between `start()` and `stop()`, across a notebook's cells) the code written for `nf.simulate(n)`
    or torchrun runs on the real ranks: meshes, `device_put`, `nf.jit` steps and their `lower()`,
    checkpoints; arrays are handles here, their blocks stay on the ranks until fetched
    (`nf.device_get`, `float(loss)`). Needs `pip install 'ndfunc[notebook]'` (Monarch).

    Args:
        n: how many ranks (on each host); None: one per GPU visible here.
        hosts: a Monarch `HostMesh` to start them on (a cluster's job, `monarch.job.SlurmJob`, or
            `monarch.job.ProcessJob` for hosts played by processes here); None: this host.
        device: "cuda" or "cpu"; None: CUDA when a GPU is visible.
        output: which ranks' printed output the notebook shows: a rank, a list of ranks, or "all".
        timeout: seconds a collective waits for the other ranks (`nf.init`'s).
        threads: torch threads per worker; None: as torchrun sets them (1 when n > 1).

    Example:
        >>> with nf.processes(2, device="cpu") as workers:
        ...     mesh = nf.make_mesh(dp=2)
        ...     x = nf.device_put(torch.arange(4.), NamedSharding(mesh, P('dp')))
        ...     float(x.sum())
        6.0
    """

    def __init__(self, n: int | None = None, *, hosts=None, device: str | None = None,
                 output: int | list[int] | str = 0, timeout: float | None = None, threads: int | None = None):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"nf.processes needs a number of ranks >= 1 (or None: one per GPU), got {n!r}.")
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"nf.processes: device is 'cuda', 'cpu' or None (CUDA when a GPU is visible), got {device!r}.")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not (hosts is not None and n is not None):  # (other hosts' GPUs: theirs)
            gpus = torch.cuda.device_count()
            if n is not None and n > gpus:
                raise ValueError(f"nf.processes({n}) asks for {n} GPU ranks but {gpus} GPU(s) are visible; "
                                 f"ask for at most {gpus}, or device='cpu' for CPU processes.")
            n = gpus if n is None else n
            if n < 1:
                raise ValueError("nf.processes(device='cuda') found no visible GPU; use device='cpu' with n ranks.")
        elif n is None:
            raise ValueError("nf.processes() starts one rank per visible GPU, and this machine has none; "
                             "say how many CPU ranks: nf.processes(4).")
        self.hosts = hosts
        self.num_hosts = 1 if hosts is None else math.prod(dict(hosts.extent).values())  # a HostMesh's shape
        self.per_host, self.n = n, n * self.num_hosts
        self.timeout, self.threads = timeout, threads
        self.show_output(output)
        self._state = None

    # -- the block -------------------------------------------------------------------------------

    def start(self) -> "processes":
        if self._state is not None:
            raise RuntimeError(f"{self!r} is already running.")
        if forward.active() is not None:
            raise RuntimeError(f"{self!r} was started inside another nf.processes block; leave that one first.")
        if is_simulated() or dist.is_initialized():
            raise RuntimeError(f"{self!r} drives worker processes from a process with no world of its own, but "
                               f"this one has one (inside nf.simulate, or after nf.init()); leave it first.")
        try:
            from ndfunc._src.processes import launch
        except ImportError as e:
            raise ImportError(f"nf.processes needs Monarch (torchmonarch), which is not installed ({e}); "
                              f"install it with: pip install 'ndfunc[notebook]'.") from None
        started = time.perf_counter()
        self._state = _State(self, launch)
        try:
            self._state.start(self.per_host, self.hosts, self.device, self.threads, self.timeout)
        except BaseException:
            state, self._state = self._state, None
            state.close(force=True)
            raise
        self.start_seconds = time.perf_counter() - started
        forward.push(self)
        return self

    def stop(self) -> None:
        """End every worker; arrays still held here are gone with them."""
        state, self._state = self._state, None
        forward.pop(self)
        if state is not None:
            state.close(force=False)

    def __enter__(self) -> "processes":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        hosts = "" if self.hosts is None else f" on {self.num_hosts} hosts"
        return f"nf.processes({self.per_host}, device={self.device!r}){hosts}"

    def __reduce__(self):
        raise TypeError(f"{self!r} drives worker processes from this one; it cannot be sent to them.")

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, rank by rank."""
        return list(self._running().pids)

    @property
    def world_size(self) -> int:
        return self.n

    def show_output(self, ranks: int | list[int] | str = 0) -> None:
        """Show these ranks' printed output in the notebook: a rank, a list, or "all" (others' is kept)."""
        if ranks == "all":
            ranks = list(range(self.n))
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.n)]
        if bad:
            raise ValueError(f"nf.processes({self.n}): output names ranks 0..{self.n - 1} (or 'all'), got {bad}.")
        self.output = ranks

    def wait(self) -> None:
        """Wait for every call issued so far (and raise the first that failed)."""
        self._running().drain()

    # -- what forward.on_workers calls -----------------------------------------------------------

    def call(self, fn, args: tuple, kwargs: dict, *, asynchronous: bool = False, fetch: bool = False,
             donated: list | None = None, signature=None):
        return self._running().call(fn, args, kwargs, asynchronous, "rank0" if fetch else None, donated or [],
                                    signature)

    def each(self, fn, *args, **kwargs) -> list:
        """`fn(*args, **kwargs)` run on every rank, each rank's result by value, rank by rank: a look at
        what each rank holds (`nf.rank()`, a counter, its threads). Arrays given are its local DTensors."""
        return self._running().call(fn, args, kwargs, False, "each", [], None)

    def call_method(self, handle: Remote, name: str, args: tuple, kwargs: dict, asynchronous: bool = False):
        from ndfunc._src.processes.worker import call_method

        return self.call(call_method, (handle, name, *args), kwargs, asynchronous=asynchronous)

    def holds(self, handle) -> bool:
        return self._state is not None and handle._ref not in self._state.gone

    def release(self, ref) -> None:
        if self._state is not None:
            self._state.frees.append(ref)

    def reference(self, handle):
        raise TypeError(f"{type(handle).__name__} handles of {self!r} cannot be pickled; fetch the value with "
                        f"nf.device_get first.")

    def _running(self) -> "_State":
        if self._state is None:
            raise RuntimeError(f"{self!r} is not running (never started, stopped, or its workers died); its arrays "
                               f"are gone. Start it again (nf.processes(n)), and fetch what you need with "
                               f"nf.device_get before leaving the block.")
        return self._state


class _State:
    """One running set of workers and what the notebook knows of them."""

    def __init__(self, owner: processes, launch):
        self.owner, self.launch = owner, launch
        self.ids = itertools.count(1)
        self.frees: list = []
        self.gone: set = set()  # refs of donated or lost values
        self.twins: dict[int, tuple[Any, Any, int]] = {}  # id(object) -> (ref, weakref to it, its version)
        self.meshes: dict[Any, ProcessMesh] = {}
        self.shardings: dict[tuple, NamedSharding] = {}
        self.skeletons: dict[Any, tuple[bytes, int]] = {}  # call signature -> (rank 0's reply, its call)
        self.outstanding: list[tuple[int, Any]] = []
        self.pids: list[int] = []
        self.outputs: dict[int, Any] = {}  # rank -> its output file, open for reading
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="ndfunc-processes-"))
        self.workers = self.controls = self.launcher = None
        self.closing = False
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="ndfunc-wait")

    def start(self, per_host: int, hosts, device: str, threads: int | None, timeout: float | None) -> None:
        world = per_host * self.owner.num_hosts
        threads = threads or (1 if per_host > 1 else torch.get_num_threads())
        self.launcher, started = self.launch.spawn(per_host, hosts, device, threads)
        self.workers, self.controls = self.wait_for(started, single=True)
        ranks = self.launch.by_rank(self.workers)
        # torchrun's environment: rank 0's host and a port free there, each rank's place on its host
        master, port = ("127.0.0.1", _free_port()) if hosts is None else self.wait_for(
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
        joined = [self.wait_for(f, single=True) for f in futures]
        self.hosts = [host for host, _ in joined]
        # what this host can watch itself; a process elsewhere is watched by Monarch (its calls fail)
        self.pids = [pid if host == here else None for host, pid in joined]

    def close(self, force: bool) -> None:
        if self.closing:
            return
        try:
            if not force and self.workers is not None:
                self.drain(raise_errors=False)
                self.wait_for(self.workers.leave.call(), seconds=30)
        except BaseException:  # noqa: B036 - the processes end below whatever happened
            force = True
        finally:
            self.closing = True
            self.flush_output()
            if self.launcher is not None:
                try:
                    self.wait_for(self.launch.stop(self.launcher), single=True, seconds=10)
                except Exception:
                    pass
            for pid in self.pids:
                if pid is not None:
                    _kill(pid)
            for f in self.outputs.values():
                f.close()
            self.outputs.clear()
            shutil.rmtree(self.directory, ignore_errors=True)
            self.pool.shutdown(wait=False, cancel_futures=True)

    # -- calls -----------------------------------------------------------------------------------

    def call(self, fn, args, kwargs, asynchronous: bool, fetch: str | None, donated: list, signature):
        self.check_alive()
        self.flush_output()
        call = next(self.ids)
        key = None
        if asynchronous and fetch is None:
            key = _signature(fn, args, kwargs) if signature is None else (fn, signature)
        skeleton = self.skeletons.get(key) if key is not None else None
        new_twins: list = []
        command = wire.dumps((fn, args, kwargs), lambda obj: self.persistent_id(obj, new_twins))
        defines = None
        if new_twins:
            defining = {id(obj) for _, obj in new_twins}
            defines = wire.dumps(new_twins, lambda obj: None if id(obj) in defining else
                                 self.persistent_id(obj, new_twins))
        frees, self.frees = self.frees, []
        future = self.workers.run.call(call, frees, defines, command, skeleton is None, fetch)
        for handle in _arrays(donated):  # the step may write its results into their buffers
            self.gone.add(handle._ref)
            self.frees.append(handle._ref)
        if skeleton is not None:
            self.outstanding.append((call, future))
            data, first = skeleton
            return wire.loads(data, lambda pid: self.handle(pid, call_of=(first, call)))
        replies = self.wait_for(future)
        self.drain()  # the calls before this one are done (the workers run in order): their failure first
        self.raise_failures_of(replies)
        if fetch == "each":
            return [wire.loads(data) for _, data in replies]
        data = replies[0][1]
        if fetch is not None:
            return wire.loads(data)
        result = wire.loads(data, lambda pid: self.handle(pid, call_of=None))
        if key is not None and all(isinstance(x, (Array, type(None))) for x in optree.tree_leaves(
                result, none_is_leaf=True)):
            self.skeletons[key] = (data, call)
        return result

    def persistent_id(self, obj, new_twins: list):
        if isinstance(obj, (Array, Remote, ProcessMesh)):
            if obj._owner is not self.owner or not self.owner.holds(obj):
                raise ValueError(_gone(obj, self.owner))
            return ("ref", obj._ref)
        if type(obj) is torch.Tensor and obj.nbytes >= _SENT_ONCE_BYTES:
            version = obj._version  # written in place since it was sent: sent again
        elif getattr(type(obj), "__ndfunc_twin__", False):
            version = 0
        else:
            return None
        known = self.twins.get(id(obj))
        if known is None or known[1]() is not obj or known[2] != version:
            ref = ("twin", next(self.ids))
            self.twins[id(obj)] = known = (ref, weakref.ref(obj), version)
            weakref.finalize(obj, self.forget, id(obj), ref)
            new_twins.append((ref, obj))
        return ("ref", known[0])

    def forget(self, key: int, ref) -> None:
        """A twin's original is gone here: its copy on the workers goes with the next call."""
        known = self.twins.get(key)
        if known is not None and known[0] == ref:
            del self.twins[key]
        self.frees.append(ref)

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

    def wait_for(self, future, single: bool = False, seconds: float | None = None):
        """The replies (rank by rank) of a call, watching the ranks' output and processes meanwhile;
        a KeyboardInterrupt here drops the calls queued behind the current one."""
        deadline = None if seconds is None else time.monotonic() + seconds
        # Monarch's blocking get, on a thread of its own: a kernel's cell runs inside an asyncio
        # loop, where a get warns on every call; here the wait stays interruptible
        pending = self.pool.submit(future.get)
        try:
            while True:
                try:
                    value = pending.result(timeout=_POLL_S)
                    break
                except TimeoutError:
                    pass
                self.flush_output()
                self.check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{self.owner!r}: the workers did not answer within {seconds} s.")
        except KeyboardInterrupt:
            self.interrupt()
            raise
        except WorkerDiedError:
            raise
        except Exception as e:
            self.check_alive()
            if type(e).__name__ == "SupervisionError":  # a process on another host ended
                self.lost(str(e))
            raise RuntimeError(f"{self.owner!r}: a call to the workers failed: {e}") from e
        finally:
            self.flush_output()
        return value if single else [v for _, v in sorted(value.items(), key=lambda kv: kv[0].rank)]

    def drain(self, raise_errors: bool = True) -> None:
        """Wait for the calls issued without waiting; raise the first that failed (the root cause:
        later failures only read what it never made)."""
        pending, self.outstanding = self.outstanding, []
        for _, future in pending:
            replies = self.wait_for(future)
            if raise_errors:
                self.raise_failures_of(replies)

    def raise_failures_of(self, replies) -> None:
        failed = [(r, report) for r, (status, report) in enumerate(replies) if status == "error"]
        if failed:
            raise _rebuild(failed, self.owner)
        if any(status == "cancelled" for status, _ in replies):
            raise KeyboardInterrupt("the call was interrupted before it ran")

    def interrupt(self) -> None:
        """Drop every call issued so far that has not started; the one running finishes."""
        below = next(self.ids)
        self.outstanding = []
        try:
            self.wait_for(self.controls.interrupt.call(below), seconds=10)
        except BaseException:  # noqa: B036 - a second interrupt, or dead workers: the caller's error stands
            pass

    def check_alive(self) -> None:
        if self.closing:
            return
        dead = [(r, pid) for r, pid in enumerate(self.pids) if pid is not None and not _alive(pid)]
        if not dead:
            return
        self.lost("the process of " + ", ".join(f"rank {r} (pid {pid})" for r, pid in dead) + " has ended")

    def lost(self, what: str) -> None:
        """Stop every worker and say why: the ranks left cannot go on without the one that ended."""
        owner = self.owner
        owner._state = None
        forward.pop(owner)
        self.close(force=True)
        raise WorkerDiedError(f"{owner!r}: {what}. The other ranks cannot go on without it, so every worker was "
                              f"stopped and the arrays they held are gone; start again with {owner!r}.")

    def flush_output(self) -> None:
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
            end = data.rfind(b"\n") + 1  # whole lines only: the rest waits for its end
            f.seek(start + end)
            if not end:
                continue
            text = data[:end].decode(errors="replace")
            if len(self.owner.output) > 1 or r != 0:
                text = "".join(f"[rank {r}] {line}" for line in text.splitlines(keepends=True))
            print(text, end="", flush=True)


def _signature(fn, args, kwargs):
    """What decides a call's results' shapes, dtypes and shardings; None where it cannot be told."""
    leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
    key = [fn, spec]
    for x in leaves:
        if isinstance(x, Array):
            key.append(("array", tuple(x.shape), x.dtype, x.sharding))
        elif isinstance(x, torch.Tensor):
            key.append(("tensor", tuple(x.shape), x.dtype, x.device))
        elif isinstance(x, (Remote, ProcessMesh)) or getattr(type(x), "__ndfunc_twin__", False):
            key.append(("ref", id(x)))
        else:
            try:
                hash(x)
            except TypeError:
                return None
            key.append((type(x), x))
    try:
        return hash(tuple(key)) and tuple(key)
    except TypeError:
        return None


def _arrays(trees) -> list[Array]:
    return [x for x in optree.tree_leaves(trees, none_is_leaf=True) if isinstance(x, Array)]


def _gone(handle, owner) -> str:
    what = type(handle).__name__
    if handle._owner is not owner or owner._state is None:
        return (f"this {what} lived on the workers of {handle._owner!r}, which have stopped: its blocks are gone. "
                f"Fetch values with nf.device_get before leaving the block.")
    return (f"this {what} was donated to a step (donate_argnums) or freed: its buffers now hold the step's "
            f"results. Use what the step returned instead.")


def _rebuild(failed: list, owner) -> BaseException:
    """The first failing rank's exception, as raised there, with a note naming the rank and the
    user's line (read here, where the notebook's cells are)."""
    import linecache

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
