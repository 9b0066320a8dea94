"""The collective scheduler: where each collective of a local program starts and where it is waited for.

The lowering writes a layout change where its reader is: the collective, its `wait_tensor`, the
reader. Issued there, a collective overlaps nothing. A start moved earlier runs beside the compute
after it, a wait moved later lets the compute before it run beside the collective; either holds
memory longer (a collective reads its input until its wait). This module is the one place that
moves a start or a wait, as XLA's latency-hiding scheduler is for a whole program: each collective
has a `Window` (declared by who made it, `program.set_window`, else its kind's), and `schedule`
places every one by one rule, *start as early as its window allows, wait as late as it allows*:

- `Start.LOWERED`: where the lowering wrote it. `Start.EARLY`: right after what it reads is made
  (and last written), with the data movement that makes its input (views, copies, cuts): a
  gradient's reduction, which the lowering writes where the optimizer reads it, at the end, with
  the whole gradient alive until then. With `after`, no earlier than just before that node, with
  what it reads that is made of program inputs alone (`nf.fsdp`'s prefetch: a layer's gathers
  start where the layer `prefetch` places earlier first reads its parameters). A start is placed
  once, by the first `schedule` that sees it, and its window becomes `LOWERED`: the passes after
  (bucketing, `nf.fsdp`'s buckets, the memory passes) plan around where it is.
- `Wait.AT_ONCE`: right after the start. `Wait.READ`: just before its result is first read (a
  prefetched gather). `Wait.TURN`: that, but before the next reduction over its group is issued:
  one in flight per group, so a gradient reduced early is not held, full size, all through
  backward. `Wait.PEAK`: the later of `READ` and `TURN` that keeps the step's peak memory, else at
  once, and at once until `schedule(..., peak=True)`, which the pipeline runs after the memory
  passes, so the peak kept is the one that runs (`nf.fsdp`'s gradient reduce-scatters, in flight
  over the next layer's backward as FSDP2's reduce-scatter stream is; on CPU the overlap lets
  ranks that share cores drift apart without blocking each other at every layer).

Undeclared, a reduction (all-reduce, reduce-scatter) is `Window(Start.EARLY, Wait.TURN)` and any
other collective `Window()`. No start moves above a write into what it reads, no wait below one.
Waits go among the other ops, in the order of their collectives where several go before one op,
so a program scheduled again does not change.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import operator
from fractions import Fraction

import torch

from ndfunc._src import view_ops
from ndfunc._src.buffers import lifetimes
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.passes.analysis import live_bytes
from ndfunc._src.partition.passes.hoist import writes

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
REDUCTIONS = (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)  # the gradient collectives
COLLECTIVES = (*REDUCTIONS, c10d.all_gather_into_tensor.default, c10d.all_to_all_single.default)
# data movement
_MOVES = view_ops.SAME_ELEMENTS | {operator.getitem, aten.split.Tensor, aten.cat.default, aten.slice.Tensor}


class Start(enum.Enum):
    LOWERED = "lowered"
    EARLY = "early"


class Wait(enum.Enum):
    AT_ONCE = "at once"
    READ = "read"
    TURN = "turn"
    PEAK = "peak"


@dataclasses.dataclass(frozen=True)
class Window:
    """Where a collective may start and be waited for (the module docstring)."""

    start: Start = Start.LOWERED
    wait: Wait = Wait.AT_ONCE
    after: torch.fx.Node | None = None  # with Start.EARLY: no earlier than just before this node


def window_of(collective: torch.fx.Node) -> Window:
    """Its declared window, else its kind's."""
    if (w := prog.window(collective)) is not None:
        return w
    return Window(Start.EARLY, Wait.TURN) if collective.target in REDUCTIONS else Window()


def needs_peak(gm: torch.fx.GraphModule) -> bool:
    """Whether a collective of `gm` waits where the peak allows (`schedule(..., peak=True)` places it)."""
    return any(window_of(c).wait is Wait.PEAK for c, _ in _collectives(gm))


def schedule(gm: torch.fx.GraphModule, peak: bool = False) -> int:
    """Place every collective of `gm` and its wait by its window (the module docstring); `peak`:
    the program's memory is final (its metadata filled), so `Wait.PEAK` waits go as late as it
    allows. How many nodes moved."""
    order = _Order(gm)
    found = _collectives(gm)
    was = {w: w.prev for _, w in found}
    moved = sum(order.start(c, window_of(c)) for c, _ in found)
    nexts = _next_in_group(found, order.index)
    later: dict = {}  # Wait.PEAK, the peak known: collective -> (its wait, what the wait followed)
    for c, w in found:
        window = window_of(c)
        read = min(w.users, key=order.index.__getitem__, default=None)
        if window.wait is Wait.READ:
            at = read
        elif window.wait is Wait.TURN:
            at = min((a for a in (read, nexts.get(c)) if a is not None), key=order.index.__getitem__, default=None)
        else:  # AT_ONCE, and PEAK until the peak is known
            at = c.next
        if window.wait is Wait.PEAK and peak:  # the peak is that of every such wait at once
            later[c] = (w, was[w])
            order.wait_before(w, at)
        elif at is not None:
            moved += order.wait_before(w, at)
    if later:
        moved += _within_peak(gm, later, nexts, order)
    if moved:
        gm.recompile()
    return moved


