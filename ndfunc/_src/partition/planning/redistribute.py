"""From one layout to another: the collectives, in order, with their sizes.

`plan(src, dst, shape, sizes)` is the single source for both the cost model and the lowering
(which emits each step as a functional collective). A collective's bytes and seconds are
`collective_cost`'s (a ring's share: `fraction`), priced on its axis's link (`Prices`). Steps, per
mesh axis:

- `all_gather`   Shard(d) -> Replicate                   moves (n-1)/n of the output per rank
- `all_reduce`   Partial -> Replicate                    moves 2(n-1)/n of the input (ring)
- `reduce_scatter` Partial -> Shard(d)                   moves (n-1)/n of the input
- `all_to_all`   Shard(d) -> Shard(e)                    moves (n-1)/n of the input
- `slice`        Replicate -> Shard(d)                   local, free
- `partition`    Replicate -> Partial                    local: a last resort (`LAST_RESORT`)
- `permute`      two axes trading dims                   moves one block, point to point

An axis that moves its split from one dim to another, where it is the innermost split of both
(any other axis splitting either comes earlier in the mesh and stays), exchanges blocks in one
all-to-all, as XLA's partitioner and DTensor do: a gather and a slice
would move n times the bytes to keep a 1/n of them. Several axes moving their splits so take turns
where mesh order would not nest them (`_chained_swaps`): each moves when it is the innermost split
of both its dims. The partitioner still prices such a move as
the gather and the slice (`cost`): priced at its own bytes, a split would hop between dims
wherever activations are smaller than weights, and a data-parallel step given FSDP's specs would
turn tensor-parallel layer by layer (sharding propagation in XLA keeps the split where the inputs
put it, too). So the choice of layouts is what it was without all-to-alls, and what runs moves
less; `cost_analysis` reads what runs.

Two axes of one size that trade the dims they split (`P('a', 'b')` -> `P('b', 'a')`), no other axis
splitting either, need no gather: the rank at (i, j) holds exactly the block the rank at (j, i)
needs, so every rank sends its block to that one (`permute`, one block per rank, where two
gathers and two slices would move the whole value). Where one axis is m times the other, each
block goes to m ranks, an m-th to each, in m rounds of such sends (`point_to_point.trade_blocks`):
still one block per rank in all.

Several axes sharding one dim nest in mesh order, so before an axis gathers, or newly splits a dim,
every later axis splitting that dim is gathered first (and split again afterwards). The lowering runs
a run of one collective over several axes as one over them flattened (`merged`); the cost model
prices the steps as `plan` writes them. A pending reduction is finished only by its own
reduction, and made only from a whole value (`partition`: a sum is the value on the axis's first
rank and zero on the others, a mean or an extremum the value on each), which the search takes as a
last resort (`LAST_RESORT`); a split value made pending has no plan.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Sequence

import numpy as np
from torch.distributed.tensor import Partial, Replicate, Shard

from ndfunc._src.collective_cost import Machine, fraction, machine
from ndfunc._src.partition.planning.layout import EXTREMA, MANUAL, Layout, local_shape

COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # 'all_gather' | 'all_reduce' | 'reduce_scatter' | 'all_to_all' | 'slice' | 'partition' | 'permute'
    axis: int  # partitioned mesh axis
    dim: int | None  # tensor dim gathered, scattered or sliced; of an all-to-all, the one split
    reduce_op: str | None
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    size: int  # ranks along the axis
    joined: int | None = None  # of an all-to-all, the dim whose blocks are joined
    axes: tuple[int, ...] = ()  # of a collective over several axes flattened (`merged`): them, in mesh order

    @property
    def over(self) -> tuple[int, ...]:
        """The partitioned mesh axes the step runs over, in mesh order."""
        return self.axes or (self.axis,)

    def moved_bytes(self, itemsize: int) -> float:
        """Bytes each rank sends (`collective_cost.fraction` of `value_bytes`); none for a local step."""
        if self.kind in ("slice", "partition"):
            return 0.0
        return fraction(self.kind, self.size) * math.prod(self.out_shape if self.kind == "all_gather"
                                                          else self.in_shape) * itemsize

    def value_bytes(self, itemsize: int) -> int:
        """The size of the value it is about: the gathered whole, the reduced or exchanged input."""
        return math.prod(self.out_shape if self.kind == "all_gather" else self.in_shape) * itemsize


def plan(src: Layout, dst: Layout, shape: Sequence[int], sizes: Sequence[int], swaps: bool = True) -> list[Step] | None:
    """The steps turning a value of global `shape` from `src` into `dst`; None if impossible.
    Without `swaps`, a split moves between dims by a gather and a slice (no all-to-all)."""
    if src == dst:
        return []
    if MANUAL in (src, dst):
        return None  # a region's values leave it only through its exit
    k = len(src)
    for s, d in zip(src, dst):
        if isinstance(d, Partial) and s != d and not isinstance(s, Replicate):
            return None
    if swaps and (pair := _traded(src, dst, shape, sizes)) is not None:
        return [Step("permute", pair[0], None, None, local_shape(shape, tuple(src), sizes),
                     local_shape(shape, tuple(dst), sizes), sizes[pair[0]], joined=pair[1])]
    if swaps and (order := _chained_swaps(src, dst, shape, sizes)) is not None:
        steps, now = [], local_shape(shape, tuple(src), sizes)
        for m in order:
            steps.append(_all_to_all(m, src[m].dim, dst[m].dim, now, sizes))
            now = steps[-1].out_shape
        return steps
    cur = list(src)
    swap = {m for m in range(k) if swaps and _swaps_inside(src, dst, m)}
    gather = {m for m in range(k) if isinstance(cur[m], Shard) and dst[m] != cur[m] and m not in swap}
    grown = True
    while grown:
        grown = False
        for m in range(k):
            dims = set()
            if m in gather:
                dims.add(cur[m].dim)
            if isinstance(dst[m], Shard) and cur[m] != dst[m]:
                dims.add(dst[m].dim)
            for later in range(m + 1, k):
                if later not in gather and isinstance(cur[later], Shard) and cur[later].dim in dims:
                    gather.add(later)
                    grown = True
    steps = []
    now = local_shape(shape, tuple(cur), sizes)
    for m in sorted(gather, reverse=True):
        d = cur[m].dim
        out = now[:d] + (now[d] * sizes[m],) + now[d + 1:]
        steps.append(Step("all_gather", m, d, None, now, out, sizes[m]))
        cur[m], now = Replicate(), out
    for m in _finishing_order(cur, dst):
        if cur[m] == dst[m]:
            continue
        if m in swap:
            steps.append(_all_to_all(m, cur[m].dim, dst[m].dim, now, sizes))
            now = steps[-1].out_shape
        elif isinstance(cur[m], Partial):
            op = cur[m].reduce_op
            if isinstance(dst[m], Replicate) or op in EXTREMA:  # an extremum: all-reduced, then sliced
                steps.append(Step("all_reduce", m, None, op, now, now, sizes[m]))
                if isinstance(dst[m], Shard):
                    d = dst[m].dim
                    out = now[:d] + (now[d] // sizes[m],) + now[d + 1:]
                    steps.append(Step("slice", m, d, None, now, out, sizes[m]))
                    now = out
            else:
                d = dst[m].dim
                out = now[:d] + (now[d] // sizes[m],) + now[d + 1:]
                steps.append(Step("reduce_scatter", m, d, op, now, out, sizes[m]))
                now = out
        elif isinstance(dst[m], Partial):  # Replicate -> Partial: a local part of the value
            steps.append(Step("partition", m, None, dst[m].reduce_op, now, now, sizes[m]))
        else:  # Replicate -> Shard
            d = dst[m].dim
            out = now[:d] + (now[d] // sizes[m],) + now[d + 1:]
            steps.append(Step("slice", m, d, None, now, out, sizes[m]))
            now = out
        cur[m] = dst[m]
    return steps


def merged(steps: list[Step]) -> list[Step]:
    """`steps` with each run of one collective over several axes made one, over those axes
    flattened: gathers of one dim (the innermost axis first, as `plan` orders them), reduce-scatters
    of one dim (the outermost first) and all-reduces of one reduction. FSDP over `('dp_shard',
    'cp')` then gathers a parameter in one all-gather and scatters its gradient in one
    reduce-scatter, as torchtitan's flattened `dp_shard_cp` group does. Splits of one dim nest in
    mesh order, which is the flattened group's rank order, so the one collective makes what the
    run made: a gather or a scatter moves the same bytes with one latency instead of several, and
    an all-reduce over n1 x n2 ranks moves 2(n-1)/n of the value where two moved 2(n1-1)/n1 +
    2(n2-1)/n2."""
    out: list[Step] = []
    for step in steps:
        last = out[-1] if out else None
        if last is not None and _continues(last, step):
            axes = tuple(sorted((*last.over, step.axis)))
            out[-1] = dataclasses.replace(last, axis=axes[0], axes=axes, out_shape=step.out_shape,
                                          size=last.size * step.size)
        else:
            out.append(step)
    return out


def _continues(run: Step, step: Step) -> bool:
    """Whether `step` continues `run` (a step, or steps merged) as one collective over their axes."""
    if step.kind != run.kind or step.dim != run.dim or step.reduce_op != run.reduce_op or step.axis in run.over:
        return False
    if step.kind == "all_gather":
        return step.axis < run.over[0]  # outward: the blocks of inner axes gathered first
    if step.kind == "reduce_scatter":
        return step.axis > run.over[-1]  # inward: each axis splits the block the one before left
    return step.kind == "all_reduce"


def _all_to_all(m: int, a: int, d: int, now: tuple[int, ...], sizes: Sequence[int]) -> Step:
    """Axis `m` moving its split from dim `a` to dim `d` of a block of shape `now`."""
    out = list(now)
    out[a], out[d] = now[a] * sizes[m], now[d] // sizes[m]
    return Step("all_to_all", m, d, None, now, tuple(out), sizes[m], joined=a)


def _finishing_order(cur: Sequence, dst: Sequence) -> list[int]:
    """The axes in the order their last steps run: mesh order, but a pending sum that ends
    replicated (an all-reduce) after every step that shrinks the block. HSDP's gradient is
    reduce-scattered over `dp_shard` first and its shard all-reduced over `dp_replicate`, not
    all-reduced whole and then scattered: the same sum, on a block `dp_shard` times smaller.
    (A reduction commutes with slicing on other axes; splits of one dim still nest in mesh order.)"""
    late = [m for m in range(len(cur)) if isinstance(cur[m], Partial) and isinstance(dst[m], Replicate)]
    return [m for m in range(len(cur)) if m not in late] + late


def _traded(src: Layout, dst: Layout, shape: Sequence[int], sizes: Sequence[int]) -> tuple[int, int] | None:
    """The two axes that trade their split dims between `src` and `dst` (the larger first), every
    other axis the same in both and splitting neither dim, the larger axis's size a multiple m of
    the smaller's and the block m-divisible where it is cut in pieces; else None."""
    moved = [m for m in range(len(src)) if src[m] != dst[m]]
    if len(moved) != 2:
        return None
    a, b = sorted(moved, key=lambda m: -sizes[m])
    if not all(type(p) is Shard for p in (src[a], src[b], dst[a], dst[b])) or sizes[a] % sizes[b]:
        return None
    if not (src[a] == dst[b] and src[b] == dst[a] and src[a] != src[b]):
        return None
    dims = {src[a].dim, src[b].dim}
    if any(isinstance(src[m], Shard) and src[m].dim in dims for m in range(len(src)) if m not in (a, b)):
        return None
    pieces = sizes[a] // sizes[b]
    return (a, b) if local_shape(shape, tuple(src), sizes)[src[b].dim] % pieces == 0 else None


