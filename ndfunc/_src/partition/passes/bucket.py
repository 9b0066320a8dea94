"""Bucketing: neighbouring collectives of one kind over one group become one, on their values laid
end to end.

On real links a collective costs a fixed latency before its first byte, so DDP packs gradient
all-reduces into buckets and FSDP2 gathers (and reduce-scatters) a whole layer's parameters at once.
One routine does it for the three kinds the programs have:

- `plan` takes candidates (`Member`s: a collective, its wait, a key the members of one bucket agree
  on, where its input is ready and where its result is first needed) in program order and fills a
  bucket per key while one collective can serve every member (issued after every input is ready,
  waited for before any result is needed) and the bytes stay within a cap, as DDP's do, so the
  extra copy stays bounded;
- `merge` replaces a bucket by one collective of the concatenation, its wait, and the pieces cut
  back out; how a kind lays its members end to end and cuts them back is its `Packing`
  (`ALL_REDUCE`, `REDUCE_SCATTER`, `ALL_GATHER`).

Who calls it decides which collectives are candidates and what their key says: `bucket_all_reduces`
(data parallelism's gradients, a pipeline pass) here; `nf.fsdp`'s gathers and reduce-scatters, one
layer's each, in `ndfunc._src.transforms.fsdp`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Iterable, Sequence

import torch

from ndfunc._src.partition import program as prog
from ndfunc._src.torch_compat import eliminate_dead_code

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket


@dataclasses.dataclass(frozen=True)
class Member:
    """A collective a bucket may take.

    `ready`: the position of its last input in the program (-1: made anywhere, as a view of a program
    input is; `movable` are those views, moved to where the bucket is issued); `needed`: the position
    its bucket's wait must come before (where its result is first read); `bytes`: what it counts
    against the cap.
    """

    collective: torch.fx.Node
    wait: torch.fx.Node
    key: tuple
    ready: int
    needed: int
    bytes: float
    movable: tuple[torch.fx.Node, ...] = ()

    @property
    def comm(self) -> prog.Comm:
        return prog.comm(self.collective)


def plan(members: Iterable[Member], cap: float, index: dict, at_first: bool = False) -> list[list[Member]]:
    """The buckets of two or more `members` (in program order, by `index`), filled greedily per key.

    A bucket is issued right after the last of its inputs is ready; a member joins while its input
    is ready before any result is needed. `at_first`: the members were placed by the scheduler
    (`nf.fsdp`'s prefetch): a bucket is a run of them issued one after another, issued where its
    first is, and a member of another key ends it.
    """
    done, open_ = [], {}
    for m in sorted(members, key=lambda m: index[m.collective]):
        for k in [k for k in open_ if at_first and k != m.key]:  # ends the other keys' buckets
            if len(b := open_.pop(k)) > 1:
                done.append(b)
        current = open_.get(m.key, [])
        if current:
            issue = index[current[0].collective] if at_first else max(c.ready for c in current + [m]) + 1
            fits = (max(c.ready for c in current + [m]) < issue <= min(c.needed for c in current + [m])
                    and sum(c.bytes for c in current) + m.bytes <= cap)
            if fits:
                current.append(m)
                continue
        if len(current) > 1:
            done.append(current)
        open_[m.key] = [m]
    return done + [b for b in open_.values() if len(b) > 1]


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a collective of one kind takes several values as one, and gives each back.

    `share(comm, n)`: a member's elements in each rank's part of the bucket; `send(graph, value,
    comm, n, share)`: the member's input as it joins the bucket (a flat tensor, or the `n` ranks' rows);
    `joined(graph, parts, n)`: the bucket's input from those; `pieces(graph, waited, sizes, n)`: the
    bucket's result, cut into one piece per member (yielded in turn); `unpack(graph, piece, member,
    n)`: a member's result from its piece (None: it replaced the member's readers itself);
    `total(sizes, n)`: the bucket's (sent, received) shapes.
    """

    kind: str
    group_arg: int  # where the collective's group size is among its arguments (0: none)
    share: Callable
    send: Callable
    joined: Callable
    pieces: Callable
    unpack: Callable
    total: Callable


def _flat(graph, value, comm, n, share):
    return graph.call_function(aten.reshape.default, (value, [-1]))


def _rows(graph, value, comm, n, share):
    return graph.call_function(aten.reshape.default, (value, [n, share]))


def _cat(graph, parts, n):
    return graph.call_function(aten.cat.default, (parts,))


def _cat_rows(graph, parts, n):
    return graph.call_function(aten.reshape.default, (graph.call_function(aten.cat.default, (parts, 1)), [-1]))


def _split(graph, waited, sizes, n):
    pieces = graph.call_function(aten.split_with_sizes.default, (waited, list(sizes)))
    for i in range(len(sizes)):  # one at a time: each piece is unpacked before the next is cut
        yield graph.call_function(operator.getitem, (pieces, i))


def _columns(graph, waited, sizes, n):
    """Each rank's block of the gathered bucket is its parts end to end: member i is column range i."""
    blocks = graph.call_function(aten.reshape.default, (waited, [n, sum(sizes)]))
    start = 0
    for size in sizes:
        yield graph.call_function(aten.slice.Tensor, (blocks, 1, start, start + size))
        start += size


def _received(graph, piece, member, n):
    return graph.call_function(aten.reshape.default, (piece, list(member.comm.received)))


def _reduced(graph, piece, member, n):
    out = _received(graph, piece, member, n)
    prog.note_local(out, member.comm.received, member.comm.dtype)  # a reduction over the next axis may read it
    return out


def _gathered(graph, piece, member, n):
    """A parameter gathered along a dim other than 0 is viewed as its ranks' blocks (`[n, *block]`)
    and copied with them put along its dim (`lower`'s all-gather): view the blocks in the bucket
    instead, so that copy is its only one (the gathered parameter laid end to end first would be
    a second)."""
    shape = list(member.comm.sent)
    (blocks,) = member.wait.users if len(member.wait.users) == 1 else (None,)
    if blocks is None or blocks.target is not aten.view.default or list(blocks.args[1]) != [n, *shape]:
        return _received(graph, piece, member, n)
    blocks.replace_all_uses_with(graph.call_function(aten.reshape.default, (piece, [n, *shape])))
    graph.erase_node(blocks)
    return None


ALL_REDUCE = Packing("all_reduce", 0, lambda c, n: math.prod(c.sent), _flat, _cat, _split, _received,
                     lambda sizes, n: ((sum(sizes),), (sum(sizes),)))
REDUCE_SCATTER = Packing("reduce_scatter", 2, lambda c, n: math.prod(c.sent) // n, _rows, _cat_rows, _split, _reduced,
                         lambda sizes, n: ((n * sum(sizes),), (sum(sizes),)))
ALL_GATHER = Packing("all_gather", 1, lambda c, n: math.prod(c.sent), _flat, _cat, _columns, _gathered,
                     lambda sizes, n: ((sum(sizes),), (n * sum(sizes),)))


def merge(gm: torch.fx.GraphModule, bucket: Sequence[Member], packing: Packing, nodes: list, index: dict,
          at_first: bool = False, cut_at_once: bool = False, **changes) -> None:
    """One collective for `bucket` (`plan`'s), issued where `plan` said, its result cut into the
    members' where the first is needed (`cut_at_once`: right after it), waited for just before; it
    takes the first member's window, and `schedule` places it. `nodes` and `index`: the program
    order `plan` saw. `changes`: fields of the bucket's `Comm` that differ from its members'
    (`parameters=True`)."""
    graph = gm.graph
    first = bucket[0].collective
    issue = first if at_first else nodes[max(m.ready for m in bucket)].next  # (a live node)
    for m in bucket:  # what a member sends that is made later (views of a program input) moves up
        for v in m.movable:
            if index[v] > index[issue]:
                issue.prepend(v)
    n = first.args[packing.group_arg] if packing.group_arg else 1
    sizes = [packing.share(m.comm, n) for m in bucket]
    with graph.inserting_before(issue):
        parts = [packing.send(graph, m.collective.args[0], m.comm, n, size) for m, size in zip(bucket, sizes)]
        collective = graph.call_function(first.target, (packing.joined(graph, parts, n), *first.args[1:]))
    sent, received = packing.total(sizes, n)
    prog.set_comm(collective, prog.merged([m.comm for m in bucket], sent, received, **changes))
    prog.set_window(collective, prog.window(first))
    at = collective.next if cut_at_once else nodes[min(m.needed for m in bucket)]
    with graph.inserting_before(at):
        waited = graph.call_function(c10d.wait_tensor.default, (collective,))
        for m, piece in zip(bucket, packing.pieces(graph, waited, sizes, n)):
            out = packing.unpack(graph, piece, m, n)
            if out is not None:
                m.wait.replace_all_uses_with(out)
    for m in bucket:
        graph.erase_node(m.wait)
        graph.erase_node(m.collective)


def bucket_all_reduces(gm: torch.fx.GraphModule) -> int:
    """Merge all-reduces in `gm` (those the lowering recorded a `Comm` for; same group, dtype and
    reduction) up to `BUCKET_BYTES`; how many were merged away."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    members = []
    for n in gm.graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        if len(n.users) != 1 or (c := prog.comm(n)) is None:
            continue
        wait = next(iter(n.users))
        if wait.target is not c10d.wait_tensor.default or not wait.users:
            continue
        # ready where the scheduler issued it: a bucket delays its members to its last, never
        # advances one (what it reads may be made earlier, a reduction's result waited for in turn)
        members.append(Member(n, wait, (n.args[1], n.args[2], c.dtype, c.device), index[n] - 1,
                              min(index[u] for u in wait.users), c.sent_bytes))
    buckets = plan(members, BUCKET_BYTES, index)
    for b in buckets:
        merge(gm, b, ALL_REDUCE, nodes, index, cut_at_once=True)
    if buckets:
        eliminate_dead_code(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return sum(len(b) - 1 for b in buckets)
