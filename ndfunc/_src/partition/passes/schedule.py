"""Scheduling: ops that free memory, and reductions, run as soon as their inputs are ready.

A traced step lists ops in the order the tracer met them, which is not the order that keeps
memory low: an optimizer written leaf by leaf over trees (`tree_map` of the scaled update, then of
the weight decay, then of the sum into the parameter) computes every leaf's update before any is
added to its parameter, so every update buffer is alive at once, as much memory as the parameters.
An eager optimizer's per-parameter loop keeps one. Here an elementwise op that is the last reader of
an input at least as big as its result moves up to just after the last of its inputs (and any
earlier write): it frees more than it takes, so the peak never grows, and chains of such ops run
leaf by leaf.

The lowering writes a layout change where its consumer is, so a gradient's reduction (and the
copy that lays a gradient split off dim 0 out rank by rank) would wait for the optimizer at the
end of the step: issued there it overlaps nothing, and the whole gradient lives until then.
`issue_reductions_early` moves each reduce-scatter and all-reduce, with the views and copies that
feed it, to just after the op that makes the gradient.
"""

from __future__ import annotations

import math
import operator

import torch

from ndfunc._src import view_ops, write_ops
from ndfunc._src.buffers import lifetimes
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.passes.analysis import live_bytes
from ndfunc._src.partition.program import shape_dtype


def hoist_freeing_ops(gm: torch.fx.GraphModule) -> int:
    """Move each elementwise op that frees an input at least its own size to just after its
    inputs; how many moved. Writes (in-place ops, `copy_`) and collectives stay where they are and
    nothing moves above a write."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    root, last = lifetimes(nodes)
    key: dict = {}
    barrier = None  # the latest write so far: nothing moves above it
    moved = 0
    for i, n in enumerate(nodes):
        key[n] = (i,)
        if n.op != "call_function":
            continue
        if n.target not in write_ops.IN_PLACE:
            if _writes(n):
                barrier = n
            continue
        anchor = max([*n.all_input_nodes, *([barrier] if barrier is not None else [])], key=key.__getitem__,
                     default=None)
        if anchor is None or key[anchor] >= (i - 1,) or not _frees(n, root, last, index):
            continue
        key[n] = (*key[anchor], i)
        moved += 1
    return _reorder(gm, nodes, key) and moved


def _writes(n: torch.fx.Node) -> bool:
    return write_ops.mutates(n.target)


def _frees(n: torch.fx.Node, root: dict, last: dict, index: dict) -> bool:
    """Whether `n` is the last reader of a buffer the program made that is at least its result's size."""
    out = shape_dtype(n)
    if out is None:
        return False
    need = math.prod(out[0]) * out[1].itemsize
    for a in n.all_input_nodes:
        r = root.get(a)
        sd = shape_dtype(r) if r is not None else None
        if (r is not None and r.op == "call_function" and last.get(r) == index[n] and sd is not None
                and math.prod(sd[0]) * sd[1].itemsize >= need):
            return True
    return False


c10d = torch.ops._c10d_functional
aten = torch.ops.aten
REDUCTIONS = (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)  # the gradient collectives
# data movement
_MOVES = view_ops.SAME_ELEMENTS | {operator.getitem, aten.split.Tensor, aten.cat.default, aten.slice.Tensor}


def issue_reductions_early(gm: torch.fx.GraphModule) -> int:
    """Move each reduce-scatter and all-reduce, and the data movement (views, splits, cats,
    copies) that makes its input, to just after what they read; how many moved. Their waits stay
    where they are; nothing moves above a write."""
    nodes = list(gm.graph.nodes)
    chain: set = set()
    for n in nodes:
        if n.op == "call_function" and n.target in REDUCTIONS:
            chain.add(n)
            todo = list(n.all_input_nodes)
            while todo:
                a = todo.pop()
                if a not in chain and a.op == "call_function" and a.target in _MOVES:
                    chain.add(a)
                    todo += a.all_input_nodes
    root, _ = lifetimes(nodes)
    key: dict = {}
    written: dict = {}  # buffer -> its latest write so far: what reads it does not move above that
    moved = 0
    for i, n in enumerate(nodes):
        key[n] = (i,)
        if n.op != "call_function":
            continue
        if n not in chain:
            if _writes(n):
                written[root[n]] = n
            continue
        anchor = max([*n.all_input_nodes, *(written[root[a]] for a in n.all_input_nodes if root[a] in written)],
                     key=key.__getitem__, default=None)
        if anchor is None or key[anchor] >= (i - 1,):
            continue
        key[n] = (*key[anchor], i)
        moved += 1
    return _reorder(gm, nodes, key) and moved


