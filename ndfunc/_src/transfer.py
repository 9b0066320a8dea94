"""Moving values onto ranks and back: `device_put`, `device_get`, `make_array_from_callback`.

A sharded value is a DTensor whose placements come from a `NamedSharding`. Building one never
communicates: each rank takes its own block (`sharding.shard_indices(shape)[rank]`) of a value it
already has, or asks a callback for just that block. Reading one back gathers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ndfunc._src.forward import Handle, on_workers
from ndfunc._src.runtime import simulation_paused
from ndfunc._src.sharding.errors import ShardingError, where
from ndfunc._src.sharding.mesh import AbstractMesh, Mesh
from ndfunc._src.sharding.named_sharding import NamedSharding, resolve_sharding
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.sharding.shape_dtype import ShapeDtypeStruct
from ndfunc._src.torch_compat import (
    REDISTRIBUTE_LOGGER,
    DTensorSpec,
    LocalTensor,
    StridedShard,
    TensorMeta,
    dtensor_of_local,
    local_blocks,
    local_tensor_mode,
)
from ndfunc.tree import PyTree, tree_broadcast_prefix, tree_map_with_path

Index = tuple[slice, ...]


def sharding_of(x: torch.Tensor | ShapeDtypeStruct) -> NamedSharding | None:
    """The NamedSharding of a DTensor, or an `nf.ShapeDtypeStruct` stand-in's own (None for a plain
    tensor, which every rank holds whole): `optree.tree_map(nf.sharding_of, params)` lays a step's
    results out as its arguments came."""
    if isinstance(x, (ShapeDtypeStruct, Handle)):  # (an `nf.processes` array: its sharding, held here)
        return getattr(x, "sharding", None)
    if not isinstance(x, DTensor):
        return None
    device_mesh = x.device_mesh
    names = device_mesh.mesh_dim_names
    if names is None:
        raise ShardingError("a DTensor on a DeviceMesh without mesh_dim_names has no named sharding.")
    mesh = Mesh(AbstractMesh(tuple(zip(names, device_mesh.shape))), device_mesh)
    return NamedSharding.from_placements(mesh, x.placements, x.ndim)


@on_workers(asynchronous=True, signature=lambda shape, sharding, callback: (
    tuple(shape), sharding, getattr(callback, "__code__", callback)))
def make_array_from_callback(
    shape: Sequence[int], sharding: NamedSharding, callback: Callable[[Index], Any]
) -> DTensor:
    """A DTensor of global `shape` laid out by `sharding`, each rank's block from `callback(index)`.

    `index` is that rank's tuple of `slice`s into the global value; each rank asks only for its own
    block (in simulation, each simulated rank asks once), so no rank ever holds the whole value.

    Example:
        >>> full = torch.arange(32.).reshape(8, 4)
        >>> with nf.simulate(4):
        ...     mesh = nf.make_mesh(dp=4)
        ...     x = nf.make_array_from_callback(full.shape, NamedSharding(mesh, P('dp')), lambda i: full[i])
        ...     x.to_local().shape, torch.equal(nf.device_get(x), full)
        (torch.Size([2, 4]), True)
    """
    sharding = resolve_sharding(sharding)
    return _assemble(tuple(shape), sharding, lambda rank, index: callback(index))


@on_workers(asynchronous=True)
def device_put(tree: PyTree, shardings: PyTree) -> PyTree:
    """Lay out every tensor of `tree` as its sharding says, as DTensors.

    `shardings` is a prefix tree of `NamedSharding` (or of `P` under `with mesh:`): one sharding can
    stand for a whole subtree; a `None` leaf leaves its values as they are. A plain tensor is a
    global value every rank holds; each rank keeps its own block. A DTensor on the same mesh is redistributed (DTensor's collectives); one on
    another mesh is gathered, then split. Values are detached: ndfunc is functional, and gradients
    come from transforming functions, not from autograd state on the inputs.
    """
    shardings = tree_broadcast_prefix(
        shardings, tree, is_leaf=_is_sharding, prefix_name="shardings", full_name="values"
    )
    return tree_map_with_path(_put_leaf, tree, shardings)


def _put_leaf(path: str, x: Any, sharding: Any) -> Any:
    if sharding is None:  # as in JAX: no sharding given, the value stays as it is
        return x
    sharding = resolve_sharding(sharding, path)
    if sharding.spec.unreduced and not (isinstance(x, DTensor) and tuple(x.placements) == sharding.placements):
        raise ShardingError(
            f"{where(path)}device_put cannot lay a value out as {sharding.spec!r}: a whole value has no "
            f"parts of a sum to keep. Lay it out without unreduced; unreduced values come from nf.jit "
            f"(out_shardings) or make_array_from_callback, each rank giving its part."
        )
    if isinstance(x, DTensor):
        _check_mesh(sharding, path)
        if x.device_mesh == sharding.mesh.device_mesh:
            sharding.check(tuple(x.shape), path)
            with _quiet_redistribute():
                return x.redistribute(sharding.mesh.device_mesh, sharding.placements)
        x = _gather(x)  # another mesh: through the full value
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    x = x.detach()
    # Each rank's block is a copy, so the DTensor never aliases (or pins) the caller's tensor.
    return _assemble(tuple(x.shape), sharding, lambda rank, index: _on_rank(x, rank)[index].clone(), path)


@on_workers(fetch=True)
def device_get(tree: PyTree) -> PyTree:
    """Every DTensor of `tree` gathered to a full, plain tensor (the same on every rank), detached."""
    return tree_map_with_path(lambda path, x: _gather(x), tree)


def _gather(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.detach()  # values, as JAX's device_get gives: gather a DTensor with .full_tensor() to differentiate
    if isinstance(x, DTensor) and (whole := _placed_together(x)) is not None:
        return whole
    if isinstance(x, DTensor):
        ended = isinstance(x.to_local(), LocalTensor) and local_tensor_mode() is None
        try:
            with _quiet_redistribute():
                x = x.full_tensor()
        except RuntimeError:
            if not ended:
                raise
            raise RuntimeError(
                "nf.device_get: this value lives on ranks simulated by an nf.simulate block that has ended, so its "
                "blocks cannot be gathered any more. Call device_get inside the block (values it returns are plain "
                "tensors that outlive it).") from None
    if isinstance(x, LocalTensor):
        with simulation_paused():
            x = _reconcile(x)
    return x


def _placed_together(x: DTensor) -> torch.Tensor | None:
    """In simulation, the whole value of a split or replicated DTensor put together from its
    ranks' blocks where they lie (what gathering it would give, without running the collectives
    rank by rank); None where that does not apply (real ranks, a pending sum, an ended block).
    Ranks holding the same block must hold the same values, as `_reconcile` asks."""
    local = x.to_local()
    if not isinstance(local, LocalTensor) or local_tensor_mode() is None or any(
            not isinstance(p, (Shard, StridedShard, Replicate)) for p in x.placements):
        return None
    indices = sharding_of(x).shard_indices(tuple(x.shape))
    blocks = local_blocks(local)
    with simulation_paused():
        whole = torch.empty(x.shape, dtype=x.dtype, device=blocks[0].device)
        first: dict = {}
        for rank, index in enumerate(indices):
            block = blocks[rank]
            key = tuple((i.start, i.stop) for i in index)
            if key in first:
                _reconcile_pair(first[key], block)
                continue
            if tuple(whole[index].shape) != tuple(block.shape):
                return None  # a layout whose blocks the index math does not describe: gather it
            whole[index] = block
            first[key] = block
    return whole


def _reconcile_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    same = (torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
            if a.is_floating_point() or a.is_complex() else torch.equal(a, b))
    if not same:
        raise AssertionError("the simulated ranks hold different values for a tensor that is the same on "
                             "every rank (replicated): there is no single value to return")


def _reconcile(x: LocalTensor) -> torch.Tensor:
    """The one value every simulated rank holds. NaN counts as equal to NaN: a replicated loss over
    targets that are all ignored is NaN on every rank, as one device's is."""
    blocks = list(local_blocks(x).values())
    for other in blocks[1:]:
        _reconcile_pair(blocks[0], other)
    return blocks[0].clone()