def _swaps_inside(src: Layout, dst: Layout, m: int) -> bool:
    """Whether axis `m` moves its split between two dims where it is the innermost split of both:
    every other axis splitting either dim, before or after, splits it alike before and after and
    comes earlier in the mesh (splits of one dim nest in mesh order, so the blocks `m` exchanges
    lie inside the others': HSDP's batch, over `('dp_replicate', 'dp_shard')`, trades `dp_shard`
    with the embedding's width in one all-to-all per replica)."""
    if not (type(src[m]) is Shard and type(dst[m]) is Shard and src[m].dim != dst[m].dim):
        return False
    dims = {src[m].dim, dst[m].dim}
    return all(j < m and src[j] == dst[j] for j in range(len(src)) if j != m
               if any(isinstance(p, Shard) and p.dim in dims for p in (src[j], dst[j])))


def _chained_swaps(src: Layout, dst: Layout, shape: Sequence[int], sizes: Sequence[int]) -> tuple[int, ...] | None:
    """An order in which the axes that change between `src` and `dst`, each moving its split from
    one dim to another, do so by all-to-alls alone, where moving them one at a time in mesh order
    would not: each axis, when it moves, the innermost split of both its dims (every other axis
    splitting either then comes earlier in the mesh), so the blocks nest in mesh order throughout,
    and the dim it leaves its block in dividing by its size. An embedding's output, its width split
    over `('dp_shard', 'cp')`, to batch over dp_shard and sequence over cp: cp's split moves first,
    then dp_shard's, two all-to-alls where gathers over both would move the whole value. None where
    fewer than two axes change, another kind of step is needed, each move alone is such a swap
    (`_swaps_inside`), or no order keeps the nesting."""
    moved = [m for m in range(len(src)) if src[m] != dst[m]]
    if len(moved) < 2 or not all(type(src[m]) is Shard and type(dst[m]) is Shard and src[m].dim != dst[m].dim
                                 for m in moved):
        return None
    if all(_swaps_inside(src, dst, m) for m in moved):
        return None
    for order in itertools.permutations(moved):
        cur, now = list(src), local_shape(shape, tuple(src), sizes)
        for m in order:
            a, d = cur[m].dim, dst[m].dim
            if now[d] % sizes[m] or any(type(p) is Shard and p.dim in (a, d) for j, p in enumerate(cur) if j > m):
                break
            now = _all_to_all(m, a, d, now, sizes).out_shape
            cur[m] = dst[m]
        else:
            return order
    return None


