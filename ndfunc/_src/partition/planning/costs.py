"""What a plan costs: each node's work, and each value moved from the layout its producer makes
to every distinct layout its consumers take, once each (a forward all-gather serves the backward
too), priced by `redistribute` and remembered per value size; and the terms that depend on one
node's choice (`local_cost`), which the search moves by."""

from __future__ import annotations

import math

import numpy as np
from torch.distributed.tensor import Partial, Replicate

from ndfunc._src.partition.planning import redistribute
from ndfunc._src.partition.planning.layout import Layout
from ndfunc._src.partition.planning.problem import HUB, VECTOR_MIN

EPS = 1e-6

# prices -> (src codes, dst codes, sizes) -> `redistribute.coded_steps`, shared by every problem priced alike
_TRANSITIONS: dict = {}


def finished(layout: Layout) -> Layout:
    """`layout` with pending sums reduced (what a free output becomes)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in layout)


class Costs:
    """Costs of a choice (a candidate per node) of an `Arrays` problem."""

    def tcost(self, v: int, a: int, b: int) -> float:
        """What changing value `v` from layout `a` to `b` costs (`redistribute.coded_cost`): the
        steps walked once per pair of layouts (`_steps`; across problems, `_TRANSITIONS`), priced
        once per value size (`_priced_as`)."""
        if a == b:
            return 0.0
        key = a << 32 | b
        c = self._size_costs[v].get(key)
        return c if c is not None else self._tcost_new(v, key)

    def _tcost_new(self, v: int, key: int) -> float:
        """`tcost` of a pair (`key`: a << 32 | b, a != b) not yet priced for `v`'s size."""
        steps = self._steps.get(key)
        if steps is None:
            known = self._transitions
            if known is None:  # (found once a problem: prices hash slowly)
                known = self._transitions = _TRANSITIONS.setdefault(self.prices, {})
            full = (self.codes[key >> 32], self.codes[key & 0xFFFFFFFF], self.sizes)
            steps = known.get(full)
            if steps is None:
                steps = known[full] = redistribute.coded_steps(*full, self.prices)
            self._steps[key] = steps
        numel, itemsize = self.priced_as[v]
        c = self._size_costs[v][key] = redistribute.priced(steps, numel, itemsize)
        return c

    def finish(self, lay: int) -> int:
        f = self.finished.get(lay)
        if f is None:
            f = self.finished[lay] = self._layout(finished(self.layouts[lay]))
        return f

    def out_layout(self, v: int, choice: list) -> int | None:
        n, j = self.values[v]
        return self.c_outs[n][choice[n]][j]

    def demands(self, v: int, choice: list, skip: int = -1) -> set:
        """Layouts `v` must take for its decided consumers (except `skip`)."""
        return {ins[choice[m]][slot] for ins, m, slot in self._read_by[v] if m != skip and choice[m] >= 0}

    def paid(self, v: int, choice: "_Choice", n: int):
        """`demands(v, choice, skip=n)` as `local_cost` reads it, for its consumer `n`: whether a
        layout is among them (another consumer pays for moving `v` there). For a value with many
        consumers, from the search's counts (`_Choice`)."""
        if len(self._read_by[v]) <= HUB:
            return self.demands(v, choice, skip=n)
        counts = choice.wants.get(v, {})
        i = choice[n]
        own = [self.c_ins[n][i][slot] for u, slot in self._hub_slots[n] if u == v] if i >= 0 else []
        return {w for w, c in counts.items() if c > own.count(w)}

    def output_cost(self, v: int, lay: int) -> float:
        """What a step's output `v` made in `lay` costs to leave in the layouts requested of it;
        remembered by what that reads (`_output_kind`: a parameter and its optimizer state read
        alike), as every candidate of every node making an output asks it."""
        kind = self._output_kind.get(v)
        if kind is None:
            return 0.0
        key = kind << 32 | lay
        c = self._output_costs.get(key)
        if c is None:
            c = self._output_costs[key] = sum(self.tcost(v, lay, self.finish(lay) if w is None else w)
                                              for w in set(self.final[v]))
        return c

    def value_cost(self, v: int, choice: list) -> float:
        outs, n, j = self._made_by[v]  # (the search asks this hundreds of thousands of times)
        lay = outs[choice[n]][j]
        if lay is None:
            return 0.0
        costs = self._size_costs[v]  # `tcost`, inline
        consumers = self._read_by[v]
        if len(consumers) <= 2:  # the demands without a set: two terms add alike in either order
            wants = [ins[choice[m]][slot] for ins, m, slot in consumers if choice[m] >= 0]
            if len(wants) == 2 and wants[0] == wants[1]:
                wants.pop()
        elif len(consumers) > HUB and len(wants := [w for w in choice.wants.get(v, ()) if w != lay]) <= 2:
            pass  # the demands counted (`_Choice`), in any order: two terms add alike either way
        else:
            wants = self.demands(v, choice)
        total = 0
        for w in wants:
            if w != lay:
                c = costs.get(lay << 32 | w)
                total += c if c is not None else self._tcost_new(v, lay << 32 | w)
        return total + (self.output_cost(v, lay) if v in self.final else 0.0)

    def local_cost(self, n: int, i: int, choice: list, forward: bool = False) -> float:
        """Cost terms that depend on node `n` taking candidate `i`, given every other node's
        (`forward`: consumers that can change, and siblings, are being chosen again after it)."""
        total = self.c_work[n][i]
        ins = self.c_ins[n][i]
        inputs = self.inputs[n]
        repeated = self.repeated[n]
        for slot, v in enumerate(inputs):
            p, j = self.values[v]
            cp = choice[p]
            if cp < 0:
                continue
            want = ins[slot]
            if repeated and any(inputs[s] == v and ins[s] == want for s in range(slot)):
                continue  # the same value, wanted the same way by another slot: already paid
            if not forward and want in self.paid(v, choice, n):
                continue
            have = self.c_outs[p][cp][j]
            if want != have:
                total += self.tcost(v, have, want)
                if self.wary:  # and what undoing it would cost
                    total += self.tcost(v, want, self.finish(have))
        for v, lay in zip(self.out_ids[n], self.c_outs[n][i]):
            if lay is None or v is None:
                continue
            wants = self.fixed_wants[v] if forward else self.demands(v, choice)
            for want in wants:
                if want != lay:
                    total += self.tcost(v, lay, want)
            if v in self.final:
                total += self.output_cost(v, lay)
        return total

    def local_costs(self, n: int, options, choice: list,
                    forward: bool = False) -> dict[int, float] | np.ndarray:
        """`local_cost(n, i, choice, forward)` for the candidates `i` of `options` that can be the
        cheapest, the same sums in the same order, with each input's and output's terms found once
        per layout (a 4-axis op has hundreds of candidates). Every term is a cost, so a candidate
        whose work alone exceeds a cost already found is left out: it cannot be the least, and the
        current candidate is always priced. Candidate -> cost; a float64 array (priced as columns)
        where all were asked and priced."""
        work = self.c_work[n]
        if not self.repeated[n] and len(options) >= VECTOR_MIN:
            # forward, the costs read neither the node's own choice nor its consumers': remembered
            totals = self._every_local_cost(n, choice) if forward else self._vector_costs(n, choice, forward)
            if isinstance(options, range) and len(options) == len(totals):
                return totals  # every candidate: the column is the map
            return {i: totals[i] for i in options}
        if self.repeated[n]:  # which slots pay for a value shared between them depends on them all
            def cost_of(i):
                return self.local_cost(n, i, choice, forward)
        else:
            c_ins, c_outs = self.c_ins[n], self.c_outs[n]
            slots = []  # per input slot: (slot, its terms by the layout wanted)
            for slot, v in enumerate(self.inputs[n]):
                p, j = self.values[v]
                if choice[p] >= 0:
                    slots.append((slot, self._input_terms(v, self.c_outs[p][choice[p]][j], n, choice, forward)))
            outs = [(j, self._output_terms(v, choice, forward)) for j, v in enumerate(self.out_ids[n]) if v is not None]

            def cost_of(i):
                total = work[i]
                ins = c_ins[i]
                for slot, terms in slots:
                    for t in terms(ins[slot]):
                        total += t
                lays = c_outs[i]
                for j, terms in outs:
                    if lays[j] is not None:
                        for t in terms(lays[j]):
                            total += t
                return total
        costs = {}
        current = choice[n]
        bound = math.inf
        for i in ([current] if current >= 0 else []) + [min(options, key=work.__getitem__)]:
            costs[i] = cost_of(i)
            bound = min(bound, costs[i])
        for i in options:
            if i not in costs and work[i] <= bound:
                costs[i] = cost_of(i)
                bound = min(bound, costs[i])
        return costs

    def _every_local_cost(self, n: int, choice: list) -> list[float] | np.ndarray:
        """`local_cost(n, i, choice, forward=True)` of every candidate `i`, as columns where there
        are many (the same floats); remembered by what they read (`_situation`, the node's own
        choice aside), so a move tried in one of identical layers, or from another candidate of
        the node, is priced once."""
        key = self._situation(n, choice, True, own=False)
        costs = self._every.get(key)
        if costs is None:
            if not self.repeated[n] and len(self.c_ins[n]) >= VECTOR_MIN:
                costs = self._vector_costs(n, choice, True)
            else:
                costs = [self.local_cost(n, i, choice, True) for i in range(len(self.c_ins[n]))]
            self._every[key] = costs
        return costs

    def total(self, choice: list) -> float:
        c_work, value_cost = self.c_work, self.value_cost
        return sum([c_work[n][i] for n, i in enumerate(choice)]) + sum(
            [value_cost(v, choice) for v in range(len(self.values))])

    def out_values(self, n: int) -> list[int]:
        return self._made[n]

    def neighbours(self, n: int) -> set:
        out = set()
        for v in self.inputs[n]:
            out.add(self.values[v][0])
            out.update(m for m, _ in self.consumers[v])
        for v in self.out_values(n):
            out.update(m for m, _ in self.consumers[v])
        out.discard(n)
        return out


class _Choice(list):
    """A search's choice of candidate per node (-1: none yet), counting for each value with many
    consumers (`Problem._hub_slots`) how many of their slots want each layout, as it changes."""

    __slots__ = ("_problem", "wants")

    def __init__(self, problem: Costs, n: int):
        super().__init__([-1] * n)
        self._problem = problem
        self.wants: dict[int, dict[int, int]] = {}  # value -> layout -> how many consumer slots want it

    def __setitem__(self, n: int, i: int) -> None:
        slots = self._problem._hub_slots[n]
        if slots:
            old = list.__getitem__(self, n)
            c_ins = self._problem.c_ins[n]
            for v, slot in slots:
                counts = self.wants.setdefault(v, {})
                if old >= 0:
                    w = c_ins[old][slot]
                    counts[w] -= 1
                    if not counts[w]:
                        del counts[w]
                if i >= 0:
                    w = c_ins[i][slot]
                    counts[w] = counts.get(w, 0) + 1
        list.__setitem__(self, n, i)
