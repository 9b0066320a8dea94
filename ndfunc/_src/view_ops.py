"""The views table: every op that lays out or picks its input's elements, and what ndfunc knows of it.

One `View` per op in `VIEWS`; the sets below are read from it, and every module that treats a
view specially reads them (nothing else lists view ops):

    kind            what its result holds of its input (`KINDS`)
    layouts         how a layout of its input maps to its output's: DTensor's view rule (its dim
                    map; a reshape also keeps splits whose blocks stay contiguous,
                    `planning/views.py`), DTensor's rule asked per mesh axis
                    (`strategies.AXIS_BY_AXIS`) or per layout, or none (run whole)
    written_back    a source written into the view, put back into its base: how tracing makes a
                    write into it functional (`writes.views_as_scatters`)
    on_blocks       the op the lowering runs on blocks in its place (`lower`)
    reads_strides   its result depends on its input's strides, not only its elements: a pass that
                    changes a buffer's strides leaves its readers' values alone only without it
    aliases         its result is its input's memory (`buffers`): what its schema says, but for
                    `UNDECLARED_ALIASES`

A view does no arithmetic: torch's flop counter counts none, `nf.remat` recomputes it (it saves
only what the registry marks `saved_by_remat`), and the replay prices one that aliases at nothing
(`tests/test_op_tables.py` holds each of these, and the schemas, to the table).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

aten = torch.ops.aten

KINDS = {
    "reshape": "every element, in order, in another shape",
    "reorder": "every element, its dims permuted, or size-1 dims added or dropped",
    "copy": "every element, in memory of its own (where it is not already laid out so)",
    "part": "some of the elements (a slice, a select, a diagonal)",
    "pieces": "every element, as several tensors",
    "alias": "the tensor itself",
    "strided": "the elements its strides name, of the input's memory",
}
LAYOUTS = ("view rule", "by axis", "by layout", "whole")


@dataclasses.dataclass(frozen=True)
class View:
    """What ndfunc knows of one view op (see the module's text)."""

    kind: str
    layouts: str
    written_back: Callable | None = None  # (call, view node, source node) -> the base with the source written
    on_blocks: torch._ops.OpOverload | None = None
    reads_strides: bool = False
    aliases: bool = True

    def __post_init__(self):
        assert self.kind in KINDS and self.layouts in LAYOUTS, self


def inverse_permutation(dims: list) -> list:
    """The dims undoing `permute(dims)` (negative dims read modulo their number)."""
    k = len(dims)
    return sorted(range(k), key=lambda d: dims[d] % k)


def arguments(view: torch.fx.Node) -> list:
    """`view`'s arguments after `self`, every one (defaults filled in), in its schema's order."""
    out = []
    for i, arg in enumerate(view.target._schema.arguments[1:], start=1):
        if i < len(view.args):
            out.append(view.args[i])
        elif arg.name in view.kwargs:
            out.append(view.kwargs[arg.name])
        else:
            out.append(arg.default_value)
    return out


# How a source written into a view is put back into the view's base. `call(op, *args)` adds an op
# (to a graph: `graph_edits.call`); `view` is the view's node, `written` the source's.

def _permuted_back(call, view, written):
    return call(aten.permute.default, written, inverse_permutation(view.args[1]))


def _swapped_back(call, view, written):  # (a transpose is its own inverse)
    return call(view.target, written, *view.args[1:])


def _reshaped_back(call, view, written):
    # (a reshape, not a view: the source's strides may allow no view)
    return call(aten.reshape.default, written, list(view.args[0].meta["val"].shape))


def _scattered(scatter: torch._ops.OpOverload) -> Callable:
    """The view's scatter op: it takes the view's arguments after `self`, in the same order, after `src`."""
    def written_back(call, view, written):
        return call(scatter, view.args[0], written, *arguments(view))
    return written_back


VIEWS: dict[torch._ops.OpOverload, View] = {
    # a block of a viewable value need not be viewable (its strides differ): lowered as reshape,
    # which views when it can and copies when it must
    aten.view.default: View("reshape", "view rule", _reshaped_back, on_blocks=aten.reshape.default,
                            reads_strides=True),
    aten.reshape.default: View("reshape", "view rule"),
    aten._unsafe_view.default: View("reshape", "view rule", on_blocks=aten.reshape.default, reads_strides=True),
    aten.permute.default: View("reorder", "view rule", _permuted_back),
    aten.transpose.int: View("reorder", "view rule", _swapped_back),
    aten.t.default: View("reorder", "by axis", _swapped_back),
    aten.unsqueeze.default: View("reorder", "view rule", _reshaped_back),
    aten.squeeze.dim: View("reorder", "view rule", _reshaped_back),
    aten.squeeze.dims: View("reorder", "view rule"),
    aten.clone.default: View("copy", "by axis", aliases=False),
    aten.contiguous.default: View("copy", "by axis"),
    aten.slice.Tensor: View("part", "by axis", _scattered(aten.slice_scatter.default)),
    aten.select.int: View("part", "by layout", _scattered(aten.select_scatter.default)),
    aten.diagonal.default: View("part", "by layout", _scattered(aten.diagonal_scatter.default)),
    aten.split.Tensor: View("pieces", "by axis"),
    aten.split_with_sizes.default: View("pieces", "by layout"),
    aten.alias.default: View("alias", "by axis"),
    aten.detach.default: View("alias", "by axis"),
    # no rule: run whole, its input laid out as traced first (the registry's `_as_strided`);
    # tracing makes most of them plain views (`copy_slices.strided_views`)
    aten.as_strided.default: View("strided", "whole", reads_strides=True),
}

# torch's schema declares a fresh result (its callers hand it a temporary nothing else reads), yet
# the kernel views its input
UNDECLARED_ALIASES = frozenset({aten._unsafe_view.default})


def _of(*kinds: str) -> frozenset:
    return frozenset(op for op, v in VIEWS.items() if v.kind in kinds)


# every element of the input, unchanged, in another shape, order or buffer: the passes follow a
# value through these (a parameter to its gather, a gather to the next, a sum to its reader)
SAME_ELEMENTS = _of("reshape", "reorder", "copy")
RESHAPES = _of("reshape")  # (x, shape)
PARTS = _of("part")  # one part of a tensor: a write into it is its scatter
PIECES = _of("pieces")
BY_AXIS = frozenset(op for op, v in VIEWS.items() if v.layouts == "by axis")
READS_STRIDES = frozenset(op for op, v in VIEWS.items() if v.reads_strides)
ON_BLOCKS = {op: v.on_blocks for op, v in VIEWS.items() if v.on_blocks is not None}


def written_back(op) -> Callable | None:
    """How a source written into a view by `op` is put back into its base (`View.written_back`),
    or None where tracing leaves such a write as it is."""
    view = VIEWS.get(op)
    return None if view is None else view.written_back


def returns_view(op) -> bool:
    """Whether `op`'s schema says it returns a view of its first argument (aliases it without writing)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None \
        and not schema.returns[0].alias_info.is_write


def aliases_input(op) -> bool:
    """Whether `op`'s result is a view of its first argument: its schema says so, or the table does
    (`UNDECLARED_ALIASES`)."""
    return returns_view(op) or op in UNDECLARED_ALIASES
