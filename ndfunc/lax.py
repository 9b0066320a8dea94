"""Collectives over named mesh axes, for code that runs per rank inside `nf.shard_map`.

Names and semantics follow `jax.lax`. Every collective is differentiable by its exact linear
transpose in the per-rank program: psum -> psum, pmean -> pmean, all_gather -> psum_scatter,
psum_scatter -> all_gather, ppermute -> the inverse permutation, all_to_all -> all_to_all with split
and concat swapped. `nf.shard_map` closes the system at its boundary: an input that every rank of
an axis holds whole gets the sum of their cotangents (the transpose of handing it to each), and an
output declared whole along an axis hands each of its holders an equal share of the cotangent. So
gradients are right without JAX's varying-axis types; where those types would save a collective
(Megatron's backward needs one all-reduce, this takes two), the compiler's partitioner is the place
to get the optimum.

An `axis_name` is one mesh axis or a tuple of them in mesh order (taken as one flattened axis, the
first name major). On an axis of size 1 every collective is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import torch

from ndfunc._src import varying
from ndfunc._src.sharding.mesh import Mesh
from ndfunc._src.torch_compat import (
    flattened,
    functional_collectives,
    local_tensor_mode,
    unset_fake_temporarily,
)

_funcol = functional_collectives()

__all__ = ["all_gather", "all_to_all", "axis_index", "axis_size", "pmax", "pmean", "ppermute", "psum", "psum_scatter"]

AxisName = str | tuple[str, ...]

_manual_mesh: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("ndfunc_manual_mesh", default=None)


@contextlib.contextmanager
def _manual_axes(mesh: Mesh) -> Iterator[None]:
    """Inside, collectives name axes of `mesh` (entered by `nf.shard_map`)."""
    token = _manual_mesh.set(mesh)
    try:
        yield
    finally:
        _manual_mesh.reset(token)


def _group(axis_name: AxisName, op: str):
    """(mesh, group for funcol, axis size) for `axis_name`, with errors that say what to do."""
    mesh = _manual_mesh.get()
    if mesh is None:
        raise RuntimeError(
            f"nf.lax.{op} runs per rank over a named mesh axis, so it belongs inside a function mapped "
            f"by nf.shard_map(fn, mesh, in_specs, out_specs)."
        )
    names = _names(axis_name)
    unknown = [a for a in names if a not in mesh.axis_names]
    if unknown or not names:
        raise ValueError(
            f"nf.lax.{op}: axis_name {axis_name!r} is not an axis of the shard_map's mesh, whose axes "
            f"are {mesh.axis_names}."
        )
    order = [mesh.axis_names.index(a) for a in names]
    if order != sorted(order):
        raise ValueError(
            f"nf.lax.{op}: axis_name {axis_name!r} lists mesh axes out of mesh order; write them as the "
            f"mesh orders them: {tuple(sorted(names, key=mesh.axis_names.index))}."
        )
    size = 1
    for a in names:
        size *= mesh.axis_size(a)
    if len(names) == 1:
        return (mesh.device_mesh, order[0]), size
    from ndfunc._src.trace import is_tracing

    if is_tracing():  # making the flattened group computes on real tensors, not traced ones
        from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

        with unset_fake_temporarily(), disable_proxy_modes_tracing():
            return flattened(mesh.device_mesh[names]), size
    return flattened(mesh.device_mesh[names]), size


def _wait(x: torch.Tensor) -> torch.Tensor:
    return _funcol.wait_tensor(x) if isinstance(x, _funcol.AsyncCollectiveTensor) else x


# The collectives run inside autograd Functions that define their own transposes, so their own
# autograd must not engage (under torch.func.grad it would, and it cannot be transformed).
@torch.no_grad()
def _all_reduce(x, op, group):
    return _wait(_funcol.all_reduce(x, op, group))


@torch.no_grad()
def _all_gather(x, dim, group):
    return _wait(_funcol.all_gather_single(x.contiguous(), dim, group))


@torch.no_grad()
def _reduce_scatter(x, dim, group):
    return _wait(_funcol.reduce_scatter_single(x.contiguous(), "sum", dim, group))


class _Linear(torch.autograd.Function):
    """A linear map `forward(x, *args)` whose transpose is `transpose(g, *args)`. An autograd
    Function with setup_context, so torch.func transforms see through it too."""

    @staticmethod
    def forward(x, forward, transpose, *args):
        return forward(x, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.transpose, ctx.args = inputs[2], inputs[3:]

    @staticmethod
    def backward(ctx, grad):
        return (ctx.transpose(grad, *ctx.args), None, None, *(None for _ in ctx.args))


def _scaled_sum(x, group, scale):
    total = _all_reduce(x, "sum", group)
    return total * scale if scale != 1 else total


def _identity(x, *args):
    return x.view_as(x)


def _divide(x, holders):
    return x / holders


class _Pmax(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return _all_reduce(x, "max", group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        return grad * (x == out).to(grad.dtype), None  # every rank holding the max gets the cotangent


def _replicated_axes(mesh: Mesh, spec) -> tuple[str, ...]:
    """The axes (of size > 1, in mesh order) along which a value laid out by `spec` is whole."""
    return tuple(a for a in mesh.axis_names if a not in spec.axes and mesh.axis_size(a) > 1)


def _enter_input(x: torch.Tensor, mesh: Mesh, spec) -> torch.Tensor:
    axes = _replicated_axes(mesh, spec)
    if not axes or not x.requires_grad:
        return x
    with _manual_axes(mesh):
        group, _ = _group(axes, "shard_map")
    return _Linear.apply(x, _identity, _scaled_sum, group, 1)  # its cotangents, summed


def _leave_output(y: torch.Tensor, mesh: Mesh, spec) -> torch.Tensor:
    axes = _replicated_axes(mesh, spec)
    holders = 1
    for a in axes:
        holders *= mesh.axis_size(a)
    return _Linear.apply(y, _identity, _divide, holders) if holders > 1 and y.requires_grad else y


def psum(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """The sum of `x` over the ranks of `axis_name`, on every one of them."""
    group, size = _group(axis_name, "psum")
    return _same_along(x, axis_name, x if size == 1 else _Linear.apply(x, _scaled_sum, _scaled_sum, group, 1))


def pmean(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """The mean of `x` over the ranks of `axis_name`, on every one of them."""
    group, size = _group(axis_name, "pmean")
    return _same_along(x, axis_name, x if size == 1 else _Linear.apply(x, _scaled_sum, _scaled_sum, group, 1.0 / size))


def pmax(x: torch.Tensor, axis_name: AxisName) -> torch.Tensor:
    """The elementwise max of `x` over the ranks of `axis_name`, on every one of them."""
    group, size = _group(axis_name, "pmax")
    return _same_along(x, axis_name, x if size == 1 else _Pmax.apply(x, group))


def all_gather(x: torch.Tensor, axis_name: AxisName, dim: int = 0, tiled: bool = False) -> torch.Tensor:
    """Every rank's `x` along `axis_name`, in axis order: concatenated along `dim` when `tiled`,
    else stacked in a new dim at `dim` (JAX's `all_gather(x, axis_name, axis=dim, tiled=...)`)."""
    group, size = _group(axis_name, "all_gather")
    if not tiled:
        x = x.unsqueeze(dim)
    dim = dim % x.ndim
    return _same_along(x, axis_name, x if size == 1 else _Linear.apply(x, _all_gather, _reduce_scatter, dim, group))


def psum_scatter(x: torch.Tensor, axis_name: AxisName, dim: int = 0, tiled: bool = False) -> torch.Tensor:
    """The sum over `axis_name` of `x`, of which rank i keeps block i along `dim` (tiled) or, untiled,
    row i of `dim` (whose size must be the axis size), that dim removed."""
    group, size = _group(axis_name, "psum_scatter")
    dim = dim % x.ndim
    if not tiled and x.shape[dim] != size:
        raise ValueError(
            f"nf.lax.psum_scatter(tiled=False) needs dim {dim} of size {size} (the size of {axis_name!r}), "
            f"got shape {tuple(x.shape)}; pass tiled=True to split a dim of any multiple of {size}."
        )
    if x.shape[dim] % size:
        raise ValueError(
            f"nf.lax.psum_scatter: dim {dim} of shape {tuple(x.shape)} does not split into {size} equal blocks."
        )
    out = x if size == 1 else _Linear.apply(x, _reduce_scatter, _all_gather, dim, group)
    return _varying_along(x, axis_name, out if tiled else out.squeeze(dim))


def _names(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _split_axes(axis_name: AxisName) -> frozenset:
    """The axes of `axis_name` a value can differ along (those of size > 1)."""
    mesh = _manual_mesh.get()
    return frozenset(a for a in _names(axis_name) if mesh.axis_size(a) > 1)


def _same_along(x: torch.Tensor, axis_name: AxisName, out: torch.Tensor) -> torch.Tensor:
    """`out`, made from `x` the same on every rank along `axis_name` (`varying`)."""
    return varying.varies(out, varying.axes_of(x) - _split_axes(axis_name))


def _varying_along(x: torch.Tensor, axis_name: AxisName, out: torch.Tensor) -> torch.Tensor:
    """`out`, made from `x` different on each rank along `axis_name` (`varying`)."""
    return varying.varies(out, varying.axes_of(x) | _split_axes(axis_name))


def axis_size(axis_name: AxisName) -> int:
    """The number of ranks along `axis_name`."""
    return _group(axis_name, "axis_size")[1]


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """This rank's position along `axis_name` (0-d int64; in simulation, each rank's own)."""
    mesh = _manual_mesh.get()
    _group(axis_name, "axis_index")
    names = _names(axis_name)

    def position(coordinate: Sequence[int]) -> int:
        index = 0
        for a in names:
            index = index * mesh.axis_size(a) + coordinate[mesh.axis_names.index(a)]
        return index

    from ndfunc._src.trace import is_tracing

    if is_tracing():  # in nf.jit's program: read from the rank's coordinates when it runs
        from ndfunc._src import manual
        return varying.varies(manual.axis_index(names, mesh.device_mesh.device_type), _split_axes(names))
    mode = local_tensor_mode()
    if mode is not None:
        return varying.varies(mode.rank_map(lambda r: torch.tensor(position(mesh.coordinate(r)))), _split_axes(names))
    import torch.distributed as dist

    return varying.varies(torch.tensor(position(mesh.coordinate(dist.get_rank()))), _split_axes(names))


def ppermute(x: torch.Tensor, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send `x` from position `src` to position `dst` along `axis_name` for each `(src, dst)` in
    `perm`; a position no pair sends to gets zeros (JAX's semantics). Each rank sends its one block,
    point to point (in simulation, on real ranks and inside nf.jit)."""
    _, size = _group(axis_name, "ppermute")
    mesh = _manual_mesh.get()
    pairs = [(int(s), int(d)) for s, d in perm]
    sources, dests = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(sources)) != len(sources) or len(set(dests)) != len(dests) or not all(0 <= i < size for i in sources + dests):
        raise ValueError(
            f"nf.lax.ppermute: perm {perm} must pair distinct sources with distinct destinations, each in "
            f"0..{size - 1} (the positions along {axis_name!r})."
        )
    names = _names(axis_name)
    ranks = _global_pairs(mesh, names, pairs)
    back = tuple((d, s) for s, d in ranks)
    return _varying_along(x, axis_name, _Linear.apply(x, _permute, _unpermute, ranks, back, ",".join(names)))


def _global_pairs(mesh: Mesh, names: tuple[str, ...], pairs: list) -> tuple:
    """(global rank, global rank it sends to) of every rank: position `s` along `names` (their
    positions together, major to minor) sends to position `d`, its other coordinates the same."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    dims = [mesh.axis_names.index(a) for a in names]

    def at(coord, position: int) -> tuple:  # `coord` with its position along `names` set
        coord = list(coord)
        for d in reversed(dims):
            position, coord[d] = divmod(position, sizes[mesh.axis_names[d]])
        return tuple(coord)

    out = []
    for r in range(math.prod(mesh.axis_sizes)):
        coord = mesh.coordinate(r)
        position = 0
        for d in dims:
            position = position * sizes[mesh.axis_names[d]] + coord[d]
        out += [(r, mesh.rank_of(at(coord, dst))) for src, dst in pairs if src == position]
    return tuple(out)


def _permute(x: torch.Tensor, pairs: tuple, inverse: tuple, axis: str) -> torch.Tensor:
    """The permutation itself (its transpose is the inverse permutation, `inverse`)."""
    from ndfunc._src.trace import is_tracing

    if is_tracing():  # a node of nf.jit's program; its lowering runs `permute_blocks`
        from ndfunc._src.manual import ppermute_op
        return ppermute_op(x, [r for pair in pairs for r in pair], axis)
    from ndfunc._src.point_to_point import permute_blocks
    return permute_blocks(x, pairs)


def _unpermute(x: torch.Tensor, pairs: tuple, inverse: tuple, axis: str) -> torch.Tensor:
    return _permute(x, inverse, pairs, axis)


def all_to_all(x: torch.Tensor, axis_name: AxisName, split_dim: int, concat_dim: int, tiled: bool = False) -> torch.Tensor:
    """Split `x` into axis-size blocks along `split_dim`, send block j to position j, and join what
    arrives along `concat_dim` in source order. Untiled (JAX's default) `split_dim` must have the
    axis size and is removed; the arrivals are stacked in a new dim at `concat_dim`."""
    group, size = _group(axis_name, "all_to_all")
    split_dim = split_dim % x.ndim
    if not tiled:
        if x.shape[split_dim] != size:
            raise ValueError(
                f"nf.lax.all_to_all(tiled=False) needs split_dim {split_dim} of size {size}, got shape "
                f"{tuple(x.shape)}; pass tiled=True to split a dim of any multiple of {size}."
            )
        out = all_to_all(x, axis_name, split_dim, split_dim, tiled=True)  # exchange blocks in place
        return out.movedim(split_dim, concat_dim)
    if x.shape[split_dim] % size:
        raise ValueError(f"nf.lax.all_to_all: split_dim {split_dim} of shape {tuple(x.shape)} does not split into {size} blocks.")
    concat_dim = concat_dim % x.ndim
    return _varying_along(x, axis_name, x if size == 1 else _Linear.apply(x, _exchange, _unexchange, split_dim,
                                                                           concat_dim, group, size))


def _exchange(x, split_dim, concat_dim, group, size):
    blocks = x.movedim(split_dim, 0).unflatten(0, (size, -1))  # (size, block, ...): block j for j
    with torch.no_grad():
        arrived = _wait(_funcol.all_to_all_single(blocks.contiguous(), None, None, group))  # (size, block, ...) from i
    arrived = arrived.flatten(0, 1).movedim(0, split_dim)  # back in place: split_dim holds the arrivals
    if concat_dim == split_dim:
        return arrived
    pieces = arrived.chunk(size, dim=split_dim)
    return torch.cat(pieces, dim=concat_dim)


def _unexchange(x, split_dim, concat_dim, group, size):
    return _exchange(x, concat_dim, split_dim, group, size)
