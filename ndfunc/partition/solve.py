"""Choose a strategy for every node of a traced step, for the whole graph at once.

The cost of a choice is the bytes its collectives move (alpha-beta: `redistribute.cost`), summed
over every place a value must change layout for a consumer, plus a small term for work done
replicated that could be split. A value needed in the same layout by several consumers is moved
once (its forward all-gather serves the backward too), so costs are not a sum over edges and a
choice made op by op is not enough: the DP step would all-reduce a gradient for Adam's first moment
and again for its second. We start from a greedy pass in program order and then improve one node at
a time against all its neighbours (producers, their other consumers, its own consumers) until no
single change lowers the total; a changed node puts its neighbours back on the worklist.

Inputs (placeholders) and `with_sharding_constraint` nodes have one candidate; requested output
layouts are extra consumers; an output left to the partitioner only has to end up without a
pending sum.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import deque

import torch
from torch.distributed.tensor import Partial, Replicate

from ndfunc.partition import redistribute
from ndfunc.partition.layout import Layout
from ndfunc.partition.strategies import Strategy, candidates, tensor_inputs, tensor_outputs

Value = tuple  # (producing node, output index)


def finished(layout: Layout) -> Layout:
    """`layout` with pending sums reduced (what a free output becomes)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in layout)


def value_of(arg: torch.fx.Node) -> Value:
    """The value an fx argument refers to: a getitem of a multi-output node is (node, i)."""
    if arg.op == "call_function" and arg.target is operator.getitem and isinstance(
            arg.args[0].meta.get("val"), (tuple, list)):
        return (arg.args[0], arg.args[1])
    return (arg, 0)


@dataclasses.dataclass
class Plan:
    sizes: tuple[int, ...]
    strategy: dict  # node -> Strategy
    outputs: list  # per graph output leaf: (Value, final layout)
    cost: float

    def out_layout(self, v: Value) -> Layout:
        return self.strategy[v[0]].outs[v[1]]


