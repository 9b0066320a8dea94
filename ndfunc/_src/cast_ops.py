"""The casts table: ops that change a tensor's dtype, and what ndfunc knows of each.

A cast is elementwise with no arithmetic: torch's flop counter counts none, `nf.remat` recomputes
it, and the replay prices the bytes it reads and writes. DTensor's pointwise rule lays it out, so
the partitioner places it like any op: a parameter stored sharded is cast before its gather where
that is cheaper (`nf.mixed_precision`). One `Cast` per op in `CASTS`:

    dtype    where its new dtype is given: a position, or a keyword
    also     the keywords by which it changes more than the dtype (device, layout, memory format)

Who reads it: `nf.fsdp` follows a stored parameter through a cast of its dtype only to its gather
(`dtype_only`); the memory breakdown follows a stored input through any cast (`CASTS`);
`nf.mixed_precision`'s reductions drop a cast up to the dtype they summed in (`casts_to`) and write
their own casts as `CAST`, as `graph_edits.moved` and the registry's lowerings do.
`tests/test_op_tables.py` holds the table to the schemas.
"""

from __future__ import annotations

import dataclasses

import torch

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Cast:
    """What ndfunc knows of one cast op (see the module's text)."""

    dtype: int | str
    also: frozenset[str] = frozenset()


CASTS: dict[torch._ops.OpOverload, Cast] = {
    # `Tensor.to`, `.float()`, `.type_as` as traced
    aten._to_copy.default: Cast("dtype", frozenset({"layout", "device", "pin_memory", "non_blocking",
                                                    "memory_format"})),
    # the decompositions' casts (`_maybe_convert_to_dtype`)
    torch.ops.prims.convert_element_type.default: Cast(1),
}
CAST = aten._to_copy.default  # the op ndfunc writes a cast as: `CAST(x, dtype=...)`


def new_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype a cast node gives its input (None where it keeps the input's, or is no cast)."""
    cast = CASTS.get(node.target)
    if cast is None:
        return None
    if isinstance(cast.dtype, int):
        return node.args[cast.dtype] if cast.dtype < len(node.args) else None
    return node.kwargs.get(cast.dtype)


def dtype_only(node: torch.fx.Node) -> bool:
    """Whether `node` is a cast that changes nothing but the dtype (no keyword of `Cast.also` given)."""
    return node.target in CASTS and set(node.kwargs) <= {"dtype"}


def casts_to(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    """Whether `node` is a cast as ndfunc writes one (`CAST`) of its one input to `dtype`, on its own
    device, strided."""
    return (node.target is CAST and len(node.args) == 1 and node.kwargs.get("dtype") == dtype
            and set(node.kwargs) <= {"dtype", "layout", "device"}
            and node.kwargs.get("layout", torch.strided) is torch.strided)
