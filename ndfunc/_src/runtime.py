"""Where ranks come from: simulated in this process, or real processes under torchrun.

`nf.simulate(n)` holds all n ranks in one process: torch's `LocalTensorMode` keeps every rank's
value of each tensor side by side and runs collectives over them, over a fake process group.
`nf.init()` joins the real world that torchrun describes (gloo on CPUs, NCCL on GPUs). The same
user code runs under either; nothing here is global beyond torch.distributed's own default group
(and, in a gloo world, malloc's thresholds: `ndfunc._src.host_memory`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist

from ndfunc._src import forward
from ndfunc._src.host_memory import keep_freed_memory
from ndfunc._src.sharding.mesh import mesh_context, restore_mesh_context
from ndfunc._src.torch_compat import (
    LocalTensor,
    LocalTensorMode,
    current_dispatch_mode,
    fake_store,
    local_blocks,
    local_tensor_mode,
    pop_dispatch_mode,
    pytree,
    random_rng_tracker,
    set_random_rng_tracker,
)


class _SimulatedRanks(LocalTensorMode):
    """torch's LocalTensorMode, but an explicit `torch.Generator` draws as it would on real ranks.

    There each process holds its own copy of an identically seeded generator, so every rank draws
    the same numbers. LocalTensorMode runs an op once per rank with the one shared generator, each
    rank drawing the next numbers: a data order or an init would differ from rank to rank. Here
    each rank starts from the generator's state before the op, and the generator ends as one
    rank's draw leaves it. (The default generator is already kept per rank by LocalTensorMode.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        generators = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Generator)]
        if not generators:
            return super().__torch_dispatch__(func, types, args, kwargs)
        states = [g.get_state() for g in generators]
        results = {}
        for r in sorted(self.ranks):
            for g, state in zip(generators, states):
                g.set_state(state)
            rank_args, rank_kwargs = pytree.tree_map_only(
                LocalTensor, lambda t, r=r: local_blocks(t)[r], (args, kwargs))
            results[r] = func(*rank_args, **rank_kwargs)
        if func._schema.is_mutable:  # written in place (`normal_`, `out=`): the rank blocks were
            return args[0] if args and isinstance(args[0], LocalTensor) else kwargs.get("out")
        first = results[min(results)]
        leaves, spec = pytree.tree_flatten(first)
        per_rank = {r: pytree.tree_leaves(out) for r, out in results.items()}
        return pytree.tree_unflatten(
            [LocalTensor({r: per_rank[r][i] for r in per_rank}) if isinstance(leaf, torch.Tensor) else leaf
             for i, leaf in enumerate(leaves)], spec)


class simulate:
    """Run with `num_ranks` ranks simulated in this process.

    Every tensor made inside holds one value per rank; meshes, `device_put` and collectives behave
    as on `num_ranks` real processes. Each op of eager code inside runs once per simulated rank (a
    compiled step runs rank by rank at the ops' own cost), so what every rank would make alike - a
    dataset, a single-device reference - is best made before entering: a plain tensor passed in
    is a value every rank holds. On exit the process group and the mode are torn down, so
    nothing made inside outlives the simulation. Use it as a context manager, or, in a notebook
    where a block cannot span cells, `sim = nf.simulate(8).start()` ... `sim.stop()`.

    Example:
        >>> with nf.simulate(8):
        ...     nf.make_mesh({'dp_shard': 4, 'tp': 2}).shape
        {'dp_shard': 4, 'tp': 2}
    """

    def __init__(self, num_ranks: int):
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"simulate needs a number of ranks >= 1, got {num_ranks!r}.")
        self.num_ranks = num_ranks
        self._mode: LocalTensorMode | None = None
        self._rng_tracker = None
        self._mesh_context = None

    def start(self) -> "simulate":
        if self._mode is not None:
            raise RuntimeError(f"this simulate({self.num_ranks}) is already running.")
        if forward.active() is not None:
            raise RuntimeError(f"simulate({self.num_ranks}) was started inside {forward.active()!r}, whose workers "
                               f"are real ranks; leave that block (or stop() it) first, or simulate outside it.")
        if dist.is_initialized():
            raise RuntimeError(
                f"simulate({self.num_ranks}) needs a process with no process group, but one of world "
                f"size {dist.get_world_size()} is running (nf.init(), torchrun, or a simulation "
                f"still open); leave it first, or run without nf.simulate."
            )
        self._rng_tracker = random_rng_tracker()
        self._mesh_context = mesh_context()
        hook = sys.excepthook
        dist.init_process_group("fake", rank=0, world_size=self.num_ranks, store=fake_store())
        # torch wraps the hook to prefix every line of a traceback with "[rank0]: ", and never
        # unwraps it: one process playing every rank would gain a prefix per simulation
        sys.excepthook = hook
        self._mode = _SimulatedRanks(self.num_ranks)
        self._mode.__enter__()
        return self

    def stop(self) -> None:
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(None, None, None)
        finally:
            dist.destroy_process_group()
            set_random_rng_tracker(self._rng_tracker)
            # Meshes made inside die with the world: bare `P`s must not find them afterwards.
            restore_mesh_context(self._mesh_context)

    def __enter__(self) -> "simulate":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"simulate({self.num_ranks})"