def _assemble(
    shape: tuple[int, ...],
    sharding: NamedSharding,
    block: Callable[[int, Index], Any],
    path: str | None = None,
) -> DTensor:
    _check_mesh(sharding, path)
    indices = sharding.shard_indices(shape, path)
    expected = sharding.shard_shape(shape, path)
    device_mesh = sharding.mesh.device_mesh
    mode = local_tensor_mode()
    if mode is not None:
        with simulation_paused():  # each block is made as one rank would: plain ops, at plain speed
            blocks = {r: _checked(_on_rank(block(r, indices[r]), r), expected, r, path) for r in sorted(mode.ranks)}
        with mode.disable():
            dtypes = {b.dtype for b in blocks.values()}
            if len(dtypes) > 1:
                raise ShardingError(
                    f"{where(path)}the ranks' blocks have different dtypes {sorted(map(str, dtypes))}; "
                    f"every block of one value must have the same dtype (and device)."
                )
            local = LocalTensor(blocks)
    else:
        r = dist.get_rank()
        local = _checked(block(r, indices[r]), expected, r, path)
        if sharding.mesh.device_type != "cpu":
            local = local.to(torch.device(sharding.mesh.device_type, torch.accelerator.current_device_index()))
    return from_local(local, device_mesh, sharding.placements, shape)


