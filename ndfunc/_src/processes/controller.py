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

import math
import time

import torch
import torch.distributed as dist

from ndfunc._src import forward
from ndfunc._src.processes.handles import Remote
from ndfunc._src.processes.session import Session
from ndfunc._src.processes.watch import WorkerDiedError
from ndfunc._src.runtime import is_simulated


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
        self.per_host, self.world_size = n, n * self.num_hosts
        self.timeout, self.threads = timeout, threads
        self.show_output(output)
        self._session = None

    # -- the block -------------------------------------------------------------------------------

    def start(self) -> "processes":
        if self._session is not None:
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
        self._session = Session(self, launch)
        try:
            self._session.start(self.per_host, self.hosts, self.device, self.threads, self.timeout)
        except BaseException:
            session, self._session = self._session, None
            session.close(clean=False)
            raise
        self.start_seconds = time.perf_counter() - started  # (what the notebook reports)
        forward.push(self)
        return self

    def stop(self) -> None:
        """End every worker, once the calls sent have run (the first that failed is raised then);
        arrays still held here are gone with them."""
        self._end(clean=True)

    def __enter__(self) -> "processes":
        return self.start()

    def __exit__(self, kind, *exc) -> None:
        self._end(clean=kind is None)  # (leaving on an exception: the workers end, no more waiting)

    def _end(self, clean: bool) -> None:
        session, self._session = self._session, None
        forward.pop(self)
        if session is not None:
            session.close(clean=clean)

    def __repr__(self) -> str:
        hosts = "" if self.hosts is None else f" on {self.num_hosts} hosts"
        return f"nf.processes({self.per_host}, device={self.device!r}){hosts}"

    def __reduce__(self):
        raise TypeError(f"{self!r} drives worker processes from this one; it cannot be sent to them.")

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, rank by rank."""
        return list(self._running().pids)

    def show_output(self, ranks: int | list[int] | str = 0) -> None:
        """Show these ranks' printed output in the notebook: a rank, a list, or "all" (others' is kept)."""
        if ranks == "all":
            ranks = list(range(self.world_size))
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad:
            raise ValueError(f"{self!r}: output names ranks 0..{self.world_size - 1} (or 'all'), got {bad}.")
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
        return self._session is not None and self._session.holds(handle)

    def release(self, ref) -> None:
        if self._session is not None:
            self._session.frees.append(ref)

    def reference(self, handle):
        raise TypeError(f"{type(handle).__name__} handles of {self!r} cannot be pickled; fetch the value with "
                        f"nf.device_get first.")

    def _running(self) -> Session:
        if self._session is None:
            raise RuntimeError(f"{self!r} is not running (never started, stopped, or its workers died); its arrays "
                               f"are gone. Start it again (nf.processes(n)), and fetch what you need with "
                               f"nf.device_get before leaving the block.")
        return self._session
