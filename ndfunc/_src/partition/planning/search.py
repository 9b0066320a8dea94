"""The search: two greedy starts in program order (one pricing a layout change at its cost, one
also at the cost of undoing it), single-node moves until none lowers the total, then moves of many
nodes at once (`moves`); late candidates admitted after (`Strategy.late`), and a second search
with them admitted from the start, kept where cheaper; single-node moves again on the plan kept.
A node's best answer is remembered by everything it reads (`best`), so identical layers are
answered once."""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from ndfunc._src.partition.planning.costs import EPS, _Choice, finished
from ndfunc._src.partition.planning.layout import Layout
from ndfunc._src.partition.planning.problem import HUB, Value

# rounds of many-node moves in the search with late candidates admitted from the start, as many as
# the first search's: its wins (a layer's tokens kept split over cp) come from its greedy start, but
# with every linear layer's token splits late (`ndfunc::dot`), one round left it above the first
# search's plan where a rank holds one sequence
SECOND_ROUNDS = 8

# ... and its plan kept where its layout changes cost this much less, as well as its total: where
# they cost about the same, the cost model's difference is below what it leaves out (Llama-3-70B on
# 1x128x1x8, 80 layers, with nf.fsdp: 0.02% less by the model, 12% more bytes sent once lowered);
# its wins move 8-60% less (`tests/test_views.py`, `tests/test_analytic.py`)
SECOND_GAIN = 0.01

# ... and the first plan's last phase (`_relax`) spared where the second's is this much cheaper than
# it before that phase, in its total and in its layout changes: on 22 layouts of Llama-3-70B, small
# and tiny the phase lowered a total by 0.01-2.7% and layout changes by up to 6%, and the second
# search's plans kept by 13-25% at 80 layers (1x32x4x8, 2x32x4x4), so its 0.3-0.5 s go to waste
SECOND_FAR = 0.10


@dataclasses.dataclass
class Plan:
    sizes: tuple[int, ...]
    strategy: dict  # node -> Strategy
    outputs: list  # per graph output leaf: (Value, final layout)
    cost: float  # by the cost model, of the program planned (a chain's left-out calls not in it: `repeats`)
    whole: list = dataclasses.field(default_factory=list)  # nodes that run whole for want of a rule (`ops.runs_whole`)
    bound: float | None = None  # a proven lower bound on any plan's cost (`exact`); None: none sought
    choice: list | None = None  # the candidate taken per node, by the problem's numbering

    def out_layout(self, v: Value) -> Layout:
        return self.strategy[v[0]].outs[v[1]]


