"""Reductions in another dtype: a gradient summed over ranks in fp32 though computed in bf16."""

from __future__ import annotations

import torch

from ndfunc._src.partition import program as prog
from ndfunc._src.partition.passes.schedule import REDUCTIONS

aten = torch.ops.aten


def reduce_in(gm: torch.fx.GraphModule, dtype: torch.dtype, axes: tuple[str, ...] | None = None,
              kinds=REDUCTIONS, only_from: torch.dtype | None = None) -> int:
    """Make each reduction of `kinds` (over `axes`, all if None; of `only_from` values, any dtype
    if None) sum in `dtype`: cast before, cast back after; its recorded bytes follow. How many."""
    changed = 0
    for op in kinds:
        for node in list(gm.graph.find_nodes(op="call_function", target=op)):
            comm = prog.comm(node)
            given = comm.dtype if comm is not None else None
            if (comm is None or given == dtype or (axes is not None and not set(comm.axes) <= set(axes))
                    or (only_from is not None and given != only_from)):
                continue
            (wait,) = node.users
            with gm.graph.inserting_before(node):
                cast = gm.graph.call_function(aten._to_copy.default, (node.args[0],), {"dtype": dtype})
            sent = prog.shape_dtype(node.args[0])
            if sent is not None:  # for passes that read shapes before metadata is filled
                prog.note_local(cast, sent[0], dtype)
            node.replace_input_with(node.args[0], cast)
            prog.set_comm(node, comm.in_dtype(dtype))
            with gm.graph.inserting_after(wait):
                back = gm.graph.call_function(aten._to_copy.default, (wait,), {"dtype": given})
            wait.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
            changed += 1
    if changed:
        gm.recompile()
    return changed
