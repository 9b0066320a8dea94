"""Layout changes made once for views that repeat one another.

Each op reading a value through a view views it on its own: `q = einsum("bdl,dhk->blhk", x, wq)`,
`k = ...(x, wk)` and `v = ...(x, wv)` are three permutes of `x` (its contracted dim moved last for
`ndfunc::dot`), three values to the partitioner.
Where the plan moves `x` for them (sequence parallelism gathers it over tp), the lowering moves each
view: three all-gathers of one tensor, where Megatron gathers it once. `share_repeated_moves`
makes the local program move it once: views of one value with the same arguments, lowered from
ops of the same phase (forward, or a region's recomputation), become one node, and so do the
collectives and copies then made of one node the same way.

Views merge only within one phase (their annotations equal): a view the forward made is not
shared with one the backward or a recomputation made again, so what is moved for those is moved
there again, not kept alive from the forward. What is made of merged views merges where made
alike, as the lowering moves any one value once for all its readers. The plan is left as the
partitioner chose it: the search prices each view's move apart, so it never prefers a plan for the
saving made here.
"""

from __future__ import annotations

import operator

import torch

from ndfunc._src.partition import program as prog
from ndfunc._src.view_ops import aliases_input

_c10d = torch.ops._c10d_functional
# what the lowering makes of a view to move it: its collectives, their waits, and the copies that
# lay a block out for them
_MADE_FOR_A_MOVE = frozenset({
    _c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default,
    _c10d.all_to_all_single.default, _c10d.wait_tensor.default, torch.ops.aten.clone.default,
    torch.ops.aten.contiguous.default, torch.ops.aten.cat.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.chunk.default, operator.getitem})


def share_repeated_moves(gm: torch.fx.GraphModule) -> int:
    """Merge repeated views and what is made of them alike (the module docstring); how many nodes
    went."""
    first: dict = {}
    shared: set = set()  # nodes standing for others: only what is made of them alike is merged
    merged = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        view = aliases_input(node.target)
        if not (view or node.target in _MADE_FOR_A_MOVE):
            continue
        marks = prog.marks(node)  # the traced op's annotations: its phase (None: the lowering made it)
        try:
            kept = first.setdefault((node.target, node.args, tuple(node.kwargs.items()), repr(marks)), node)
        except TypeError:  # an argument that does not hash: left as it is
            continue
        # a view of the step's own, or what is made alike of merged nodes
        if kept is node or not ((view and marks is not None) or any(a in shared for a in node.all_input_nodes)):
            continue
        node.replace_all_uses_with(kept)
        gm.graph.erase_node(node)
        shared.add(kept)
        merged += 1
    return merged
