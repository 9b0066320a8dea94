"""Where ranks come from: simulated in this process, or real processes under torchrun.

`nf.simulate(n)` holds all n ranks in one process: torch's `LocalTensorMode` keeps every rank's
value of each tensor side by side and runs collectives over them, over a fake process group.
`nf.init()` joins the real world that torchrun describes (gloo on CPUs, NCCL on GPUs). The same
user code runs under either; nothing here is global beyond torch.distributed's own default group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode, local_tensor_mode


@contextlib.contextmanager
def simulate(num_ranks: int) -> Iterator[None]:
    """Run the block with `num_ranks` ranks simulated in this process.

    Every tensor made inside holds one value per rank; meshes, `device_put` and collectives behave
    as on `num_ranks` real processes. On exit the process group and the mode are torn down, so
    nothing made inside outlives the block.

    Example:
        >>> with nf.simulate(8):
        ...     mesh = nf.make_mesh({'dp_shard': 4, 'tp': 2})
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"simulate needs a number of ranks >= 1, got {num_ranks!r}.")
    if dist.is_initialized():
        raise RuntimeError(
            f"simulate({num_ranks}) needs a process with no process group, but one of world size "
            f"{dist.get_world_size()} is running (nf.init(), torchrun, or a simulate block still "
            f"open); leave it first, or run without nf.simulate."
        )
    from torch.distributed.tensor import _random
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    rng_tracker = _random._rng_tracker
    dist.init_process_group("fake", rank=0, world_size=num_ranks, store=FakeStore())
    try:
        with LocalTensorMode(num_ranks):
            yield
    finally:
        dist.destroy_process_group()
        _random._rng_tracker = rng_tracker


def is_simulated() -> bool:
    """Whether this code runs inside `nf.simulate`."""
    return local_tensor_mode() is not None


def init(backend: str | None = None) -> None:
    """Join the world of processes that torchrun started; idempotent.

    Reads torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    `MASTER_PORT`). Uses NCCL when CUDA is available (each process on GPU `LOCAL_RANK`) and gloo
    otherwise. Without that environment it starts a world of one process, so a script or notebook
    runs unchanged on one machine. Inside `nf.simulate` (or after an earlier call) it does nothing.
    """
    if dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://")
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


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
    """This process's rank (0 without a world; 0 in simulation, where one process plays all)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks: processes under torchrun, simulated ranks in `nf.simulate(n)`."""
    return dist.get_world_size() if dist.is_initialized() else 1
