"""The sharding rule, flops and local op of `ndfunc::dot` and `ndfunc::dot_leading` (`_src/dot.py`).

Per mesh axis, as DTensor's rule for an einsum: the result whole; any dim of the result split as
the operand that has it is split (the other operand whole); the contracted dims split alike in
both operands, the result a pending sum; or one operand a pending sum (or mean) and the other
whole, the result pending the same (the product is linear in each). An activation's batch and
sequence dims are dims of the result as they are, so a batch split over the data-parallel axes and
a sequence over `cp` stay so through every linear layer; a weight's gradient (`dot_leading`, over
every token) is a pending sum over each axis that splits the tokens.

The splits torch's flatten to matrices could not hold (of a dim after the first of its group: the
sequence beside the batch) are `late`, as a reshape's contiguous splits are (`views`): the search
settles without them first, then admits them where they lower its cost, and searches once more
with them from the start (`search.Search.solve`). From the start alone, a greedy first choice of
them (a layer's tokens split over `tp`, its weights gathered) can hold a plan far above the
Megatron one.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ndfunc._src.dot import dot_leading_op
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.planning.layout import local_shape
from ndfunc._src.partition.planning.strategies import Fitted, per_axis

aten = torch.ops.aten


def _dims(node: torch.fx.Node) -> tuple[int, int, int]:
    """(the first operand's kept dims, the contracted dims, the second's kept dims): how many."""
    x, y, dims = node.args[:3]
    return x.meta["val"].dim() - dims, dims, y.meta["val"].dim() - dims


def _bias(node: torch.fx.Node) -> torch.fx.Node | None:
    """A `dot`'s bias (of the second operand's kept dims), or None."""
    if node.target is dot_leading_op:
        return None
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")


def rule(node: torch.fx.Node, sizes: tuple[int, ...]) -> Fitted:
    """The strategies of a `dot` or `dot_leading` node (the module's text), outputs first; a bias
    split as the result's dims it has, and pending where the result is (each rank adds its part,
    as DTensor's rule for `addmm` has it)."""
    a, c, o = _dims(node)
    leading = node.target is dot_leading_op
    # where each kind of dim sits: in the result, the first operand, the second
    kept_x = [(i, c + i if leading else i) for i in range(a)]  # (result dim, x dim)
    kept_y = [(a + i, c + i) for i in range(o)]  # (result dim, y dim)
    summed = [(i, i) for i in range(c)] if leading else [(a + i, i) for i in range(c)]  # (x dim, y dim)
    R = Replicate()
    rules = [(R, R, R)]
    rules += [(Partial("sum"), Shard(dx), Shard(dy)) for dx, dy in summed]
    rules += [(Shard(d), Shard(dx), R) for d, dx in kept_x]
    rules += [(Shard(d), R, Shard(dy)) for d, dy in kept_y]
    for op in Partial.LINEAR_REDUCE_OPS:  # linear in each operand
        rules += [(Partial(op), Partial(op), R), (Partial(op), R, Partial(op))]
    tensors = [node.meta["val"], node.args[0].meta["val"], node.args[1].meta["val"]]
    if (bias := _bias(node)) is not None:  # (the result's dims less a: the bias's)
        rules = [(*r, Shard(r[0].dim - a) if isinstance(r[0], Shard) and r[0].dim >= a else
                  R if isinstance(r[0], Shard) else r[0]) for r in rules]
        tensors.append(bias.meta["val"])
    found = per_axis(rules, [tuple(t.shape) for t in tensors], sizes, 1)
    # what torch's flatten to matrices could not hold, `late` (`Strategy.late`): a split of a dim
    # after the first of its group (the sequence beside the batch, a head's dims beside the heads)
    firsts = ({0, a}, {0, c}) if not leading else ({0, c}, {0, c})
    flat = [_splits_within(lay, firsts) for lay in found.layouts]
    ins = found.arrays[0]
    late = frozenset(i for i, (x, y) in enumerate(ins[:, :2].tolist()) if flat[x][0] or flat[y][1])
    return Fitted(found.layouts, found.arrays[1], ins, late) if late else found


def _splits_within(layout, firsts: tuple[set, set]) -> tuple[bool, bool]:
    """Whether `layout` splits a dim of a group other than its first (`firsts`: the groups' first
    dims, of each operand), read as a layout of either operand."""
    dims = [p.dim for p in layout if type(p) is Shard]
    return tuple(any(d not in first for d in dims) for first in firsts)


def flops(node: torch.fx.Node) -> int:
    """2 per multiply-add: twice the product of every dim's size, each counted once (x's, and the
    second operand's kept ones)."""
    x, y, dims = node.args[:3]
    return 2 * x.meta["val"].numel() * math.prod(y.meta["val"].shape[dims:])


def lower(emitter, node: torch.fx.Node, locals_) -> torch.fx.Node:
    """The local op: each rank's blocks (contiguous in every dim) flattened to matrices and
    multiplied by `mm`, as torch's own decomposition does on one device; the result viewed back."""
    x, y = node.args[:2]
    a, c, o = _dims(node)
    if prog.is_manual(node):  # inside shard_map: the traced shapes are the blocks'
        xs, ys = tuple(x.meta["val"].shape), tuple(y.meta["val"].shape)
    else:
        strategy = emitter.plan.strategy[node]
        xs, ys = (local_shape(tuple(t.meta["val"].shape), lay, emitter.sizes)
                  for t, lay in zip((x, y), strategy.ins))
    dtype = node.meta["val"].dtype
    lx, ly, *bias = locals_

    def call(op, *args, shape):  # (shapes noted for the passes before metadata: the CPU backend's matmul choice)
        return prog.note_local(emitter.call(op, *args), shape, dtype)
    if node.target is dot_leading_op:
        m = math.prod(xs[:c])
        left, right = xs[c:], ys[c:]
        flat = call(aten.reshape.default, lx, [m, math.prod(left)], shape=(m, math.prod(left)))
        first = call(aten.t.default, flat, shape=(math.prod(left), m))
        second = call(aten.reshape.default, ly, [m, math.prod(right)], shape=(m, math.prod(right)))
    else:
        k = math.prod(xs[a:])
        left, right = xs[:a], ys[c:]
        first = call(aten.reshape.default, lx, [math.prod(left), k], shape=(math.prod(left), k))
        second = call(aten.reshape.default, ly, [k, math.prod(right)], shape=(k, math.prod(right)))
    rows, columns = math.prod(left), math.prod(right)
    if bias:  # (a block of the second operand's kept dims)
        flat = call(aten.reshape.default, bias[0], [columns], shape=(columns,))
        made = call(aten.addmm.default, flat, first, second, shape=(rows, columns))
    else:
        made = call(aten.mm.default, first, second, shape=(rows, columns))
    return call(aten.reshape.default, made, [*left, *right], shape=(*left, *right))
