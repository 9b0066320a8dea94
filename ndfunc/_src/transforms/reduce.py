"""Reductions in another dtype: a gradient summed over ranks in fp32 though computed in bf16."""

from __future__ import annotations

import torch

from ndfunc._src.partition import program as prog
from ndfunc._src.partition.passes.schedule import REDUCTIONS

aten = torch.ops.aten
# ops that lay a value out without changing it, in any dtype: what the lowering writes between two
# reductions of one gradient (the sum over one axis split rank by rank for the next)
_LAYOUT_ONLY = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
                aten.transpose.int, aten.t.default, aten.clone.default, aten.contiguous.default)


def reduce_in(gm: torch.fx.GraphModule, dtype: torch.dtype, axes: tuple[str, ...] | None = None,
              kinds=REDUCTIONS, only_from: torch.dtype | None = None) -> int:
    """Make each reduction of `kinds` (over `axes`, all if None; of `only_from` values, any dtype
    if None) sum in `dtype`: cast before, cast back after, except for what casts the sum up to
    `dtype` anyway (it reads the sum in `dtype`, unrounded); its recorded bytes follow. How many."""
    changed = 0
    for op in kinds:
        for node in list(gm.graph.find_nodes(op="call_function", target=op)):
            comm = prog.comm(node)
            given = comm.dtype if comm is not None else None
            if (comm is None or given == dtype or (axes is not None and not set(comm.axes) <= set(axes))
                    or (only_from is not None and given != only_from)):
                continue
            (wait,) = node.users
            laid_out = []  # views and copies between the value reduced and a cast before them
            source = node.args[0]
            while source.target in _LAYOUT_ONLY and len(source.users) == 1:
                laid_out.append(source)
                source = source.args[0]
            if _cast_to(source, given) and _summed_in(source.args[0], dtype):
                # the sum of a reduction before (over another axis: dp_shard, then tp) cast back
                # to `given`, laid out for this one: summed on as it came, not rounded to `given`
                # and up again
                (laid_out[-1] if laid_out else node).replace_input_with(source, source.args[0])
                if not source.users:
                    gm.graph.erase_node(source)
                for n in laid_out:  # now in `dtype`
                    made = prog.shape_dtype(n)
                    n.meta.pop("val", None)
                    if made is not None:
                        prog.note_local(n, made[0], dtype)
                prog.set_comm(node, comm.in_dtype(dtype))
                changed += 1
                _take_as_summed(gm, wait, dtype, given)
                continue
            with gm.graph.inserting_before(node):
                cast = gm.graph.call_function(aten._to_copy.default, (node.args[0],), {"dtype": dtype})
            sent = prog.shape_dtype(node.args[0])
            if sent is not None:  # for passes that read shapes before metadata is filled
                prog.note_local(cast, sent[0], dtype)
            node.replace_input_with(node.args[0], cast)
            prog.set_comm(node, comm.in_dtype(dtype))
            _take_as_summed(gm, wait, dtype, given)
            changed += 1
    if changed:
        gm.recompile()
    return changed


def _take_as_summed(gm: torch.fx.GraphModule, wait: torch.fx.Node, dtype: torch.dtype, given: torch.dtype) -> None:
    """The readers of a sum made in `dtype` (`wait`) read it cast back to `given`, except those
    that cast it up to `dtype` themselves (a bf16 gradient's way back to its fp32 parameter): they
    take the sum as it came, not rounded to `given` and back."""
    readers = list(wait.users)
    if rest := [u for u in readers if not _cast_to(u, dtype)]:
        with gm.graph.inserting_after(wait):
            back = gm.graph.call_function(aten._to_copy.default, (wait,), {"dtype": given})
        for u in rest:
            u.replace_input_with(wait, back)
    for up in readers:
        if up not in rest:
            up.replace_all_uses_with(wait)
            gm.graph.erase_node(up)


def _summed_in(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    """Whether `node` waits for a reduction that sums in `dtype` (one `reduce_in` changed)."""
    if node.target is not torch.ops._c10d_functional.wait_tensor.default:
        return False
    comm = prog.comm(node.args[0])
    return comm is not None and comm.dtype == dtype


def _cast_to(node: torch.fx.Node, dtype: torch.dtype) -> bool:
    """Whether `node` only casts its one input to `dtype` (on its own device, strided)."""
    return (node.target is aten._to_copy.default and len(node.args) == 1 and node.kwargs.get("dtype") == dtype
            and set(node.kwargs) <= {"dtype", "layout", "device"}
            and node.kwargs.get("layout", torch.strided) is torch.strided)
