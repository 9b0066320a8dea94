"""Layouts: one DTensor placement per partitioned mesh axis, and the shapes they imply.

The partitioner works over the mesh axes of size > 1 only (a size-1 axis never needs a
collective), so a layout here has one entry per such axis. Entries are `Replicate()`,
`Shard(dim)` or `Partial(op)` (a pending sum or mean over that axis); several axes sharding one
dim split it in mesh order, major to minor, as DTensor does.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

Layout = tuple  # of placements, one per partitioned mesh axis

R = Replicate()
MANUAL: Layout = ("manual",)  # a value inside a shard_map region: already this rank's own block
PARTIAL_OPS = ("sum", "avg", "max", "min")  # reductions the lowering knows how to finish
EXTREMA = ("max", "min")  # finished by an all-reduce only (a reduce-scatter by max is not every backend's)


def replicated(k: int) -> Layout:
    return (R,) * k


_EXACT = frozenset({Shard, Replicate, Partial})


def placement_is(p, kind: type) -> bool:
    """`isinstance(p, kind)` for a placement, its exact type read first: DTensor's placements are
    opaque types whose `isinstance` runs Python, and the partitioner asks this per candidate."""
    exact = type(p)
    return exact is kind if exact in _EXACT else isinstance(p, kind)


def split(layout: Layout, sizes: Sequence[int], dim: int) -> int:
    """How many blocks `dim` is cut into."""
    return math.prod(n for p, n in zip(layout, sizes) if isinstance(p, Shard) and p.dim == dim)


def local_shape(shape: Sequence[int], layout: Layout, sizes: Sequence[int]) -> tuple[int, ...]:
    """Each dim over `split` (in one pass over the axes: a lowering asks this per value)."""
    out = list(shape)
    for p, n in zip(layout, sizes):
        if placement_is(p, Shard) and 0 <= p.dim < len(out):
            out[p.dim] //= n  # (floor divisions in turn: the product's)
    return tuple(out)


def fits(layout: Layout, shape: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether `layout` can hold a value of `shape`: every sharded dim exists and divides evenly."""
    blocks = [1] * len(shape)
    for i, p in enumerate(layout):
        kind = type(p)  # exact types first: isinstance on placements is slow, and this runs per candidate
        if kind is Shard:
            if not 0 <= p.dim < len(shape):
                return False
            if i < len(sizes):
                blocks[p.dim] *= sizes[i]
        elif kind is Replicate:
            continue
        elif kind is Partial:
            if p.reduce_op not in PARTIAL_OPS:
                return False
        elif isinstance(p, Partial):  # a subclass reduces otherwise than its reduce_op says (DTensor's
            return False  # _NormPartial: partial p-norms, summed as p-th powers), which no collective here does
        elif not isinstance(p, Replicate):
            return False  # _StridedShard and friends stay outside programs
    return all(s % b == 0 for s, b in zip(shape, blocks))


@functools.cache
def subset_products(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The products of every nonempty set of mesh axes' sizes: what a split dim's blocks can be."""
    return tuple(sorted({math.prod(c) for r in range(1, len(sizes) + 1) for c in itertools.combinations(sizes, r)}))


def all_layouts(shape: Sequence[int], sizes: Sequence[int], partial: bool = True) -> tuple[Layout, ...]:
    """Every layout a value of `shape` can take (sum partials included if `partial`)."""
    return _all_layouts(tuple(shape), tuple(sizes), partial)


@functools.lru_cache(maxsize=4096)
def _all_layouts(shape: tuple[int, ...], sizes: tuple[int, ...], partial: bool) -> tuple[Layout, ...]:
    # made once per shape and mesh: a 4-axis mesh has hundreds, asked for by every view of the shape
    return tuple(lay for lay in itertools.product(axis_placements(len(shape), partial), repeat=len(sizes))
                 if fits(lay, shape, sizes))


def axis_placements(ndim: int, partial: bool = True) -> tuple:
    """What one mesh axis can hold of a value of `ndim` dims, in the order `all_layouts` takes them
    (so a product over the axes lists layouts in its order)."""
    return (R, *((Partial("sum"),) if partial else ()), *(Shard(d) for d in range(ndim)))


def describe(layout: Layout, names: Sequence[str]) -> str:
    """`{dp: S(0), tp: P(sum)}`-style text; `{}` for fully replicated."""
    if layout == MANUAL:
        return "{manual}"
    parts = []
    for p, name in zip(layout, names):
        if isinstance(p, Shard):
            parts.append(f"{name}: S({p.dim})")
        elif isinstance(p, Partial):
            parts.append(f"{name}: P({p.reduce_op})")
    return "{" + ", ".join(parts) + "}"
