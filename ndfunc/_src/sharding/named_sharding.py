"""NamedSharding: a PartitionSpec bound to a mesh, and the block math behind it.

All of it is pure: shard shapes, each rank's block and the DTensor placements depend only on
the abstract mesh, the spec and the global shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ndfunc._src.sharding import placements as _placements
from ndfunc._src.sharding.errors import (
    IndivisibleError,
    RankError,
    ShardingError,
    UnknownAxisError,
    where,
)
from ndfunc._src.sharding.mesh import AbstractMesh, Mesh, get_mesh
from ndfunc._src.sharding.partition_spec import PartitionSpec


class NamedSharding:
    """A `PartitionSpec` over the axes of a mesh; validated when built.

    Example:
        >>> s = NamedSharding(AbstractMesh({'dp': 4, 'tp': 2}), P('dp', 'tp'))
        >>> s.shard_shape((16, 32))
        (4, 16)
        >>> s.shard_indices((16, 32))[1]
        (slice(0, 4, None), slice(16, 32, None))
    """

    __slots__ = ("_mesh", "_spec")

    def __init__(self, mesh: Mesh | AbstractMesh, spec: PartitionSpec):
        if not isinstance(mesh, (Mesh, AbstractMesh)):
            raise TypeError(f"NamedSharding expects a Mesh or AbstractMesh, got {type(mesh).__name__}.")
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"NamedSharding expects a PartitionSpec, got {spec!r}; write P({', '.join(map(repr, spec))})."
                if isinstance(spec, (tuple, list))
                else f"NamedSharding expects a PartitionSpec, got {type(spec).__name__}."
            )
        unknown = [axis for axis in (*spec.axes, *sorted(spec.unreduced)) if axis not in mesh.axis_names]
        if unknown:
            raise UnknownAxisError(
                f"{spec!r} names mesh axis {unknown[0]!r}, which the mesh does not have; "
                f"its axes are {mesh.axis_names} (shape {mesh.shape})."
            )
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_spec", spec)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("NamedSharding is immutable")

    def __reduce__(self):
        return (NamedSharding, (self._mesh, self._spec))

    @property
    def mesh(self) -> Mesh | AbstractMesh:
        return self._mesh

    @property
    def spec(self) -> PartitionSpec:
        return self._spec

    @property
    def abstract_mesh(self) -> AbstractMesh:
        return self._mesh.abstract

    @property
    def is_fully_replicated(self) -> bool:
        """Whether every rank holds the whole value (no axis of size > 1 shards a dim or holds
        parts of a sum)."""
        return all(self._mesh.axis_size(axis) == 1 for axis in (*self._spec.axes, *self._spec.unreduced))

    @property
    def placements(self) -> tuple:
        """DTensor placements, one per mesh axis (see `ndfunc._src.sharding.placements`)."""
        return _placements.spec_to_placements(self.abstract_mesh, self._spec)

    @classmethod
    def from_placements(cls, mesh: Mesh | AbstractMesh, placements: Sequence, ndim: int) -> "NamedSharding":
        """The NamedSharding whose `.placements` are `placements`, for a value of rank `ndim`."""
        return cls(mesh, _placements.placements_to_spec(mesh.abstract, placements, ndim))

    def num_blocks(self, dim: int) -> int:
        """How many blocks dim `dim` is split into."""
        return math.prod(self._mesh.axis_size(a) for a in self._spec.dim_axes(dim))

    def check(self, global_shape: Sequence[int], path: str | None = None) -> None:
        """Raise `RankError`/`IndivisibleError` unless this sharding fits `global_shape`."""
        ndim = len(global_shape)
        if len(self._spec) > ndim:
            hint = " For scalars the PartitionSpec should be P()." if ndim == 0 else ""
            raise RankError(
                f"{where(path)}{self._spec!r} is only valid for values of rank at least "
                f"{len(self._spec)}, but was applied to a value of rank {ndim} "
                f"(shape {tuple(global_shape)}).{hint}"
            )
        for dim, size in enumerate(global_shape):
            blocks = self.num_blocks(dim)
            if size % blocks:
                axes = self._spec.dim_axes(dim)
                sizes = " x ".join(f"{a}={self._mesh.axis_size(a)}" for a in axes)
                up = -(-size // blocks) * blocks
                raise IndivisibleError(
                    f"{where(path)}dim {dim} of shape {tuple(global_shape)} has size {size}, which "
                    f"{self._spec!r} splits over mesh axes {axes} ({sizes}) into {blocks} blocks; "
                    f"{size} is not divisible by {blocks}. Pad the dim to a multiple of {blocks} "
                    f"(here {up}: a vocabulary is padded with unused tokens), shard it over fewer "
                    f"axes, or leave it unsharded."
                )

    def shard_shape(self, global_shape: Sequence[int], path: str | None = None) -> tuple[int, ...]:
        """The shape of each rank's block (the same on every rank)."""
        self.check(global_shape, path)
        return tuple(size // self.num_blocks(dim) for dim, size in enumerate(global_shape))

    def shard_indices(self, global_shape: Sequence[int], path: str | None = None) -> list[tuple[slice, ...]]:
        """Each rank's block, as a tuple of `slice(start, stop)` per dim; indexed by rank."""
        shard = self.shard_shape(global_shape, path)
        mesh = self.abstract_mesh
        position = {name: i for i, name in enumerate(mesh.axis_names)}
        indices = []
        for rank in range(mesh.size):
            coord = mesh.coordinate(rank)
            index = []
            for dim, block in enumerate(shard):
                b = 0
                for axis in self._spec.dim_axes(dim):  # major to minor: mixed radix
                    b = b * mesh.axis_size(axis) + coord[position[axis]]
                index.append(slice(b * block, (b + 1) * block))
            indices.append(tuple(index))
        return indices

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, NamedSharding)
            and self._mesh == other._mesh
            and self._spec == other._spec
        )

    def __hash__(self) -> int:
        return hash((self._mesh, self._spec))

    def __repr__(self) -> str:
        return f"NamedSharding(mesh={self._mesh!r}, spec={self._spec!r})"

    def is_equivalent_to(self, other: "NamedSharding", ndim: int) -> bool:
        """Whether both lay out a value of rank `ndim` alike on the same mesh: trailing `None`s and
        axes of size 1 (which split nothing) do not count."""
        if self._mesh.abstract != other._mesh.abstract or max(len(self._spec), len(other._spec)) > ndim:
            return False
        return all(self._split_axes(d) == other._split_axes(d) for d in range(ndim))

    def _split_axes(self, dim: int) -> tuple[str, ...]:
        return tuple(a for a in self._spec.dim_axes(dim) if self._mesh.axis_size(a) > 1)


def resolve_sharding(sharding: object, path: str | None = None) -> NamedSharding:
    """A NamedSharding from a NamedSharding, or from a bare `P` under `with mesh:`."""
    if isinstance(sharding, NamedSharding):
        return sharding
    if isinstance(sharding, PartitionSpec):
        mesh = get_mesh()
        if mesh is None:
            raise ShardingError(
                f"{where(path)}a bare {sharding!r} needs a mesh: wrap the call in `with mesh:` "
                f"(or nf.set_mesh(mesh)), or pass NamedSharding(mesh, {sharding!r})."
            )
        try:
            return NamedSharding(mesh, sharding)
        except UnknownAxisError as e:
            raise UnknownAxisError(f"{where(path)}{e}") from None
    raise TypeError(
        f"{where(path)}expected a NamedSharding or a PartitionSpec, got {sharding!r} "
        f"of type {type(sharding).__name__}."
    )
