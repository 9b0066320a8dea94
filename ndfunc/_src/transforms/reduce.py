"""Reductions in another dtype: a gradient summed over ranks in fp32 though computed in bf16."""

from __future__ import annotations

import operator

import torch

from ndfunc._src import cast_ops, view_ops
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.passes.schedule import REDUCTIONS

# ops that lay a value out, or cut it, without changing it, in any dtype: what the lowering writes
# between a gradient's sum and its next (the sum over one axis split rank by rank for the next), and
# what cuts a bucket of sums into its pieces (`nf.fsdp`'s buckets)
_LAYOUT_ONLY = view_ops.SAME_ELEMENTS | view_ops.PIECES | {operator.getitem}


def reduce_in(gm: torch.fx.GraphModule, dtype: torch.dtype, axes: tuple[str, ...] | None = None,
              kinds=REDUCTIONS, only_from: torch.dtype | None = None) -> int:
    """Make each reduction of `kinds` (over `axes`, all if None; of `only_from` values, any dtype
    if None) sum in `dtype`: cast before, and cast back where the sum is read (`_read_as`), except
    by what casts it up to `dtype` anyway or sums it again in `dtype` (a bf16 gradient's way back
    to its fp32 parameter, or its sum over the next axis): those read it as it came, unrounded.
    Its recorded bytes follow. How many."""
    todo = [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target in kinds and _changed(n, dtype, axes, only_from)]
    changing = set(todo)
    fed: set = set()  # reductions of `todo` whose input now comes in `dtype` (a sum before, laid out)
    for node in todo:  # in program order: of a gradient's two sums in turn, the first first
        comm = prog.comm(node)
        given = comm.dtype
        if node not in fed:
            with gm.graph.inserting_before(node):
                cast = gm.graph.call_function(cast_ops.CAST, (node.args[0],), {"dtype": dtype})
            sent = prog.shape_dtype(node.args[0])
            if sent is not None:  # for passes that read shapes before metadata is filled
                prog.note_local(cast, sent[0], dtype)
            node.replace_input_with(node.args[0], cast)
        prog.set_comm(node, comm.in_dtype(dtype))
        (wait,) = node.users
        fed |= _read_as(gm, wait, dtype, given, changing)
    if todo:
        gm.recompile()
    return len(todo)


def _changed(node: torch.fx.Node, dtype: torch.dtype, axes, only_from) -> bool:
    """Whether `reduce_in` makes `node` sum in `dtype`."""
    comm = prog.comm(node)
    return not (comm is None or comm.dtype == dtype or (axes is not None and not set(comm.axes) <= set(axes))
                or (only_from is not None and comm.dtype != only_from))


def _read_as(gm: torch.fx.GraphModule, wait: torch.fx.Node, dtype: torch.dtype, given: torch.dtype,
             reductions: set) -> set:
    """Let the readers of a sum made in `dtype` (`wait`) read it: through the views and cuts that
    lay it out (now in `dtype`), a cast up to `dtype` reads it as it came (the cast goes), as does
    a reduction of `reductions` (returned: it sums its input as it comes); anything else reads it
    cast back to `given`, where it reads it."""
    laid_out, edges, todo = [], [], [wait]
    while todo:
        x = todo.pop()
        for u in list(x.users):
            if u.target in _LAYOUT_ONLY and u.args[0] is x:
                laid_out.append(u)
                todo.append(u)
            else:
                edges.append((x, u))
    fed, rest = set(), {}
    for x, u in edges:
        if cast_ops.casts_to(u, dtype):
            u.replace_all_uses_with(x)
            gm.graph.erase_node(u)
        elif u in reductions and u.args[0] is x:
            fed.add(u)
        else:
            rest.setdefault(x, []).append(u)
    for x, readers in rest.items():
        with gm.graph.inserting_after(x):
            back = gm.graph.call_function(cast_ops.CAST, (x,), {"dtype": given})
        for u in readers:
            u.replace_input_with(x, back)
    for n in laid_out:  # now in `dtype`
        made = prog.shape_dtype(n)
        n.meta.pop("val", None)
        if made is not None:
            prog.note_local(n, made[0], dtype)
    return fed