SLICE = 0.01  # a local slice copies its block, per byte: cheap, not free (values stay where they are made)
# A whole value made a pending sum (its part on each rank: `partition`) is exact and local, but the
# search takes it only where nothing else reaches the layout asked (an output pinned unreduced, as
# `nf.accumulate(reduce='end')` pins the running sums): priced above any plan that moves data, so
# no plan that has another way changes. (Priced as the local write it is, it opens paths the
# search's greedy moves take to costlier plans: the 4-axis llama step's, +8%.)
LAST_RESORT = 2.0 ** 50


@dataclasses.dataclass(frozen=True)
class Prices:
    """What the partitioner pays, in its unit: seconds times `Machine.unit` (a byte sent at the
    fastest link's rate). Per partitioned axis, `(per byte of the value, once)` of an all-gather, a
    reduce-scatter and an all-reduce over it (`Machine.cost`: `collective_cost`'s seconds on the
    axis's link); `flops`: the flops one unit is worth (`Machine.flops_per_unit`)."""

    all_gather: tuple[tuple[float, float], ...]
    reduce_scatter: tuple[tuple[float, float], ...]
    all_reduce: tuple[tuple[float, float], ...]
    flops: float

    @classmethod
    def of(cls, on: Machine, axis_names: Sequence[str], sizes: Sequence[int]) -> Prices:
        """The prices of the partitioned axes `axis_names` (of `sizes` ranks) on `on`."""
        def per_axis(kind):
            return tuple(on.cost(kind, (axis,), n) for axis, n in zip(axis_names, sizes))
        return cls(per_axis("all_gather"), per_axis("reduce_scatter"), per_axis("all_reduce"), on.flops_per_unit)