def wait_in_turn(gm: torch.fx.GraphModule) -> int:
    """Wait for each reduction no later than just before the next reduction over its group is
    issued; how many waits moved. A collective reads its input until its wait, so a gradient
    reduced early (`issue_reductions_early`) but waited for where the optimizer reads it, at the
    end, would be held, full size, all through backward; this way at most one reduction per group
    is in flight, overlapping the compute up to the next."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    by_group: dict = {}
    for n in nodes:
        if n.op == "call_function" and n.target in REDUCTIONS and len(n.users) == 1:
            by_group.setdefault(n.args[-1], []).append(n)
    moved = 0
    for issued in by_group.values():
        for r, following in zip(issued, issued[1:]):
            (wait,) = r.users
            if wait.target is c10d.wait_tensor.default and index[wait] > index[following]:
                following.prepend(wait)
                moved += 1
    if moved:
        gm.recompile()
    return moved


def keep_in_flight(gm: torch.fx.GraphModule) -> int:
    """Wait for each reduction a transform let stay in flight (`program.let_stay_in_flight`; its
    wait right after it) as late as the step's peak memory allows, as XLA's latency-hiding
    scheduler overlaps collectives under a memory limit: where its results are first read (the
    optimizer); else just before the next reduction over its group is issued (one in flight, over
    the next layer's backward, as FSDP2's reduce-scatter stream on GPU); else at once (FSDP2 on
    CPU). In flight, a reduction holds what it reduces. On CPU the overlap lets ranks that share
    cores drift apart without blocking each other at every layer. How many waits moved."""
    nodes = list(gm.graph.nodes)
    found = [n for n in nodes if n.op == "call_function" and n.target in REDUCTIONS and prog.stays_in_flight(n)
             and len(n.users) == 1]
    if not found:
        return 0
    index = {n: i for i, n in enumerate(nodes)}
    places = {}
    for rs in found:
        (wait,) = rs.users
        read = min(wait.users, key=index.__getitem__) if wait.users else None
        following = next((n for n in nodes[index[rs] + 1:] if n.op == "call_function" and n.target in REDUCTIONS
                          and n.args[-1] == rs.args[-1]), None)
        turn = following if following is not None and read is not None and index[following] < index[read] else read
        places[rs] = [at for at in dict.fromkeys((read, turn)) if at is not None]
    live, read_last = live_bytes(nodes)
    peak = max(live.values())
    moved = 0
    for rs in found:
        (wait,) = rs.users
        held = sum(read_last.get(wait, ()))  # what the wait frees: waited for later, it lives longer
        for at in places[rs]:
            span = _between(wait, at)
            if max((live[x] for x in span), default=0) + held <= peak:
                at.prepend(wait)
                for x in span:
                    live[x] += held
                moved += 1
                break
    if moved:
        gm.recompile()
    return moved


def _between(a: torch.fx.Node, b: torch.fx.Node) -> list:
    """The nodes after `a` and before `b`."""
    out, x = [], a.next
    while x is not b and x.op != "output":
        out.append(x)
        x = x.next
    return out


def _reorder(gm: torch.fx.GraphModule, nodes: list, key: dict) -> bool:
    order = sorted(nodes, key=key.__getitem__)
    if order == nodes:
        return False
    for prev, n in zip(order, order[1:]):
        if n.prev is not prev:
            prev.append(n)
    gm.recompile()
    return True