def _collectives(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(collective, its wait) in program order: those waited for by one `wait_tensor`."""
    return [(c, w) for c in gm.graph.nodes if c.op == "call_function" and c.target in COLLECTIVES
            and len(c.users) == 1 and (w := next(iter(c.users))).target is c10d.wait_tensor.default]


def _next_in_group(found: list, index: dict) -> dict:
    """Each reduction -> the next reduction issued over its group (none for the last)."""
    by_group: dict = {}
    for c, _ in sorted(found, key=lambda cw: index[cw[0]]):
        if c.target in REDUCTIONS:
            by_group.setdefault(c.args[-1], []).append(c)
    return {r: following for issued in by_group.values() for r, following in zip(issued, issued[1:])}


def _within_peak(gm, later: dict, nexts: dict, order: "_Order") -> int:
    """Move each of `later`'s waits (now right after its collective) to the later of where its
    result is first read and where its turn ends at which the peak of live bytes stays as it is,
    in program order, each move counted in the next one's room; how many are not where they were."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    places = {}
    for c, (w, _) in later.items():
        read = min(w.users, key=index.__getitem__, default=None)
        turn = nexts[c] if read is not None and c in nexts and index[nexts[c]] < index[read] else read
        places[c] = [at for at in dict.fromkeys((read, turn)) if at is not None]
    live, read_last = live_bytes(nodes)
    peak = max(live.values())
    for c, (w, _) in later.items():
        held = sum(read_last.get(w, ()))  # what the wait frees: waited for later, it lives longer
        for at in places[c]:
            span = _between(w, at)
            if max((live[x] for x in span), default=0) + held <= peak and order.may_wait_before(w, at):
                order.wait_before(w, at)
                for x in span:
                    live[x] += held
                break
    return sum(w.prev is not was for w, was in later.values())


def _between(a: torch.fx.Node, b: torch.fx.Node) -> list:
    """The nodes after `a` and before `b`."""
    out, x = [], a.next
    while x is not b and x.op != "output":
        out.append(x)
        x = x.next
    return out


class _Order:
    """The program order as nodes move: an exact position per node (a move takes the midpoint of
    its new neighbours'), the buffer each reads and where each buffer is written."""

    def __init__(self, gm: torch.fx.GraphModule):
        nodes = list(gm.graph.nodes)
        self.index: dict = {n: Fraction(i) for i, n in enumerate(nodes)}
        self.root, _ = lifetimes(nodes)
        self.written: dict = {}  # buffer -> the ops that write into it, in program order (they never move)
        self.of_inputs: set = set()  # nodes made of the program's inputs alone
        for n in nodes:
            if n.op in ("placeholder", "get_attr") or (n.op == "call_function" and all(
                    a in self.of_inputs for a in n.all_input_nodes)):
                self.of_inputs.add(n)
            if n.op == "call_function" and writes(n):
                for a in n.all_input_nodes:
                    self.written.setdefault(self.root[a], []).append(n)

    def start(self, c: torch.fx.Node, window: Window) -> int:
        """Move `c`, with what makes its input that may move with it, as early as `window` allows."""
        if window.start is Start.LOWERED:
            return 0
        prog.set_window(c, Window(Start.LOWERED, window.wait))  # placed once: passes after plan around it
        moves = (lambda n: n in self.of_inputs) if window.after is not None else (lambda n: n.target in _MOVES)
        cone, todo = {c}, list(c.all_input_nodes)
        while todo:
            a = todo.pop()
            if a not in cone and a.op == "call_function" and moves(a):
                cone.add(a)
                todo += a.all_input_nodes
        bounds = [a for n in cone for a in n.all_input_nodes if a not in cone]
        bounds += [w for a in bounds if (w := self._last_write(a, c)) is not None]  # nothing moves above one
        if window.after is not None:
            bounds.append(window.after.prev)
        if not bounds:
            return 0
        at = max(bounds, key=self.index.__getitem__)
        late = sorted((n for n in cone if self.index[n] > self.index[at]), key=self.index.__getitem__)
        if _runs_after(at, late):
            return 0
        for n in late:
            self._move_after(n, at)
            at = n
        return len(late)

    def _last_write(self, a: torch.fx.Node, before: torch.fx.Node) -> torch.fx.Node | None:
        """The last op before `before` that writes into `a`'s buffer."""
        writes_ = self.written.get(self.root.get(a), [])
        i = bisect.bisect_left(writes_, self.index[before], key=self.index.__getitem__)
        return writes_[i - 1] if i else None

    def wait_before(self, w: torch.fx.Node, at: torch.fx.Node) -> int:
        """Move the wait `w` to just before `at` (after its collective, before its readers) unless
        it is there or that would pass a write into what its collective reads; 1 if it moved."""
        x = w.next
        while x is not at and x.target is c10d.wait_tensor.default:  # other waits for `at` come first
            x = x.next
        if x is at or at is w or not self.may_wait_before(w, at):
            return 0
        while at.prev.target is c10d.wait_tensor.default and self.index[at.prev.args[0]] > self.index[w.args[0]]:
            at = at.prev  # the waits just before `at` in the order of their collectives
        self._move_after(w, at.prev)
        return 1

    def may_wait_before(self, w: torch.fx.Node, at: torch.fx.Node) -> bool:
        """Whether no write into what `w`'s collective reads comes between `w` and `at`."""
        if self.index[at] <= self.index[w]:
            return True
        for a in w.args[0].all_input_nodes:
            write = self._last_write(a, at)
            if write is not None and self.index[write] > self.index[w]:
                return False
        return True

    def _move_after(self, node: torch.fx.Node, at: torch.fx.Node) -> None:
        if at.next is node:
            return
        nxt = at.next
        self.index[node] = (self.index[at] + self.index[nxt]) / 2 if nxt.op != "root" else self.index[at] + 1
        at.append(node)


def _runs_after(at: torch.fx.Node, nodes: list) -> bool:
    """Whether `nodes` follow `at`, in order, with nothing between."""
    for n in nodes:
        if at.next is not n:
            return False
        at = n
    return True