class Search:
    """The search over an `Arrays` problem's choices."""

    def solve(self) -> Plan:
        """The cheaper of two searches from greedy starts (one pricing each layout change at its
        cost, one also at the cost of undoing it: a value split to save a reduction will likely be
        gathered again, the Megatron choice of keeping activations whole), then moves of many
        nodes at once from the better (`_settled`). Where a late candidate would take as it is an
        input the plan moves, a second search with the late candidates admitted from the start,
        its plan kept only where cheaper: the first may settle where moving many nodes to them at
        once never pays, as a layer's MLP under FSDP and CP, its input gathered over cp and its
        weights split there."""
        late, self._late = self._late, []
        first = self._settled(late)  # (it admits them)
        # (asked before the first's last phase too: a second search run where only that phase would
        # have spared it is kept only where cheaper than the first's end, as any)
        second = self._second() if self._moves_what_late_would_not(late, first) else None
        if second is None or not self._cheaper(second, first, by=SECOND_FAR):
            first = self._relax(first)
            if second is None and self._moves_what_late_would_not(late, first):
                second = self._second()
            if second is not None and not self._cheaper(second, first):
                second = None
        # the last phase only lowers a total: on the plan kept; then moves of many nodes to more
        # layouts each, and single-node moves again, which moves of many nodes can leave open
        # (`solve`'s text)
        kept = first if second is None else self._relax(second)
        self._widen(kept)
        self._descend(kept)
        return self.plan(kept)

    def _widen(self, choice: list) -> None:
        """Moves of many nodes at once, each value made as a pending sum tried in more layouts
        (`widened`): on a settled plan, where few values still move data, so they cost little."""
        self.widened = True
        self._improve_together(choice)
        self.widened = False

    def plan(self, choice: list, bound: float | None = None) -> Plan:
        """`choice` (a candidate per node) as a `Plan`; `bound`: a proven lower bound on any
        plan's cost (`exact`), where one was found."""
        N = len(self.nodes)
        cost = self.total(choice)
        strategy = {self.nodes[n]: self.strategies[n][choice[n]] for n in range(N)}
        outputs = []
        for v, want in zip(self.output_values, self.requested):
            n, j = self.values[v]
            value = (self.nodes[n], j)
            outputs.append((value, finished(strategy[value[0]].outs[j]) if want is None else want))
        return Plan(self.sizes, strategy, outputs, cost, bound=bound, choice=list(choice))

    def _settled(self, late: list, rounds: int = 8) -> list:
        """From the cheaper of the two greedy starts, moves of many nodes at once; then the `late`
        candidates admitted and the same moves tried around them (the last phase, `_relax`, is
        the caller's)."""
        choice = min((self._search(wary) for wary in (False, True)), key=self.total)
        self._improve_together(choice, rounds)  # the costly part: on the better start only
        if late:  # then the late candidates (`Strategy.late`), from where the others settled
            self._admit(late)
            self._improve_together(choice, near={n for n, _ in late})
        return choice

    def _second(self) -> list:
        """The search with the late candidates admitted from the start (`solve`), before its last
        phase."""
        return self._settled((), rounds=SECOND_ROUNDS)

    def _cheaper(self, other: list, choice: list, by: float = 0.0) -> bool:
        """Whether the second search's plan is kept against the first's: cheaper, and its layout
        changes `SECOND_GAIN` cheaper; `by`: both by that much more (`SECOND_FAR`: against the
        first before its last phase, which only lowers its total, by far less than that on every
        layout measured; the phase is then spared on the plan dropped)."""
        other_cost, cost = self.total(other), self.total(choice)
        return other_cost < (1 - by) * cost and (
            self._moves(other, other_cost) < (1 - by) * (1 - SECOND_GAIN) * self._moves(choice, cost))

    def _relax(self, choice: list) -> list:
        """Moves that rank a producer's new layout as its consumers could take it (`relaxed`):
        only after the others have settled, so a plan changes only where they lower its cost."""
        self.relaxed = True
        self._improve_together(choice)
        self.relaxed = False
        return choice

    def _moves(self, choice: list, total: float) -> float:
        """What a plan's layout changes cost (its `total` given), its work left out."""
        return total - sum(self.c_work[n][choice[n]] for n in range(len(self.nodes)))

    def _moves_what_late_would_not(self, late: list, choice: list) -> bool:
        """Whether some node with late candidates has an input moved to it that one of them would
        take as it is: only then can a search with them admitted from the start end elsewhere."""
        for n, _ in late:
            for slot, v in enumerate(self.inputs[n]):
                have, want = self.out_layout(v, choice), self.c_ins[n][choice[n]][slot]
                if have != want and any(ins[slot] == have for ins in self.c_ins[n]):
                    return True
        return False

    def _admit(self, works: list) -> None:
        """Each node of `works` priced by its work list there: (node, work per candidate)."""
        for n, work in works:
            self.c_work[n], self.min_work[n] = work, min(work)
            self._kind[n] = None  # its work list is another

    def _search(self, wary: bool, max_rounds: int = 50) -> list:
        N = len(self.nodes)
        choice = _Choice(self, N)
        self.wary = wary
        for n in range(N):  # greedy, in program order
            choice[n] = self.best(n, choice)
        self.wary = False
        self._descend(choice, max_rounds)
        return choice

    def _descend(self, choice: list, max_rounds: int = 50) -> None:
        """Single-node moves (`best`), each node's neighbours asked again after it moves, until none
        lowers the total."""
        N = len(self.nodes)
        work = deque(n for n in range(N) if len(self.c_ins[n]) > 1)
        queued = set(work)
        budget = max_rounds * N
        while work and budget > 0:
            budget -= 1
            n = work.popleft()
            queued.discard(n)
            b = self.best(n, choice)
            if b != choice[n]:
                choice[n] = b
                for m in self.neighbours(n):
                    if m not in queued and len(self.c_ins[m]) > 1:
                        work.append(m)
                        queued.add(m)

    def best(self, n: int, choice: list, forward: bool = False) -> int:
        """The candidate of node `n` with the least `local_cost`, keeping the current one on ties.

        Remembered by what the answer depends on (the candidate list, the neighbours' layouts,
        the moved values' shapes): the nodes of identical layers are answered once."""
        if len(self.c_ins[n]) == 1:
            return 0
        key = self._situation(n, choice, forward)
        i = self._best.get(key)
        if i is None:
            i = self._best[key] = self._best_uncached(n, choice, forward)
        return i

    def _situation(self, n: int, choice: list, forward: bool, own: bool = True) -> tuple:
        """Everything `local_cost(n, ., choice, forward)` reads, for every candidate (`own`: and the
        node's current candidate, which `best` keeps on ties)."""
        kind = self._kind[n]
        if kind is None:
            kind = self._kind_of(n)
        # (lists, then tuples: a list display is faster than a generator where this runs ~10^5 times)
        haves = tuple([outs[choice[p]][j] if choice[p] >= 0 else -1 for outs, p, j in self._reads[n]])
        if forward:  # all it reads that changes is the inputs' layouts (and the node's own choice)
            return kind, choice[n] if own else None, self.wary, haves
        # and else what the other consumers of its inputs and outputs want, in their order (which
        # makes the sets `local_cost` reads; -1: not chosen yet), one flat tuple: the kind says
        # how many each value has. Of an input with many consumers, only the layouts the others
        # pay for (`paid`: all `local_cost` reads of them)
        wanted = tuple([ins[choice[m]][slot] if choice[m] >= 0 else -1 for ins, m, slot in self._watched[n]])
        if self._hub_slots[n]:
            return (kind, choice[n] if own else None, self.wary, haves, wanted,
                    tuple([frozenset(self.paid(v, choice, n)) for v, _ in self._hub_slots[n]]))
        return kind, choice[n] if own else None, self.wary, haves, wanted

    def _kind_of(self, n: int) -> int:
        """What `local_cost(n, ., ...)` reads that no choice changes, as an int shared by
        nodes alike in it: the candidate list and work, which slots read one value, the inputs'
        shapes and how many other consumers they have, and the outputs' fixed consumers, requested
        layouts, shapes and how many consumers they have. Also lists those consumers (`_watched`)."""
        first: dict = {}
        ins = tuple((first.setdefault(v, slot) if self.repeated[n] else None, self.value_meta[v],
                     sum(m != n for m, _ in self.consumers[v])) for slot, v in enumerate(self.inputs[n]))
        outs = tuple(None if v is None else (frozenset(self.fixed_wants[v]), frozenset(self.final[v]) if self.final.get(v) else None,
                                             self.value_meta[v], len(self.consumers[v])) for v in self.out_ids[n])
        kind = self._kind[n] = self._kinds.setdefault((id(self.c_work[n]), ins, outs), len(self._kinds))
        read_by = self._read_by
        self._watched[n] = [e for v in self.inputs[n] if len(read_by[v]) <= HUB for e in read_by[v] if e[1] != n] + [
            e for v in self.out_ids[n] if v is not None for e in read_by[v]]
        return kind

    def _best_uncached(self, n: int, choice: list, forward: bool) -> int:
        count = len(self.c_ins[n])
        current = choice[n]
        if current >= 0 and self.local_cost(n, current, choice, forward) <= self.min_work[n] + EPS:
            return current  # nothing moves and the work is the least there is: no candidate does better
        options = range(count)
        if forward:  # downstream of a change: follow the inputs as they now are, if a candidate can
            have = []
            for v in self.inputs[n]:
                p, j = self.values[v]
                have.append(self.c_outs[p][choice[p]][j] if choice[p] >= 0 else None)
            following = self.by_ins[n].get(tuple(have))
            if following:
                options = following if current < 0 or current in following else following + [current]
        costs = self.local_costs(n, options, choice, forward)
        # in order: the first least (options are distinct: all priced, or those that can be least)
        if isinstance(costs, np.ndarray):  # every candidate, as a column: its first least
            best = int(costs.argmin())
        else:
            best = min(options if len(costs) == len(options) else (i for i in options if i in costs),
                       key=costs.__getitem__)
        if current >= 0 and costs[current] <= costs[best] + EPS:
            return current  # keep on ties: the search only moves downhill
        return best
