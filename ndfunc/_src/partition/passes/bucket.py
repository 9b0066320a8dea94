"""Bucketing: neighbouring all-reduces over one group become one, on the values laid end to end.

Data parallelism all-reduces every gradient, one collective each; on real links a collective costs
a fixed latency before its first byte, so DDP packs gradients into buckets. Here all-reduces (same
group, dtype and reduction) that can all run after the last of their inputs is made and before the
first of their results is read become one all-reduce of their concatenation, issued right after
that last input and split back afterwards. Buckets stop
at `BUCKET_BYTES`, as DDP's do, so the extra copy stays bounded.
"""

from __future__ import annotations

import math
import operator

import torch

from ndfunc._src.partition.program import comm, merged, set_comm

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket


def bucket_all_reduces(gm: torch.fx.GraphModule) -> int:
    """Merge all-reduces in `gm` (those the lowering recorded a `Comm` for); how many were merged away."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    buckets, open_ = [], {}  # key -> the bucket being filled: [(all_reduce, wait, ready, first read)]
    for n in nodes:
        if n.op != "call_function" or n.target is not c10d.all_reduce.default or len(n.users) != 1 \
                or comm(n) is None:
            continue
        wait = next(iter(n.users))
        if wait.target is not c10d.wait_tensor.default or not wait.users:
            continue
        item = (n, wait, index[n.args[0]], min(index[u] for u in wait.users))
        current = open_.get(_key(n), [])
        # one all-reduce serves them all if it can run after every input is ready and before any
        # result is read
        if current and max(max(c[2] for c in current), item[2]) < min(min(c[3] for c in current), item[3]) \
                and sum(_bytes(c[0]) for c in current) + _bytes(n) <= BUCKET_BYTES:
            current.append(item)
            continue
        if len(current) > 1:
            buckets.append(current)
        open_[_key(n)] = [item]
    buckets += [b for b in open_.values() if len(b) > 1]
    for bucket in buckets:
        _merge(gm.graph, bucket, nodes[max(c[2] for c in bucket)])
    if buckets:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return sum(len(b) - 1 for b in buckets)


def _key(ar: torch.fx.Node) -> tuple:
    c = comm(ar)
    return (ar.args[1], ar.args[2], c.dtype, c.device)


def _numel(ar: torch.fx.Node) -> int:
    return math.prod(comm(ar).sent)


def _bytes(ar: torch.fx.Node) -> int:
    return comm(ar).sent_bytes


def _merge(graph: torch.fx.Graph, bucket: list, ready: torch.fx.Node) -> None:
    """One all-reduce for the bucket, right after `ready` (the last input made)."""
    last = ready.next
    op, group = bucket[0][0].args[1], bucket[0][0].args[2]
    with graph.inserting_before(last):
        flats = [graph.call_function(aten.reshape.default, (ar.args[0], [-1])) for ar, *_ in bucket]
        joined = graph.call_function(aten.cat.default, (flats,))
        reduced = graph.call_function(c10d.all_reduce.default, (joined, op, group))
        waited = graph.call_function(c10d.wait_tensor.default, (reduced,))
        sizes = [_numel(ar) for ar, *_ in bucket]
        pieces = graph.call_function(aten.split_with_sizes.default, (waited, sizes))
    set_comm(reduced, merged([comm(ar) for ar, *_ in bucket], (sum(sizes),), (sum(sizes),)))
    for i, (ar, wait, _, _) in enumerate(bucket):
        with graph.inserting_before(last):  # before any reader
            piece = graph.call_function(operator.getitem, (pieces, i))
            view = graph.call_function(aten.reshape.default, (piece, list(comm(ar).sent)))
        wait.replace_all_uses_with(view)
    for ar, wait, _, _ in bucket:
        graph.erase_node(wait)
        graph.erase_node(ar)
