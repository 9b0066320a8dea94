"""PartitionSpec <-> DTensor placements, over an abstract mesh.

A spec is per tensor dim (which axes split it, major to minor); placements are per mesh axis
(which dim it splits). DTensor applies placements left to right in mesh order, each splitting the
block left by the previous ones. That is JAX's order exactly when a dim's axes are listed in mesh
order. Otherwise an axis must split a dim that a *later* mesh axis, more major in the spec, has
already split: DTensor's `_StridedShard(dim, split_factor=k)` says so, with k the product of the
sizes of those more-major, later axes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

from ndfunc._src.sharding.errors import ShardingError
from ndfunc._src.sharding.mesh import AbstractMesh
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.torch_compat import StridedShard


def spec_to_placements(mesh: AbstractMesh, spec: PartitionSpec) -> tuple:
    """One placement per mesh axis for `spec`; `Partial()` (a sum) for its unreduced axes,
    `Replicate()` for axes the spec does not use."""
    position = {name: i for i, name in enumerate(mesh.axis_names)}
    placements: list = [Replicate()] * len(position)
    for axis in spec.unreduced:
        placements[position[axis]] = Partial()
    for dim in range(len(spec)):
        axes = spec.dim_axes(dim)
        for i, axis in enumerate(axes):
            split_factor = math.prod(
                mesh.axis_size(major) for major in axes[:i] if position[major] > position[axis]
            )
            placements[position[axis]] = (
                Shard(dim) if split_factor == 1 else StridedShard(dim, split_factor=split_factor)
            )
    return tuple(placements)


def placements_to_spec(mesh: AbstractMesh, placements: Sequence, ndim: int) -> PartitionSpec:
    """The PartitionSpec whose placements are `placements` (the inverse of `spec_to_placements`).

    A pending sum (`Partial()`) is an unreduced axis.

    Raises:
        ShardingError: for a `Partial` placement of another reduction than a sum (no PartitionSpec
            describes it), a placement on a dim the value does not have, or a `_StridedShard` no
            spec produces.
    """
    placements = tuple(placements)
    if len(placements) != len(mesh.axis_names):
        raise ShardingError(
            f"expected one placement per mesh axis {mesh.axis_names}, got {len(placements)}: {placements}."
        )
    dim_axes: dict[int, list[str]] = {}
    unreduced = []
    for axis, placement in zip(mesh.axis_names, placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Partial):
            if placement.reduce_op != "sum":
                raise ShardingError(
                    f"placement {placement} on mesh axis {axis!r} is a pending {placement.reduce_op}, "
                    f"which no PartitionSpec describes (only a pending sum: unreduced); reduce it "
                    f"first (redistribute to Replicate or Shard)."
                )
            unreduced.append(axis)
            continue
        if not isinstance(placement, (Shard, StridedShard)):
            raise ShardingError(f"unsupported placement {placement!r} on mesh axis {axis!r}.")
        dim = placement.dim if placement.dim >= 0 else placement.dim + ndim
        if not 0 <= dim < ndim:
            raise ShardingError(
                f"placement {placement} on mesh axis {axis!r} shards dim {placement.dim}, but the "
                f"value has rank {ndim}."
            )
        dim_axes.setdefault(dim, []).append((axis, _with_dim(placement, dim)))
    entries: list = [None] * (max(dim_axes) + 1 if dim_axes else 0)
    for dim, axis_placements in dim_axes.items():
        entries[dim] = _major_to_minor(mesh, dim, dict(axis_placements))
    return PartitionSpec(*entries, unreduced=unreduced)


def _with_dim(placement, dim: int):
    if isinstance(placement, StridedShard):
        return StridedShard(dim, split_factor=placement.split_factor)
    return Shard(dim)


def _major_to_minor(mesh: AbstractMesh, dim: int, given: dict) -> tuple[str, ...]:
    # At most a handful of axes share a dim (the mesh has four), so try every order and keep the
    # one whose placements are the ones given.
    position = {name: i for i, name in enumerate(mesh.axis_names)}
    for order in itertools.permutations(given):
        produced = spec_to_placements(mesh, PartitionSpec(*([None] * dim), order))
        if all(produced[position[axis]] == placement for axis, placement in given.items()):
            return order
    raise ShardingError(
        f"placements {tuple(given.values())} on mesh axes {tuple(given)} split dim {dim} in a way "
        f"no PartitionSpec describes (a _StridedShard split factor that matches no order of those axes)."
    )