class Problem:
    def __init__(self, graph: torch.fx.Graph, sizes: tuple[int, ...], input_layouts: list[Layout],
                 output_layouts: list[Layout | None]):
        self.sizes = sizes
        self.nodes: list[torch.fx.Node] = []
        self.cands: dict[torch.fx.Node, list[Strategy]] = {}
        self.inputs: dict[torch.fx.Node, list[Value]] = {}
        self.consumers: dict[Value, list[tuple[torch.fx.Node, int]]] = {}
        self.final: dict[Value, list[Layout | None]] = {}
        self.meta: dict[Value, tuple[tuple[int, ...], int]] = {}
        placeholders = iter(input_layouts)
        for node in graph.nodes:
            if node.op == "placeholder":
                val = node.meta["val"]
                self._add(node, [Strategy((next(placeholders),), ())], [])
                self.meta[(node, 0)] = (tuple(val.shape), val.element_size())
            elif node.op == "call_function":
                if node.target is operator.getitem and isinstance(node.args[0].meta.get("val"), (tuple, list)):
                    continue
                ins = [value_of(a) for a in tensor_inputs(node)]
                self._add(node, candidates(node, sizes), ins)
                for j, t in enumerate(tensor_outputs(node)):
                    if t is not None:
                        self.meta[(node, j)] = (tuple(t.shape), t.element_size())
            elif node.op == "output":
                leaves = node.args[0]
                self.requested = list(output_layouts)
                self.output_values = [value_of(a) for a in leaves]
                for v, lay in zip(self.output_values, output_layouts):
                    self.final.setdefault(v, []).append(lay)

    def _add(self, node, cands, ins) -> None:
        self.nodes.append(node)
        self.cands[node] = cands
        self.inputs[node] = ins
        for slot, v in enumerate(ins):
            self.consumers.setdefault(v, []).append((node, slot))

    # --- costs ---------------------------------------------------------------------------------
    _tcost: dict = {}

    def tcost(self, v: Value, src: Layout, dst: Layout) -> float:
        shape, itemsize = self.meta[v]
        key = (shape, itemsize, src, dst, self.sizes)
        c = Problem._tcost.get(key)
        if c is None:
            c = Problem._tcost[key] = redistribute.cost(src, dst, shape, self.sizes, itemsize)
        return c

    def demands(self, v: Value, choice: dict, skip=None) -> set:
        """Layouts `v` must take for its decided consumers (except node `skip`) and outputs."""
        out = set()
        for m, slot in self.consumers.get(v, ()):
            if m is not skip and m in choice:
                out.add(self.cands[m][choice[m]].ins[slot])
        return out

    def output_cost(self, v: Value, lay: Layout) -> float:
        total = 0.0
        for want in set(self.final.get(v, ())):
            total += self.tcost(v, lay, finished(lay) if want is None else want)
        return total

    def value_cost(self, v: Value, choice: dict) -> float:
        """What moving `v` costs: from its produced layout to each one its consumers need."""
        lay = self.cands[v[0]][choice[v[0]]].outs[v[1]]
        if lay is None or v not in self.meta:
            return 0.0
        return sum(self.tcost(v, lay, want) for want in self.demands(v, choice)) + self.output_cost(v, lay)

    def local_cost(self, node, s: Strategy, choice: dict, forward: bool = False) -> float:
        """Cost terms that depend on `node`'s strategy, given every other node's (`forward`: only
        the consumers that cannot change count, as when they will be chosen again next)."""
        total = 0.0
        by_value: dict[Value, set] = {}
        for slot, v in enumerate(self.inputs[node]):
            by_value.setdefault(v, set()).add(s.ins[slot])
        for v, wanted in by_value.items():
            p = v[0]
            if p not in choice:
                continue
            have = self.cands[p][choice[p]].outs[v[1]]
            # forward: siblings are being chosen again too, so a layout they want is not yet paid
            for lay in wanted if forward else wanted - self.demands(v, choice, skip=node):
                total += self.tcost(v, have, lay)
        for j, lay in enumerate(s.outs):
            v = (node, j)
            if lay is None or v not in self.meta:
                continue
            for m, slot in self.consumers.get(v, ()):
                if m in choice and not (forward and len(self.cands[m]) > 1):
                    want = self.cands[m][choice[m]].ins[slot]
                    if want != lay and all(self.cands[m2][choice[m2]].ins[s2] != want
                                           for m2, s2 in self.consumers[v] if (m2, s2) < (m, slot) and m2 in choice
                                           and not (forward and len(self.cands[m2]) > 1)):
                        total += self.tcost(v, lay, want)
            total += self.output_cost(v, lay)
        return total

    def neighbours(self, node) -> set:
        out = set()
        for v in self.inputs[node]:
            out.add(v[0])
            out.update(m for m, _ in self.consumers.get(v, ()))
        for j in range(len(self.cands[node][0].outs)):
            out.update(m for m, _ in self.consumers.get((node, j), ()))
        out.discard(node)
        return out

    def total(self, choice: dict) -> float:
        total = 0.0
        for node in self.nodes:
            s = self.cands[node][choice[node]]
            for j, lay in enumerate(s.outs):
                v = (node, j)
                if lay is None or v not in self.meta:
                    continue
                total += sum(self.tcost(v, lay, want) for want in self.demands(v, choice))
                total += self.output_cost(v, lay)
        return total

    # --- search --------------------------------------------------------------------------------
    def solve(self, max_rounds: int = 50) -> Plan:
        choice: dict = {}
        for node in self.nodes:  # greedy, in program order
            choice[node] = self._best(node, choice)
        work = deque(n for n in self.nodes if len(self.cands[n]) > 1)
        queued = set(work)
        budget = max_rounds * len(self.nodes)
        while work and budget > 0:
            budget -= 1
            node = work.popleft()
            queued.discard(node)
            best = self._best(node, choice)
            if best != choice[node]:
                choice[node] = best
                for m in self.neighbours(node):
                    if m not in queued and len(self.cands[m]) > 1:
                        work.append(m)
                        queued.add(m)
        self._improve_chains(choice)
        strategy = {n: self.cands[n][choice[n]] for n in self.nodes}
        outputs = [(v, finished(strategy[v[0]].outs[v[1]]) if want is None else want)
                   for v, want in zip(self.output_values, self.requested)]
        return Plan(self.sizes, strategy, outputs, self.total(choice))

    def _improve_chains(self, choice: dict, rounds: int = 8) -> None:
        """Moves one node cannot make alone, tried where data moves: (1) give a moved value a
        different layout for all its consumers at once; (2) change one node. Either way every node
        downstream that now prefers another strategy is chosen again, and the lot is kept if the
        total fell. (Adam reads a gradient in four places: reduce-scattering it instead of
        all-reducing it pays only if all four change together, and what they feed after them.)"""
        self.order = {n: i for i, n in enumerate(self.nodes)}
        for _ in range(rounds):
            improved = False
            for v in self._hot_values(choice):
                if self.value_cost(v, choice) <= 0:
                    continue
                moves = [self._redirect(v, lay, choice) for lay in self._layouts_for(v, choice)]
                moves += [self._chain(n, i, choice) for n in self._neighbourhood(v)
                          for i in range(len(self.cands[n])) if i != choice[n]]
                delta, changes = min(moves, key=lambda m: m[0], default=(0.0, None))
                if changes is not None and delta < -1e-6:
                    choice.update(changes)
                    improved = True
            if not improved:
                return

    def _hot_values(self, choice: dict) -> list:
        """Values that move, in program order."""
        return sorted((v for v in self.meta if v[0] in choice and self.value_cost(v, choice) > 0),
                      key=lambda v: (self.order[v[0]], v[1]))

    def _neighbourhood(self, v: Value) -> list:
        nodes = [v[0]] + [m for m, _ in self.consumers.get(v, ())]
        return [n for n in dict.fromkeys(nodes) if len(self.cands[n]) > 1]

    def _layouts_for(self, v: Value, choice: dict) -> list:
        """Layouts some consumer of `v` could take it in."""
        lays = set()
        for m, slot in self.consumers.get(v, ()):
            lays.update(s.ins[slot] for s in self.cands[m])
        return sorted(lays, key=repr)

    def _redirect(self, v: Value, lay: Layout, choice: dict) -> tuple[float, dict | None]:
        old: dict = {}
        for m, slot in self.consumers.get(v, ()):
            if len(self.cands[m]) == 1 or self.cands[m][choice[m]].ins[slot] == lay:
                continue
            options = [i for i, s in enumerate(self.cands[m]) if s.ins[slot] == lay]
            if not options:
                continue
            old.setdefault(m, choice[m])
            choice[m] = min(options, key=lambda i: self.local_cost(m, self.cands[m][i], choice, forward=True))
        if not old:
            return 0.0, None
        return self._settle(old, choice)

    def _chain(self, node, idx: int, choice: dict) -> tuple[float, dict]:
        old = {node: choice[node]}
        choice[node] = idx
        return self._settle(old, choice)

    def _settle(self, old: dict, choice: dict, limit: int = 256) -> tuple[float, dict]:
        """Re-choose what lies downstream of the nodes in `old` (already changed in `choice`),
        measure the change in total cost, restore `choice`; return (delta, the new choices)."""
        import heapq

        heap = [(self.order[m], id(m), m) for n in list(old) for j in range(len(self.cands[n][choice[n]].outs))
                for m, _ in self.consumers.get((n, j), ())]
        heapq.heapify(heap)
        seen = set(old)
        while heap and len(old) < limit:
            _, _, m = heapq.heappop(heap)
            if m in seen or len(self.cands[m]) == 1:
                continue
            seen.add(m)
            best = self._best(m, choice, forward=True)
            if best != choice[m]:
                old.setdefault(m, choice[m])
                choice[m] = best
                for j in range(len(self.cands[m][best].outs)):
                    for m2, _ in self.consumers.get((m, j), ()):
                        heapq.heappush(heap, (self.order[m2], id(m2), m2))
        values = set()
        for m in old:
            values.update(self.inputs[m])
            values.update((m, j) for j in range(len(self.cands[m][0].outs)))
        values &= self.meta.keys()
        after = sum(self.value_cost(v, choice) for v in values)
        new = {m: choice[m] for m in old}
        choice.update(old)
        before = sum(self.value_cost(v, choice) for v in values)
        return after - before, new

    def _best(self, node, choice, forward: bool = False) -> int:
        cands = self.cands[node]
        if len(cands) == 1:
            return 0
        current = choice.get(node)
        costs = [self.local_cost(node, s, choice, forward) for s in cands]
        best = min(range(len(cands)), key=costs.__getitem__)
        if current is not None and costs[current] <= costs[best] + 1e-9:
            return current  # keep on ties: the search only moves downhill
        return best


def partition(graph: torch.fx.Graph, sizes: tuple[int, ...], input_layouts: list[Layout],
              output_layouts: list[Layout | None]) -> Plan:
    """Pick a strategy for every node; outputs end in `output_layouts` (None: the partitioner's
    choice, without pending sums)."""
    return Problem(graph, sizes, input_layouts, output_layouts).solve()