def from_local(local: torch.Tensor, device_mesh, placements, shape: Sequence[int]) -> DTensor:
    """A contiguous DTensor of global `shape` from this rank's block, trusted as given (no check
    that the ranks agree, which would communicate), the block left on its device."""
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    if local.device.type != device_mesh.device_type:
        # DTensor.from_local would copy the block to the mesh's device type: a simulated mesh says
        # 'cpu' (its fake group's) over CUDA blocks, and a host copy of a CUDA value is kept on the host
        meta = TensorMeta(shape, stride, local.dtype)
        return dtensor_of_local(local, DTensorSpec(device_mesh, tuple(placements), tensor_meta=meta))
    return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=shape, stride=stride)


def _check_mesh(sharding: NamedSharding, path: str | None) -> None:
    if not isinstance(sharding.mesh, Mesh):
        raise ShardingError(
            f"{where(path)}placing values needs a sharding over a Mesh of ranks, got one over "
            f"{sharding.mesh!r}; build the mesh with nf.make_mesh (an AbstractMesh only plans)."
        )
    sharding.mesh.check_alive()


def _on_rank(x: Any, rank: int) -> Any:
    """Rank `rank`'s value of `x` (in simulation a tensor can differ across ranks)."""
    return local_blocks(x)[rank] if isinstance(x, LocalTensor) else x


def _checked(block: Any, expected: tuple[int, ...], rank: int, path: str | None) -> torch.Tensor:
    if not isinstance(block, torch.Tensor):
        block = torch.as_tensor(block)
    if tuple(block.shape) != expected:
        raise ShardingError(
            f"{where(path)}rank {rank}'s block has shape {tuple(block.shape)}, but the sharding "
            f"gives each rank a block of shape {expected}; the callback must return exactly "
            f"`full[index]` for the index it is given."
        )
    return block


def _is_sharding(x: Any) -> bool:
    return isinstance(x, (NamedSharding, PartitionSpec))


@contextlib.contextmanager
def _quiet_redistribute():
    # DTensor logs a performance warning when it gathers a dim split over several mesh axes in
    # more than one step; for a one-off device_get that is expected, not a problem to report.
    logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
