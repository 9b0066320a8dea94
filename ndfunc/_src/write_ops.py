"""The writes table: ops that write into an argument, and what ndfunc knows of each.

A traced step is functional but for what tracing leaves in place; the lowered program writes in
place again where buffers can be reused. One `Write` per op in `WRITES`:

    functional   the op computing the same result without writing (`add_` -> `add`)
    writes       the arguments it writes into, by name
    overwrites   it replaces every element it writes with a source (`copy_`, `fill_`, `zero_`):
                 into a view of a tensor the step made it becomes the view's scatter
                 (`writes.views_as_scatters`; the view's half is `view_ops.View.written_back`)
    reuse        elementwise: buffer reuse turns `functional` into it where the input it writes
                 dies there (`passes/inplace.py`: `IN_PLACE`, and `INTO_SECOND` for `out=` forms)
    declared     its schema marks what it writes; else only this table says so (BatchNorm's
                 running statistics), and `when` names the argument that makes it write

Any other op writes what its schema marks (`written`), and its functional form is read off its
name (`functional`). `tests/test_op_tables.py` holds the table to the schemas.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ndfunc._src.view_ops import returns_view

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Write:
    """What ndfunc knows of one op that writes into an argument (see the module's text)."""

    functional: torch._ops.OpOverload | None
    writes: tuple[str, ...] = ("self",)
    overwrites: bool = False
    reuse: bool = False
    declared: bool = True
    when: str | None = None


# elementwise ops whose result buffer reuse writes into their first input, where it dies
_REUSED = (
    (aten.add.Tensor, aten.add_.Tensor), (aten.sub.Tensor, aten.sub_.Tensor), (aten.mul.Tensor, aten.mul_.Tensor),
    (aten.div.Tensor, aten.div_.Tensor), (aten.add.Scalar, aten.add_.Scalar), (aten.mul.Scalar, aten.mul_.Scalar),
    (aten.div.Scalar, aten.div_.Scalar), (aten.sub.Scalar, aten.sub_.Scalar), (aten.sqrt.default, aten.sqrt_.default),
    (aten.rsqrt.default, aten.rsqrt_.default), (aten.neg.default, aten.neg_.default),
    (aten.exp.default, aten.exp_.default), (aten.reciprocal.default, aten.reciprocal_.default),
    (aten.pow.Tensor_Scalar, aten.pow_.Scalar), (aten.addcmul.default, aten.addcmul_.default),
    (aten.addcdiv.default, aten.addcdiv_.default), (aten.lerp.Scalar, aten.lerp_.Scalar),
    (aten.sigmoid.default, aten.sigmoid_.default), (aten.tanh.default, aten.tanh_.default),
    (aten.silu.default, aten.silu_.default), (aten.relu.default, aten.relu_.default),
)

WRITES: dict[torch._ops.OpOverload, Write] = {
    # also: into an empty tensor nothing else reads, a copy (`copy_slices.fresh_copies`); of an
    # update of the same view, the update's functional op (`writes.updates_as_values`); into a
    # donated input, folded into the ops making the source (`passes/inplace.fold_donated_copies`).
    # Its functional form (a `fill_`'s decomposition) is the source broadcast (`copy_slices.copies_as_broadcasts`)
    aten.copy_.default: Write(aten.copy.default, overwrites=True),
    # their rule never writes a number into a pending sum (`planning/ops._fill_rule`)
    aten.fill_.Scalar: Write(aten.fill.Scalar, overwrites=True),
    aten.fill_.Tensor: Write(aten.fill.Tensor, overwrites=True),
    aten.zero_.default: Write(aten.zero.default, overwrites=True),
    # at a boolean mask, of one value or row: a `where` (`writes.masked_as_where`)
    aten.index_put_.default: Write(aten.index_put.default),
    # moving no element, dropped (`copy_slices.strided_views`); else, read by nothing after, the
    # view (`writes.reshapes_as_views`, as every op that changes a shape in place)
    aten.as_strided_.default: Write(aten.as_strided.default),
    # in training, its running statistics (traced, it is decomposed: `planning/ops.DECOMPOSED`)
    aten.native_batch_norm.default: Write(None, ("running_mean", "running_var"), declared=False, when="training"),
    **{in_place: Write(functional, reuse=True) for functional, in_place in _REUSED},
    # `a / b` where `b` dies and `a` cannot be written into: the quotient goes into `b`
    aten.div.out: Write(aten.div.Tensor, ("out",), reuse=True),
    aten.sub.out: Write(aten.sub.Tensor, ("out",), reuse=True),
}

OVERWRITES = tuple(op for op, w in WRITES.items() if w.overwrites)
# functional op -> its in-place form (into its first input) / its `out=` form (into its second)
IN_PLACE = {w.functional: op for op, w in WRITES.items() if w.reuse and w.writes == ("self",)}
INTO_SECOND = {w.functional: op for op, w in WRITES.items() if w.reuse and w.writes == ("out",)}


@functools.cache
def written(op) -> tuple[int, ...]:
    """The positions of the arguments `op`'s schema marks written (`Tensor(a!)`)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return ()
    return tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def writes_first(op) -> bool:
    """Whether `op` writes in place into its first argument."""
    return 0 in written(op)


def mutates(op) -> bool:
    """Whether `op` writes into anything, by its schema or its name (`add_`)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and (bool(written(op)) or schema.name.endswith("_"))


def written_values(node: torch.fx.Node) -> list:
    """What `node` writes into, as it was passed: the arguments its schema marks written, and the
    ones the table says it writes undeclared (where its `when` argument holds)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    names = [schema.arguments[i].name for i in written(node.target)]
    write = WRITES.get(node.target)
    if write is not None and not write.declared and (write.when is None or _argument(node, schema, write.when)):
        names += write.writes
    return [_argument(node, schema, name) for name in names]


def _argument(node: torch.fx.Node, schema, name: str):
    i = next(i for i, a in enumerate(schema.arguments) if a.name == name)
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def functional(op) -> torch._ops.OpOverload | None:
    """`op`'s functional form: the table's, else the overload ATen names so (`add_.Tensor` ->
    `add.Tensor`; `transpose_.default` -> `transpose.int`, taking the same arguments), if it has one."""
    write = WRITES.get(op)
    if write is not None:
        return write.functional
    return _by_name(op)


@functools.cache
def _by_name(op) -> torch._ops.OpOverload | None:
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None:
        return None
    takes = [(a.name, str(a.type)) for a in op._schema.arguments]
    overload = getattr(packet, op._overloadname, None)  # (`pow_.Scalar` takes what `pow.Tensor_Scalar` does)
    if isinstance(overload, torch._ops.OpOverload) and [t for _, t in takes] == [
            str(a.type) for a in overload._schema.arguments]:
        return overload
    for name in packet.overloads():
        candidate = getattr(packet, name)
        if [(a.name, str(a.type)) for a in candidate._schema.arguments] == takes:
            return candidate
    return None


@functools.cache
def reshapes_in_place(op) -> bool:
    """Whether `op` changes its first argument's shape in place (`unsqueeze_`): its functional form is a view."""
    if not isinstance(op, torch._ops.OpOverload) or not writes_first(op):
        return False
    view = functional(op)
    return view is not None and returns_view(view)