@functools.cache
def host_prices(sizes: tuple[int, ...]) -> Prices:
    """The prices of axes of `sizes` on this machine (`collective_cost.HOST`): no cluster given."""
    return Prices.of(machine({}), [str(m) for m in range(len(sizes))], sizes)


def cost(src: Layout, dst: Layout, shape: Sequence[int], sizes: Sequence[int], itemsize: int,
         prices: Prices | None = None) -> float:
    """What the partitioner pays for a layout change (a move between dims: as a gather and a slice):
    the steps of `plan(src, dst, shape, sizes, swaps=False)`, each a collective's price (`Prices`;
    `host_prices` unless given) or `SLICE` of its block (a slice), summed in order."""
    return coded_cost(codes(src), codes(dst), shape, sizes, itemsize, prices)


_REPLICATE = -1
_PARTIALS = {op: -2 - i for i, op in enumerate(("sum", "avg", "max", "min", "product"))}
_EXTREMA = tuple(_PARTIALS[op] for op in EXTREMA)


def codes(layout: Layout) -> tuple[int, ...] | None:
    """`layout` as small ints, what `coded_cost` reads: a split's dim, -1 replicated, -2 and below
    a pending reduction by its op; None for a layout no plan reaches (manual, or a placement
    outside programs)."""
    out = []
    for p in layout:
        if type(p) is Shard:
            out.append(p.dim)
        elif type(p) is Replicate:
            out.append(_REPLICATE)
        elif isinstance(p, Partial) and p.reduce_op in _PARTIALS:
            out.append(_PARTIALS[p.reduce_op])
        else:
            return None
    return tuple(out)


