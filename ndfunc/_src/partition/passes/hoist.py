"""Ops that free memory run as soon as their inputs are ready.

A traced step lists ops in the order the tracer met them, which is not the order that keeps
memory low: an optimizer written leaf by leaf over trees (`tree_map` of the scaled update, then of
the weight decay, then of the sum into the parameter) computes every leaf's update before any is
added to its parameter, so every update buffer is alive at once, as much memory as the parameters.
An eager optimizer's per-parameter loop keeps one. Here an elementwise op that is the last reader of
an input at least as big as its result moves up to just after the last of its inputs (and any
earlier write): it frees more than it takes, so the peak never grows, and chains of such ops run
leaf by leaf. Collectives and their waits stay where the scheduler (`schedule`) put them.
"""

from __future__ import annotations

import math

import torch

from ndfunc._src import write_ops
from ndfunc._src.buffers import lifetimes
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
            if writes(n):
                barrier = n
            continue
        anchor = max([*n.all_input_nodes, *([barrier] if barrier is not None else [])], key=key.__getitem__,
                     default=None)
        if anchor is None or key[anchor] >= (i - 1,) or not _frees(n, root, last, index):
            continue
        key[n] = (*key[anchor], i)
        moved += 1
    return _reorder(gm, nodes, key) and moved


def writes(n: torch.fx.Node) -> bool:
    """Whether the op `n` writes into one of its inputs (`write_ops.mutates`)."""
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


def _reorder(gm: torch.fx.GraphModule, nodes: list, key: dict) -> bool:
    order = sorted(nodes, key=key.__getitem__)
    if order == nodes:
        return False
    for prev, n in zip(order, order[1:]):
        if n.prev is not prev:
            prev.append(n)
    gm.recompile()
    return True