def is_simulated() -> bool:
    """Whether this code runs inside `nf.simulate`."""
    return local_tensor_mode() is not None


@contextlib.contextmanager
def simulation_paused():
    """A block in which tensors are plain, inside `nf.simulate` too: its mode disabled and, where
    it is the innermost mode, off the dispatch stack (merely disabled, it would still see and pass
    on every op, at a cost per op far above a small op's own); elsewhere nothing changes. For fake
    tensors, files, whole values, and the ranks' blocks run op by op."""
    mode = local_tensor_mode()
    if mode is None:
        yield
        return
    with mode.disable():
        if current_dispatch_mode() is mode:
            with pop_dispatch_mode():
                yield
        else:
            yield


def init(backend: str | None = None, keep_host_memory: bool = True, timeout: float | None = None) -> None:
    """Join the world of processes that torchrun started; idempotent.

    Reads torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    `MASTER_PORT`). Uses NCCL when CUDA is available (each process on GPU `LOCAL_RANK`) and gloo
    otherwise. Without that environment it starts a world of one process, so a script or notebook
    runs unchanged on one machine. Inside `nf.simulate` (or after an earlier call) it does nothing.
    A gloo world (steps on CPU) keeps freed host memory mapped between steps unless
    `keep_host_memory=False` (`ndfunc._src.host_memory`: glibc's malloc thresholds, process-wide).
    `timeout` (seconds; else `NDFUNC_TIMEOUT` from the environment, else torch's default): how long
    a collective waits for the other ranks before it fails, so a rank that stopped is an error on
    the others, not a hang.
    """
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"nf.init: timeout is a positive number of seconds, got {timeout!r}.")
    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if cpu_backend(backend) == "gloo" and keep_host_memory:
        keep_freed_memory()
    timeout = timeout if timeout is not None else _seconds(os.environ.get("NDFUNC_TIMEOUT"))
    options = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if backend == "nccl":  # this process's GPU, named to the group too (its barriers need it)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        options["device_id"] = device
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://", **options)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)


def _seconds(text: str | None) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"NDFUNC_TIMEOUT is {text!r}; expected a positive number of seconds (e.g. 60), or unset "
                         f"for torch's default.")
    return value


def shutdown() -> None:
    """Leave the world `nf.init()` joined: wait for every rank, then tear the process group down.

    Call it once at the end of a torchrun script; a process that exits with gloo's threads still
    running can abort. Inside `nf.simulate` it does nothing (the block's exit tears down).
    """
    if not dist.is_initialized() or is_simulated():
        return
    dist.barrier()
    dist.destroy_process_group()


def rank() -> int:
    """This process's rank (0 without a world; 0 in simulation, where one process plays all, and in
    the notebook that drives `nf.processes`, whose rank 0 answers it)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks: processes under torchrun or `nf.processes(n)`, simulated ranks in
    `nf.simulate(n)`."""
    controller = forward.active()
    if controller is not None:
        return controller.world_size
    return dist.get_world_size() if dist.is_initialized() else 1


def cpu_backend(name: str) -> str:
    """'gloo' of 'gloo' and of 'cpu:gloo,cuda:nccl'."""
    per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return per_device.get("cpu", name)