def coded_cost(src: tuple[int, ...] | None, dst: tuple[int, ...] | None, shape: Sequence[int],
               sizes: Sequence[int], itemsize: int, prices: Prices | None = None) -> float:
    """`cost` over `codes`, for layouts that fit `shape`: `plan`'s steps without swaps, walked on
    ints (`coded_steps`) and priced for the value (`priced`), the same sum in the same order.
    `tests/test_redistribute` holds it to `plan`."""
    return priced(coded_steps(src, dst, sizes, prices), math.prod(shape), itemsize)


def coded_steps(src: tuple[int, ...] | None, dst: tuple[int, ...] | None, sizes: Sequence[int],
                prices: Prices | None = None) -> tuple[tuple[float, int, float], ...] | None:
    """The steps from `src` to `dst` (codes) as `priced` reads them, whatever the value: each its
    cost per byte of the block it moves (that block being the whole divided by `div`: layouts that
    fit divide exactly) and its fixed cost (`prices`, `host_prices` unless given); None where no
    plan exists. The partitioner walks each pair of layouts once and prices it for every value
    size."""
    if src == dst:
        return ()
    if src is None or dst is None:
        return None
    prices = prices or host_prices(tuple(sizes))
    k = len(src)
    for s, d in zip(src, dst):
        if d <= -2 and s != d and s != _REPLICATE:
            return None  # a pending sum is made from a whole value only
    cur = list(src)
    gather = [c >= 0 and d != c for c, d in zip(src, dst)]
    # an axis that gathers, or newly splits, a dim first has every later axis on it gathered; a
    # gather so added reaches only later axes, so one pass in mesh order finds them all
    for m in range(k - 1):
        c, d = cur[m], dst[m]
        moved = c if gather[m] else None
        split = d if d >= 0 and c != d else None
        if moved is None and split is None:
            continue
        for later in range(m + 1, k):
            c2 = cur[later]
            if c2 >= 0 and not gather[later] and (c2 == moved or c2 == split):
                gather[later] = True
    div = 1
    for c, n in zip(cur, sizes):
        if c >= 0:
            div *= n
    steps = []
    for m in range(k - 1, -1, -1):
        if gather[m]:
            div //= sizes[m]
            per_byte, once = prices.all_gather[m]
            steps.append((per_byte, div, once))
            cur[m] = _REPLICATE
    late = [m for m in range(k) if cur[m] <= -2 and dst[m] == _REPLICATE]  # `_finishing_order`'s
    for m in ([m for m in range(k) if m not in late] + late) if late else range(k):
        c, d = cur[m], dst[m]
        if c == d:
            continue
        n = sizes[m]
        if c <= -2:  # a pending sum, finished
            (reduced, reduced_once), (scattered, scattered_once) = prices.all_reduce[m], prices.reduce_scatter[m]
            if d == _REPLICATE:
                steps.append((reduced, div, reduced_once))
            elif c in _EXTREMA:  # all-reduced, then sliced
                steps.append((reduced, div, reduced_once))
                div *= n
                steps.append((SLICE, div, 0.0))
            else:
                steps.append((scattered, div, scattered_once))
                div *= n
        elif d <= -2:  # Replicate -> Partial: a local part of the block
            steps.append((SLICE, div, LAST_RESORT))
        else:  # Replicate -> Shard: a local slice
            div *= n
            steps.append((SLICE, div, 0.0))
    return tuple(steps)


