"""Which algorithm runs each collective: on gloo, one all-to-all where gloo's own is slow.

The program names what moves: a reduce-scatter, an all-gather, an all-reduce. How it moves is
the backend's choice, and gloo (CPU tensors) chooses badly at the sizes a training step moves.
`python benchmarks/gloo_collectives.py` (4 processes on one 2-core machine; wall and CPU time per
call, the all-to-all form over gloo's):

- reduce-scatter: an all-to-all of the input's n row blocks, then a local sum of the n blocks that
  arrive. The same bytes move, in one exchange: 0.2-0.5 of gloo's time at every size measured,
  16 bytes to 4 MB.
- all-gather: an all-to-all of n copies of the block; the same bytes again. 0.2-0.7 of gloo's time
  up to 256 KiB per rank; from 1 MB on, about gloo's (0.8-1.0) for a local copy more, alone. In a
  training step the one exchange wins at those sizes too: while a gather is in flight the cores
  compute, and gloo's ring needs n-1 rounds of messages, each waiting for the next rank's gloo
  thread to be scheduled between that compute. FSDP on 4 ranks of 2 cores, its layers gathered
  (3 and 4 MB) as all-to-alls: 0.95-0.97 of the step time with gloo's own gathers
  (`python benchmarks/fsdp.py --gather-copies-max 1048576` runs them as gloo's). So gathers up to
  what a reduce-scatter may hold above gloo's own.
- all-reduce: every rank sends the whole tensor to every other and sums the n that arrive, in rank
  order (so every rank gets the same bits). n times the bytes of a ring, so only up to 1 MiB:
  0.2-0.3 of gloo's time to 256 KB, 0.6-0.8 at 1 MB, 1.8-2.2 at 4 MB.

`for_backend` rewrites a copy of the local program, the one that runs; `as_text` and
`cost_analysis` keep the collectives the partitioner chose, as a backend's own choice of ring or
tree would (so the peak-memory estimate leaves out the bounded buffers below). Simulated ranks
stand for any backend and run the program as the partitioner wrote it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ndfunc._src.collective_cost import fraction
from ndfunc._src.partition.program import Comm, comm, set_comm
from ndfunc._src.runtime import cpu_backend
from ndfunc._src.torch_compat import group_backend, group_size

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
REWRITTEN = ("gloo",)
# What an all-to-all form may hold above gloo's own, in bytes: a reduce-scatter's arrivals (as big
# as its input) until their sum; a gather's n copies sent (as big as its result). An all-reduce's
# n copies, sent and arrived, are bounded by what the measurements above favour (1 MiB at n = 4).
REDUCE_SCATTER_MAX = 16 * 2**20
GATHER_COPIES_MAX = REDUCE_SCATTER_MAX
ALL_REDUCE_COPIES_MAX = 4 * 2**20


def for_backend(gm: torch.fx.GraphModule, backend_of) -> torch.fx.GraphModule:
    """A copy of `gm` whose reductions (sums and means; all-reduces by max or min too) and gathers
    (up to the bounds above) over groups whose backend (`backend_of(group_name)`) is gloo run as
    all-to-alls; `gm` itself if none does.
    Shapes come from what each collective sends (its `Comm`), so the program does no shape work."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    rewrites = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or (c := comm(node)) is None or len(node.users) != 1:
            continue
        shape, dtype, device = c.sent, c.dtype, c.device
        (wait,) = node.users
        size = math.prod(shape) * dtype.itemsize
        if device.type != "cpu" or wait.target is not c10d.wait_tensor.default or backend_of(node.args[-1]) not in REWRITTEN:
            continue
        if node.target is c10d.reduce_scatter_tensor.default:
            x, op, n, group = node.args
            if op in ("sum", "avg") and dtype.is_floating_point and size <= REDUCE_SCATTER_MAX:
                _sum_what_comes(graph, node, wait, x, n, group, op, shape)
                rewrites += 1
        elif node.target is c10d.all_gather_into_tensor.default:
            x, n, group = node.args
            if shape and size * n <= GATHER_COPIES_MAX:
                with graph.inserting_before(node):
                    copies = graph.call_function(aten.repeat.default, (x, [n] + [1] * (len(shape) - 1)))
                    swapped = _all_to_all(graph, copies, n, shape[0] * n, group)
                _exchange(swapped, c, (shape[0] * n, *shape[1:]), n)
                node.replace_all_uses_with(swapped)
                graph.erase_node(node)
                rewrites += 1
        elif node.target is c10d.all_reduce.default:
            x, op, group = node.args
            n = _group_size(group)
            if op in _LOCAL_REDUCTIONS and dtype.is_floating_point and size * n <= ALL_REDUCE_COPIES_MAX:
                numel = math.prod(shape)
                with graph.inserting_before(node):
                    copies = graph.call_function(aten.repeat.default, (
                        graph.call_function(aten.reshape.default, (x, [-1])), [n]))
                _sum_what_comes(graph, node, wait, copies, n, group, op, (n * numel,), shape)
                rewrites += 1
    return torch.fx.GraphModule(gm, graph) if rewrites else gm


def _sum_what_comes(graph, node, wait, x, n: int, group, op: str, sent: tuple, result: tuple | None = None) -> None:
    """Replace the reduction `node` (and its `wait`) by an all-to-all of `x`'s (shape `sent`) n row
    blocks and, once waited for, the reduction by `op` (`_LOCAL_REDUCTIONS`) of the n blocks that arrive,
    shaped `result` (a block's if None)."""
    k = sent[0] // n
    with graph.inserting_before(node):
        swapped = _all_to_all(graph, x, n, sent[0], group)
    _exchange(swapped, comm(node), tuple(sent), n)
    with graph.inserting_before(wait):
        arrived = graph.call_function(c10d.wait_tensor.default, (swapped,))
        blocks = graph.call_function(aten.reshape.default, (arrived, [n, k, *sent[1:]]))
        out = graph.call_function(_LOCAL_REDUCTIONS[op], (blocks, [0]))
        if result is not None:
            out = graph.call_function(aten.reshape.default, (out, list(result)))
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)
    graph.erase_node(node)


# how the blocks that arrive are reduced: an all-reduce's by any of these (a vocabulary-parallel
# softmax's max per token too), a reduce-scatter's by a sum or mean
_LOCAL_REDUCTIONS = {"sum": aten.sum.dim_IntList, "avg": aten.mean.dim, "max": aten.amax.default,
                     "min": aten.amin.default}


def _exchange(node: torch.fx.Node, was: Comm, sent: tuple, n: int) -> None:
    """The record of the all-to-all that stands for the collective `was` records: it sends `sent`
    (n blocks, one to each rank) and keeps one."""
    moved = fraction("all_to_all", n) * math.prod(sent) * was.dtype.itemsize
    set_comm(node, dataclasses.replace(was, kind="all_to_all", sent=sent, received=sent, moved=moved))


def _all_to_all(graph, x, n: int, rows: int, group) -> torch.fx.Node:
    """Block i of `x`'s `rows` rows to rank i; what comes back: block i from rank i (to be waited for)."""
    splits = [rows // n] * n
    return graph.call_function(c10d.all_to_all_single.default, (x, splits, splits, group))


_group_size = group_size


def backend_of(group_name: str) -> str:
    """The backend the process group named `group_name` runs CPU tensors on ('gloo', 'fake', ..):
    a group made for several devices names one per device ('cpu:gloo,cuda:nccl')."""
    return cpu_backend(group_backend(group_name))
