"""PartitionSpec: how each dim of a value is laid out over named mesh axes.

Semantics are JAX's (`jax.sharding.PartitionSpec`): one entry per leading dim, trailing dims
unsharded. An entry is `None` (not sharded), an axis name, or a tuple of axis names ordered
major to minor: `P(('dp_shard', 'tp'))` splits dim 0 into `dp_shard * tp` blocks and gives the
block `i_dp_shard * tp + i_tp` to the rank at mesh coordinate `(i_dp_shard, i_tp)`.

`unreduced` names axes over which the value is a pending sum (JAX's `P(..., unreduced={'dp'})`):
each rank along them holds a part, the value is their sum. Gradients accumulated over
micro-batches are kept so, and reduced once at the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Union

from ndfunc._src.sharding.errors import DuplicateAxisError, ShardingError

Entry = Union[None, str, tuple[str, ...]]


def _normalize_entry(entry: object, position: int) -> Entry:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)):
        for axis in entry:
            if not isinstance(axis, str):
                raise ShardingError(
                    f"PartitionSpec entry {position} is {entry!r}: a tuple of axes holds axis "
                    f"names only (no nested tuples, no {type(axis).__name__}). "
                    f"Write P(('dp_shard', 'tp')) to shard one dim over two axes."
                )
        if len(entry) == 0:
            return None
        if len(entry) == 1:
            return entry[0]
        return tuple(entry)
    raise ShardingError(
        f"PartitionSpec entry {position} is {entry!r} of type {type(entry).__name__}; "
        f"expected None, a mesh axis name (str) or a tuple of axis names."
    )


class PartitionSpec:
    """Per-dim layout of a value over mesh axes; `P` for short.

    Example:
        >>> P('dp_shard', None)
        P('dp_shard', None)
        >>> P(('dp_replicate', 'dp_shard'), 'cp').axes
        ('dp_replicate', 'dp_shard', 'cp')
        >>> P('tp', [], ('dp',))
        P('tp', None, 'dp')
        >>> P(None, 'tp', unreduced={'dp'})  # a sum over dp still to be taken
        P(None, 'tp', unreduced={'dp'})
    """

    __slots__ = ("_entries", "_unreduced")
    _entries: tuple[Entry, ...]
    _unreduced: frozenset[str]

    def __init__(self, *entries: object, unreduced: str | Iterable[str] = ()):
        normalized = tuple(_normalize_entry(e, i) for i, e in enumerate(entries))
        seen: set[str] = set()
        for entry in normalized:
            for axis in _entry_axes(entry):
                if axis in seen:
                    raise DuplicateAxisError(
                        f"PartitionSpec{_format_entries(normalized)} uses mesh axis {axis!r} "
                        f"more than once; an axis can shard at most one dim. To split one dim "
                        f"over several axes, group them in one tuple: P(('dp_shard', 'tp'))."
                    )
                seen.add(axis)
        pending = frozenset((unreduced,) if isinstance(unreduced, str) else unreduced)
        if not all(isinstance(axis, str) for axis in pending):
            raise ShardingError(f"unreduced={unreduced!r}: expected mesh axis names (str).")
        both = sorted(pending & seen)
        if both:
            raise DuplicateAxisError(
                f"PartitionSpec{_format_entries(normalized)} shards a dim over mesh axis {both[0]!r} and "
                f"also lists it as unreduced; an axis either splits the value or holds parts of a sum."
            )
        object.__setattr__(self, "_entries", normalized)
        object.__setattr__(self, "_unreduced", pending)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("PartitionSpec is immutable")

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index):
        return self._entries[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartitionSpec):
            return self._entries == other._entries and self._unreduced == other._unreduced
        if isinstance(other, tuple):
            try:
                return not self._unreduced and self._entries == PartitionSpec(*other)._entries
            except ShardingError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        # equal to a tuple it equals, so it hashes like one
        return hash((self._entries, self._unreduced)) if self._unreduced else hash(self._entries)

    def __repr__(self) -> str:
        if not self._unreduced:
            return f"P{_format_entries(self._entries)}"
        pending = "{" + ", ".join(map(repr, sorted(self._unreduced))) + "}"
        return f"P{_format_entries(self._entries)[:-1]}{', ' if self._entries else ''}unreduced={pending})"

    def __reduce__(self):
        return (_rebuild, (self._entries, tuple(sorted(self._unreduced))))

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this spec shards a dim over, in entry order (not the unreduced ones)."""
        return tuple(axis for entry in self._entries for axis in _entry_axes(entry))

    @property
    def unreduced(self) -> frozenset[str]:
        """The mesh axes over which the value is a sum still to be taken."""
        return self._unreduced

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """The axes that shard `dim`, major to minor; `()` for an unsharded or trailing dim."""
        return _entry_axes(self._entries[dim]) if dim < len(self._entries) else ()

    def is_equivalent_to(self, other: "PartitionSpec", ndim: int) -> bool:
        """Whether both specs lay out a value of rank `ndim` the same way.

        Trailing `None`s do not change a layout, so `P('tp')` and `P('tp', None)` are equivalent
        for a 2-d value.
        """
        if not isinstance(other, PartitionSpec):
            other = PartitionSpec(*other)
        return all(self.dim_axes(d) == other.dim_axes(d) for d in range(ndim)) and (
            len(self) <= ndim and len(other) <= ndim
        )


def _rebuild(entries: tuple, unreduced: tuple) -> "PartitionSpec":
    return PartitionSpec(*entries, unreduced=unreduced)


def _entry_axes(entry: Entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry


def _format_entries(entries: tuple[Entry, ...]) -> str:
    return "(" + ", ".join(repr(e) for e in entries) + ")"


P = PartitionSpec