def priced(steps: tuple[tuple[float, int, float], ...] | None, numel: int, itemsize: int) -> float:
    """What `coded_steps` cost for a value of `numel` elements of `itemsize` bytes."""
    if steps is None:
        return float("inf")
    total = 0
    for weight, div, fixed in steps:
        total += weight * (numel // div) * itemsize + fixed
    return total


def priced_pairs(src: np.ndarray, dst: np.ndarray, sizes: Sequence[int], numel: int, itemsize: int,
                 prices: Prices | None = None) -> np.ndarray:
    """`priced(coded_steps(s, d, sizes, prices), numel, itemsize)` for each row `s` of `src` and `d`
    of `dst` (codes as (N, k) int64 arrays, none None; a single row is broadcast), all rows at once:
    `coded_steps`' walk on columns, each step's cost added in the same order, so the same floats
    (inf where no plan). The partitioner prices a node's candidate layouts so, hundreds at a time."""
    prices = prices or host_prices(tuple(sizes))
    src, dst = (np.ascontiguousarray(a.T) for a in np.broadcast_arrays(src, dst))  # (k, N): one row an axis
    k = len(sizes)
    cur = src.copy()
    gather = (cur >= 0) & (dst != cur)
    for m in range(k - 1):  # later axes on a dim an axis gathers or newly splits gather first
        c, d = cur[m], dst[m]
        moved, split = gather[m], (d >= 0) & (c != d)
        if moved.any() or split.any():
            later = cur[m + 1:]  # every later axis at once
            gather[m + 1:] |= (later >= 0) & ((moved & (later == c)) | (split & (later == d)))
    div = np.where(cur >= 0, np.asarray(sizes, dtype=np.int64)[:, None], 1).prod(axis=0)
    total = np.zeros(cur.shape[1])
    for m in range(k - 1, -1, -1):
        g, n = gather[m], sizes[m]
        if g.any():
            div = np.where(g, div // n, div)
            gathered, once = prices.all_gather[m]
            total += np.where(g, (numel // div) * gathered * itemsize + once, 0.0)
            cur[m][g] = _REPLICATE
    late = (cur <= -2) & (dst == _REPLICATE)
    changed = cur != dst
    for now in (changed & ~late, changed & late):  # sums that end replicated last, as `coded_steps` orders them
        for m in np.flatnonzero(now.any(axis=1)).tolist():
            c, d, n, on = cur[m], dst[m], sizes[m], now[m]
            pending = on & (c <= -2)
            parted = on & (d <= -2)  # Replicate -> Partial: a local part of the block
            sliced = on & (c > -2) & ~parted  # Replicate -> Shard: a local slice
            grown = then_sliced = sliced
            if parted.any():
                total += np.where(parted, (numel // div) * SLICE * itemsize + LAST_RESORT, 0.0)
            if pending.any():  # (where none is, those sums add 0.0: nothing)
                to_block = d != _REPLICATE
                extrema = functools.reduce(operator.or_, (c == e for e in _EXTREMA))
                reduced = pending & (~to_block | extrema)  # all-reduced (then sliced, to a block)
                scattered = pending & to_block & ~extrema  # reduce-scattered
                q = numel // div
                (ar, ar_once), (rs, rs_once) = prices.all_reduce[m], prices.reduce_scatter[m]
                total += np.where(reduced, q * ar * itemsize + ar_once,
                                  np.where(scattered, q * rs * itemsize + rs_once, 0.0))
                grown = scattered | sliced | (reduced & to_block)
                then_sliced = sliced | (reduced & to_block)
            div = np.where(grown, div * n, div)
            total += np.where(then_sliced, (numel // div) * SLICE * itemsize + 0.0, 0.0)
    impossible = ((dst <= -2) & (src != dst) & (src != _REPLICATE)).any(axis=0)
    return np.where(impossible, np.inf, total)
