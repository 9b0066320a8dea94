"""Choose a strategy for every node of a traced step, for the whole graph at once.

The cost of a choice is what its collectives move (alpha-beta: `redistribute.cost`), summed over
every place a value must change layout for a consumer, plus each node's floating-point work on one
rank (divided by the mesh axes its strategy splits, in bytes-worth: `FLOPS_PER_BYTE`). A value
needed in one layout by several consumers moves once (a forward all-gather serves the backward
too), so costs are not a sum over edges and a choice made op by op is not enough: the DP step would
all-reduce a gradient for Adam's first moment and again for its second.

The search, from two greedy starts in program order (one pricing a layout change at its cost, one
also at the cost of undoing it), keeping the cheaper end: single-node moves against all neighbours until
none lowers the total (a changed node puts its neighbours back on the worklist); then, where data
still moves, moves of many nodes at once - give a moved value another layout for all its consumers,
or change its producer - each followed by choosing again everything downstream that now prefers
another strategy, kept if the total fell; then, where a node has late candidates (a reshape taking
as it is a split DTensor's rule would move, `strategies.Strategy.late`), those are admitted and the
same moves tried around them, so they change a plan only where it gets cheaper; last, the same
again where a producer's new layout is ranked as its consumers could take it (a sum over the dim a
move splits leaves a sum pending: a cross-entropy's gradient split over the vocabulary like the
scores, not made whole and sliced). Where a late candidate would spare a move the plan still
makes, a second search runs with them admitted from the start (one round of many-node moves),
and its plan is kept where cheaper (the first's last phase spared where the second's is kept by
far before it: `SECOND_FAR`): under FSDP and CP that one keeps every layer's tokens split
over cp, where the first settles on gathering them for the MLP and splitting its weights over cp,
and moving many nodes at once never undoes that.
Inputs and `with_sharding_constraint` nodes have one candidate; requested output layouts are extra
consumers; an output left to the partitioner only has to end without a pending sum.

Before the search, a candidate reading a pending mean, max, min or product that its input's
producer never makes is left out (`reachable`): it is not chosen while anything else works, and a
4-axis search has a third of the candidates to walk.

What makes it fast enough, without changing a plan (`tests/test_plan_pins.py`): layouts are ints (a
rule-per-axis candidate list comes as its distinct layouts and each candidate's indices into them,
`strategies.Fitted`, numbered once) and a layout change is walked on ints
(`redistribute.coded_steps`), each pair once per process; a node's answer is remembered by
everything it depends on (`best`: an int for what no choice changes, `_kind_of`, with its inputs'
layouts and what their other consumers want), so identical layers are answered once, and so is the
price of a move at a node (`_every_local_cost`); a node's candidates are priced with each input's and output's
terms found once per distinct layout, as float64 columns gathered to every candidate where there are
many (numpy's: the same sums in the same order), leaving out those whose work alone exceeds a cost
found; a walked change is priced once per value size (`_priced_as`), the changes from or to one
layout kept as a row over every layout id that a column gathers from; a value in the same place of another
layer (its class: colour refinement over the graph) is given the many-node move that paid for the
first of its class, and passed over where none paid and it stands as that one did, so a layer's
moves are searched once, not once per layer; every move of a round is measured against the value
costs of where it started, found once until a move is made (`_held_cost`), and a round after the
first walks only the values near what the last changed (`_near_values`); a graph equal to one
planned before gets its plan back (`partition`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import math
import operator
import os
from collections import deque

import numpy as np
import torch
from torch.distributed.tensor import Partial, Replicate

from ndfunc._src.partition.planning import exact, plan_cache, reachable, redistribute
from ndfunc._src.partition.planning.flops import node_flops
from ndfunc._src.partition.planning.layout import MANUAL, Layout, placement_is, replicated
from ndfunc._src.partition.planning.ops import candidates, runs_whole, strategy_key
from ndfunc._src.partition.planning.strategies import (
    Fitted,
    Strategy,
    tensor_inputs,
    tensor_outputs,
    value_of,
)

Value = tuple  # (producing node, output index)
FLOPS_PER_BYTE = 100.0  # floating-point work worth one byte sent (CPU-like; GPUs compute more per byte)
EPS = 1e-6
# rounds of many-node moves in the search with late candidates admitted from the start: its wins
# (a layer's tokens kept split over cp) come from its greedy start; more rounds found no more
SECOND_ROUNDS = 1
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
VECTOR_MIN = 64  # a node with this many candidates has them priced as columns (`_vector_costs`)
PRICED_TOGETHER = 64  # this many new layout changes in a column are walked together (`_tcosts`)
# `NDFUNC_EXACT_VARIABLES=N`: the search's plan is handed to HiGHS (`exact`) where its integer
# program has at most N variables (none by default: the exact optimum by the cost model replicates
# the work of the suite's small models where the search keeps it split, see docs/planning.md),
# given `NDFUNC_EXACT_SECONDS` to prove it
EXACT_SECONDS = 30.0
HUB = 16  # a value with more consumers has what they want counted as the search chooses (`_Choice`)


def finished(layout: Layout) -> Layout:
    """`layout` with pending sums reduced (what a free output becomes)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in layout)


@dataclasses.dataclass
class Plan:
    sizes: tuple[int, ...]
    strategy: dict  # node -> Strategy
    outputs: list  # per graph output leaf: (Value, final layout)
    cost: float
    whole: list = dataclasses.field(default_factory=list)  # nodes that run whole for want of a rule (`ops.runs_whole`)
    bound: float | None = None  # a proven lower bound on any plan's cost (`exact`); None: none sought
    choice: list | None = None  # the candidate taken per node, by the problem's numbering

    def out_layout(self, v: Value) -> Layout:
        return self.strategy[v[0]].outs[v[1]]


_TRANSITIONS: dict = {}  # (src codes, dst codes, sizes) -> `redistribute.coded_steps`, shared by every problem


class Problem:
    """The graph as integers: nodes, values and layouts are indices, so the search hashes ints."""

    def __init__(self, graph: torch.fx.Graph, sizes: tuple[int, ...], input_layouts: list[Layout],
                 output_layouts: list[Layout | None], signatures: dict | None = None):
        """`signatures`: node -> `strategy_key(node)[0]`, where the caller has them (`partition`)."""
        signatures = signatures or {}
        self.sizes = sizes
        self.nodes: list[torch.fx.Node] = []
        self.strategies: list[list[Strategy]] = []
        self.c_ins: list[list[tuple]] = []  # node -> candidate -> layout id per input slot
        self.c_outs: list[list[tuple]] = []  # node -> candidate -> layout id (or None) per output
        self.c_work: list[list[float]] = []  # node -> candidate -> compute cost
        self.min_work: list[float] = []
        self.by_ins: list[dict] = []  # node -> input layouts -> candidates taking them so
        self.inputs: list[list[int]] = []  # node -> value id per input slot
        self.values: list[tuple[int, int]] = []  # value id -> (node id, output index)
        self.value_ids: dict[tuple[int, int], int] = {}
        self.value_meta: list[tuple] = []  # value id -> (shape, itemsize)
        self.priced_as: list[tuple] = []  # value id -> what a layout change's cost reads of it (`_priced_as`)
        self.consumers: list[list[tuple[int, int]]] = []  # value id -> (node id, slot)
        self.final: dict[int, list[int | None]] = {}  # value id -> requested layout ids (None: free)
        self.layouts: list[Layout] = []
        self.layout_ids: dict[Layout, int] = {}
        self._layout_by_id: dict[int, tuple[Layout, int]] = {}  # id(layout) -> (it, its id)
        self.codes: list[tuple[int, ...] | None] = []  # layout id -> redistribute.codes (what costs read)
        self._coded = None  # `_code_table`
        self._sized: dict = {}  # `_priced_as` -> (a << 32 | b) -> the cost of a change from layout a to b
        self._size_costs: list[dict] = []  # value id -> its size's entry of `_sized`
        self._steps: dict = {}  # (a << 32 | b) -> `redistribute.coded_steps` from layout a to b
        self._as_ids: dict = {}  # id(candidate list) -> (the list, c_ins, c_outs, by_ins, work by flops, splits)
        self.cut: list[int] = []  # layout id -> the mesh axes it does not replicate, as bits
        # those bits -> the product of their axes' sizes, for every set of axes
        self._split_of = [math.prod(n for m, n in enumerate(sizes) if mask >> m & 1) for mask in range(1 << len(sizes))]
        self._best: dict = {}  # a node's situation -> its best candidate (see `best`)
        self._every: dict = {}  # a node's situation -> every candidate's cost (`_every_local_cost`)
        self._by_slot: dict = {}  # (id(candidate list), slot) -> (the list, layout -> candidates taking it)
        self._columns: dict = {}  # id(candidate list) -> (the list, its layout ids / work as arrays)
        self._tables: dict = {}  # id(c_ins of a `Fitted`) -> (it, ids of inputs then outputs (-1: none), inputs)
        self._priced_columns: dict = {}  # (value's size, id(layouts), term, layout) -> (layouts, costs)
        self._rows: dict = {}  # (value's size, layout, outward) -> its changes' costs by layout id (`_tcosts`)
        self._taken_by: dict = {}  # value id -> `_taken`
        self.wary = False
        self.relaxed = False  # `_producer_moves`' ranking (the search's last phase)
        self._first_round = True  # of `_improve_together`
        self._classes = None  # `_value_classes`, found once
        self._held: dict = {}  # `_held_cost`
        self._late: list = []  # (node, its work with its late candidates admitted), until `solve` does
        self.pending: list[int] = []  # value id -> the pending reductions it can reach (`reachable.bits`)
        self._sums = reachable.sums(len(sizes))  # (a pending sum always: at the last resort)
        self._pruned = reachable.applies(len(sizes))
        self._pending_made: dict = {}  # id(candidate outputs) -> (them, those bits per output)
        self._kept: dict = {}  # (id(candidate list), its inputs' bits) -> (the list, `reachable.kept`)
        self._bits_of: dict = {}  # id(layout or `Fitted`) -> (it, `reachable.bits` of it or of its layouts)
        node_ids: dict[torch.fx.Node, int] = {}
        placeholders = iter(input_layouts)
        for node in graph.nodes:
            if node.op == "placeholder":
                self._add_node(node, node_ids, [Strategy((next(placeholders),), ())], [], [node.meta["val"]], 0)
            elif node.op == "get_attr" and isinstance(node.meta.get("val"), torch.Tensor):
                # a tensor the step closed over: every rank holds it whole, as a factory's result
                self._add_node(node, node_ids, [Strategy((replicated(len(sizes)),), ())], [], [node.meta["val"]], 0)
            elif node.op == "call_function":
                if node.target is operator.getitem and isinstance(node.args[0].meta.get("val"), (tuple, list)):
                    continue
                ins = [self._value(value_of(a), node_ids) for a in tensor_inputs(node)]
                self._add_node(node, node_ids, self._reachable(candidates(node, sizes, signatures.get(node)), ins),
                               ins, tensor_outputs(node), node_flops(node))
            elif node.op == "output":
                self.output_values = [self._value(value_of(a), node_ids) for a in node.args[0]]
                self.requested = list(output_layouts)
                for v, lay in zip(self.output_values, output_layouts):
                    self.final.setdefault(v, []).append(None if lay is None else self._layout(lay))
        self.finished = {}
        # an output's cost reads its size and the layouts requested of it (`output_cost`)
        kinds: dict = {}
        self._output_kind = {v: kinds.setdefault((self.priced_as[v], tuple(wants)), len(kinds))
                             for v, wants in self.final.items()}
        self._output_costs: dict = {}  # (kind << 32 | layout) -> its cost
        self.repeated = [len(set(ins)) < len(ins) for ins in self.inputs]  # a value in two slots
        self.out_ids = [[self.value_ids.get((n, j)) for j in range(len(self.c_outs[n][0]))]
                        for n in range(len(self.nodes))]
        self._made = [[v for v in ids if v is not None] for ids in self.out_ids]  # `out_values`
        # what consumers with a single candidate want never changes
        self.fixed_wants = [{self.c_ins[m][0][slot] for m, slot in self.consumers[v] if len(self.c_ins[m]) == 1}
                            for v in range(len(self.values))]
        self._kinds: dict = {}  # what a node's situation reads that never changes -> an int
        self._kind: list[int | None] = [None] * len(self.nodes)  # node -> that int (`_kind_of`)
        self._watched: list = [None] * len(self.nodes)  # node -> its values' other consumers (`_situation`)
        # node -> (producer's candidate outputs, producer, output index) per input slot (`_situation`);
        # value -> the same of its producer, and (consumer's candidate inputs, consumer, slot) per
        # consumer (`value_cost`)
        self._made_by = [(self.c_outs[p], p, j) for p, j in self.values]
        self._reads = [[self._made_by[v] for v in ins] for ins in self.inputs]
        self._read_by = [[(self.c_ins[m], m, slot) for m, slot in consumers] for consumers in self.consumers]
        # node -> (value, slot) per input slot reading a value with many consumers (a step count's
        # bias correction, read by every parameter's update): a search counts what they want as it
        # chooses (`_Choice`), so a consumer asks what the others want (`paid`) without reading
        # each of them, and the search stays linear in the number of parameters
        self._hub_slots = [[(v, slot) for slot, v in enumerate(ins) if len(self.consumers[v]) > HUB]
                           for ins in self.inputs]

    def _layout(self, lay: Layout) -> int:
        seen = self._layout_by_id.get(id(lay))  # by identity first: placements hash slowly
        if seen is not None and seen[0] is lay:
            return seen[1]
        i = self.layout_ids.get(lay)
        if i is None:
            i = self.layout_ids[lay] = len(self.layouts)
            self.layouts.append(lay)
            self.codes.append(redistribute.codes(lay))
            self.cut.append((1 << len(self.sizes)) - 1 if lay == MANUAL else
                            sum(1 << m for m, p in enumerate(lay) if not placement_is(p, Replicate)))
        self._layout_by_id[id(lay)] = (lay, i)
        return i

    def _reachable(self, strategies, ins: list[int]):
        """`strategies` less those reading a pending reduction no producer of theirs makes
        (`reachable`), one list per candidate list and inputs' bits: nodes alike in both (identical
        layers, where their inputs are alike) share it. A list of `Strategy`s has its layouts
        numbered first as it would be whole, so every layout keeps its id (ties among equal costs
        are broken by id)."""
        if not self._pruned:
            return strategies
        reads = tuple(self.pending[v] for v in ins)
        key = (id(strategies), reads)
        known = self._kept.get(key)
        if known is None or known[0] is not strategies:
            out = reachable.kept(strategies, reads, self._fitted_bits(strategies) if isinstance(strategies, Fitted)
                                 else self._layout_bits)
            if out is not strategies and not isinstance(strategies, Fitted):
                for st in strategies:
                    for lay in (*st.ins, *st.outs):
                        if lay is not None:
                            self._layout(lay)
            known = self._kept[key] = (strategies, out)
        return known[1]

    def _fitted_bits(self, fitted: Fitted) -> np.ndarray:
        """`reachable.bits` of each of a `Fitted`'s layouts, as an array (once per list)."""
        known = self._bits_of.get(id(fitted))
        if known is None or known[0] is not fitted:
            known = self._bits_of[id(fitted)] = (fitted, np.array([*map(self._layout_bits, fitted.layouts)],
                                                                   dtype=np.int64))
        return known[1]

    def _layout_bits(self, lay: Layout) -> int:
        known = self._bits_of.get(id(lay))
        if known is None or known[0] is not lay:
            known = self._bits_of[id(lay)] = (lay, reachable.bits(redistribute.codes(lay)))
        return known[1]

    def _made_bits(self, c_outs: list) -> list[int]:
        """Per output: the pending reductions some candidate makes it with (`reachable.bits`)."""
        known = self._pending_made.get(id(c_outs))
        if known is None or known[0] is not c_outs:
            made = []
            for j in range(len(c_outs[0])):
                b = 0
                for lay in {outs[j] for outs in c_outs}:
                    if lay is not None:
                        b |= reachable.bits(self.codes[lay])
                made.append(b)
            known = self._pending_made[id(c_outs)] = (c_outs, made)
        return known[1]

    def _value(self, v: Value, node_ids) -> int:
        return self.value_ids[(node_ids[v[0]], v[1])]

    def _add_node(self, node, node_ids, strategies, ins, outs, flops) -> None:
        n = node_ids[node] = len(self.nodes)
        self.nodes.append(node)
        self.strategies.append(strategies)
        # candidates come cached per op signature: identical layers share their lists, and so
        # their layouts as ids
        known = self._as_ids.get(id(strategies))
        if known is None or known[0] is not strategies:
            splits = None
            if isinstance(strategies, Fitted) and len(strategies) >= VECTOR_MIN:  # as int arrays
                lids = [*map(self._layout, strategies.layouts)]  # each layout numbered once
                local_ins, local_outs = strategies.arrays
                local = np.concatenate([local_ins, local_outs], axis=1)  # -1: an output left empty
                table = np.array([*lids, -1], dtype=np.int64)[local]
                k = local_ins.shape[1]
                c_ins = list(map(tuple, table[:, :k].tolist()))
                c_outs = list(map(tuple, table[:, k:].tolist()))
                if (local_outs < 0).any():
                    c_outs = [tuple(None if lay < 0 else lay for lay in outs) for outs in c_outs]
                self._tables[id(c_ins)] = (c_ins, table, k)
                cut = np.array([*(self.cut[i] for i in lids), 0], dtype=np.int64)
                splits = [*map(self._split_of.__getitem__, np.bitwise_or.reduce(cut[local], axis=1).tolist())]
            elif isinstance(strategies, Fitted):  # layouts and indices: each layout numbered once
                number = [*map(self._layout, strategies.layouts), None].__getitem__  # -1: None
                c_ins = [tuple(map(number, row)) for row in strategies.ins]
                c_outs = [tuple(map(number, row)) for row in strategies.outs]
            else:  # candidates that share layout objects: each numbered once, then by identity
                ids: dict = {id(None): None}
                for st in strategies:
                    for lay in (*st.ins, *st.outs):
                        if id(lay) not in ids:
                            ids[id(lay)] = self._layout(lay)
                number = ids.__getitem__
                c_ins = [tuple(map(number, map(id, st.ins))) for st in strategies]
                c_outs = [tuple(map(number, map(id, st.outs))) for st in strategies]
            if splits is None:
                splits = [self._split(ins + tuple(lay for lay in outs if lay is not None))
                          for ins, outs in zip(c_ins, c_outs)]
            by_ins: dict = {}
            for i, layouts in enumerate(c_ins):
                by_ins.setdefault(layouts, []).append(i)
            late = tuple(sorted(strategies.late)) if isinstance(strategies, Fitted) else tuple(
                i for i, st in enumerate(strategies) if st.late)
            known = self._as_ids[id(strategies)] = (strategies, c_ins, c_outs, by_ins, {}, splits, late)
        _, c_ins, c_outs, by_ins, work, splits, late = known
        self.c_ins.append(c_ins)
        self.c_outs.append(c_outs)
        if flops not in work:
            # work on one rank, in bytes-worth: divided over each mesh axis the strategy splits
            # or leaves partial, whole on axes where all its values are replicated
            work[flops] = [flops / split / FLOPS_PER_BYTE for split in splits] if flops else [0.0] * len(splits)
            work[flops, "least"] = min(work[flops])
            if late:  # and, until `solve` admits them, late candidates out of reach
                work[flops, "late"] = [math.inf if i in late else w for i, w in enumerate(work[flops])]
                work[flops, "late", "least"] = min(work[flops, "late"])
        if late:
            self._late.append((n, work[flops]))
        self.c_work.append(work[flops, "late"] if late else work[flops])
        self.min_work.append(work[flops, "late", "least"] if late else work[flops, "least"])
        self.by_ins.append(by_ins)
        self.inputs.append(ins)
        for slot, v in enumerate(ins):
            self.consumers[v].append((n, slot))
        made = self._made_bits(c_outs)
        for j, t in enumerate(outs):
            if t is not None:
                v = self.value_ids[(n, j)] = len(self.values)
                self.values.append((n, j))
                self.pending.append(made[j] | self._sums)
                meta = (tuple(t.shape), t.element_size())
                self.value_meta.append(meta)
                self.priced_as.append(_priced_as(*meta))
                self._size_costs.append(self._sized.setdefault(self.priced_as[-1], {}))
                self.consumers.append([])

    def _split(self, layouts: tuple[int, ...]) -> int:
        """Into how many parts a strategy reading and making `layouts` (ids) divides its work: the
        product of the mesh axes on which any of them is split or partial (or manual)."""
        mask = 0
        for lay in layouts:
            mask |= self.cut[lay]
        return self._split_of[mask]

    # --- costs ---------------------------------------------------------------------------------
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
            full = (self.codes[key >> 32], self.codes[key & 0xFFFFFFFF], self.sizes)
            steps = _TRANSITIONS.get(full)
            if steps is None:
                steps = _TRANSITIONS[full] = redistribute.coded_steps(*full)
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

    def _vector_costs(self, n: int, choice: list, forward: bool) -> np.ndarray:
        """`local_costs` of every candidate of `n` as float64 columns (numpy's, whatever mode the
        step is lowered in): the work, then each input's terms, then each output's, added in
        `local_cost`'s order (a missing term adds 0.0, which changes no sum), so each total is the
        same float."""
        columns = self._term_columns(n)
        total = self._work_column(n).copy()
        for slot, v in enumerate(self.inputs[n]):
            p, j = self.values[v]
            if choice[p] >= 0:
                lays, which = columns[0][slot]
                have = self.c_outs[p][choice[p]][j]
                paid = () if forward else self.paid(v, choice, n)
                total += self._from_column(v, have, lays, paid)[which]
                if self.wary:  # and what undoing it would cost
                    total += self._back_column(v, have, lays, paid)[which]
        for j, v in enumerate(self.out_ids[n]):
            if v is None:
                continue
            lays, which = columns[1][j]
            for want in (self.fixed_wants[v] if forward else self.demands(v, choice)):
                total += self._to_column(v, want, lays)[which]
            if v in self.final:
                total += self._output_column(v, lays)[which]
        return total

    def _output_column(self, v: int, lays: "_Lays") -> np.ndarray:
        """`output_cost(v, lay)` for each of `lays` (0.0 for -1, no tensor), found once per what it
        reads of the value (`_output_kind`)."""
        key = (self._output_kind[v], id(lays), "output")
        known = self._priced_columns.get(key)
        if known is None or known[0] is not lays:
            column = np.array([0.0 if lay < 0 else self.output_cost(v, lay) for lay in lays.ids])
            known = self._priced_columns[key] = (lays, column)
        return known[1]

    def _term_columns(self, n: int) -> tuple[list, list]:
        """Per input slot and per output of `n`'s candidates: the distinct layout ids there (-1: no
        tensor, `_Lays`), and each candidate's index into them; shared by nodes that share a
        candidate list. A term is then priced once per distinct layout and gathered."""
        c_ins = self.c_ins[n]
        known = self._columns.get(id(c_ins))
        if known is None or known[0] is not c_ins:
            def split(table) -> list:
                out = []
                for k in range(table.shape[1]):
                    lays, which = np.unique(table[:, k], return_inverse=True)
                    out.append((_Lays(lays), which.reshape(-1)))
                return out
            made = self._tables.get(id(c_ins))
            if made is not None and made[0] is c_ins:
                _, table, k = made
            else:
                outs = [[-1 if lay is None else lay for lay in o] for o in self.c_outs[n]]
                k = len(c_ins[0])
                table = np.concatenate([np.array(c_ins, dtype=np.int64).reshape(len(c_ins), k),
                                        np.array(outs, dtype=np.int64).reshape(len(outs), len(outs[0]))], axis=1)
            known = self._columns[id(c_ins)] = (c_ins, (split(table[:, :k]), split(table[:, k:])))
        return known[1]

    def _from_column(self, v: int, have: int, lays: "_Lays", paid) -> np.ndarray:
        """What `local_cost` adds for input `v`, made in `have`, wanted in each of `lays` (0 where
        another consumer already pays for that layout)."""
        return self._unpaid(self._priced(v, lays, "from", have), lays, paid)

    def _back_column(self, v: int, have: int, lays: "_Lays", paid) -> np.ndarray:
        """The wary search's second input term: undoing each of `lays` back to `have` finished
        (nothing where it is `have`)."""
        return self._unpaid(self._priced(v, lays, "back", have), lays, {*paid, have})

    def _to_column(self, v: int, want: int, lays: "_Lays") -> np.ndarray:
        """Each of `lays` changed to `want`."""
        return self._priced(v, lays, "to", want)

    def _priced(self, v: int, lays: "_Lays", term: str, lay: int) -> np.ndarray:
        """Layout changes of value `v` between `lay` and each of `lays` (0 for -1, no tensor), as a
        float64 column of `tcost`'s floats: "from" `lay` to each, each "to" `lay`, or each "back"
        to `lay` finished. Remembered by what the cost reads of the value (`_priced_as`), so equal
        values share it."""
        key = (self.priced_as[v], id(lays), term, lay)
        known = self._priced_columns.get(key)
        if known is None or known[0] is not lays:
            if term == "from":
                costs = self._tcosts(v, lay, lays, outward=True)
            else:
                costs = self._tcosts(v, lay if term == "to" else self.finish(lay), lays, outward=False)
            known = self._priced_columns[key] = (lays, costs)
        return known[1]

    def _tcosts(self, v: int, lay: int, lays: "_Lays", outward: bool) -> np.ndarray:
        """`tcost(v, lay, x)` (`outward`) or `tcost(v, x, lay)` for each `x` of `lays`, 0.0 for -1 (no
        tensor), as a column. The changes from (or to) `lay` found for a value size are kept as a
        row over every layout id (NaN: not yet priced), read by gathering; the new ones are
        walked together (`redistribute.priced_pairs`: the same floats as `tcost`'s), or one by one
        where a layout has no codes."""
        key = (self.priced_as[v], lay, outward)
        row = self._rows.get(key)
        ids = lays.ids
        if row is None or len(row) <= ids[-1]:
            grown = np.full(max(len(self.layouts), 2 * ids[-1] + 1), np.nan)
            if row is not None:
                grown[:len(row)] = row
            row = self._rows[key] = grown
        found = row[lays.index]
        new = np.flatnonzero(np.isnan(found) & lays.real)
        if len(new):
            xs = lays.index[new]
            numel, itemsize = self.priced_as[v]
            coded, known = self._code_table() if len(new) >= PRICED_TOGETHER else (None, None)
            if known is not None and known[lay] and known[xs].all():
                one, others = coded[lay:lay + 1], coded[xs]
                priced = redistribute.priced_pairs(*((one, others) if outward else (others, one)), self.sizes, numel,
                                                   itemsize)
            else:
                priced = np.array([self.tcost(v, lay, x) if outward else self.tcost(v, x, lay) for x in xs.tolist()])
            row[xs] = found[new] = priced
        found[~lays.real | (lays.index == lay)] = 0.0
        return found

    def _code_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Every layout's codes as rows of an int array, and whether it has codes (a manual one has
        none), kept as layouts are numbered."""
        table = self._coded
        if table is None or len(table[0]) < len(self.layouts):
            width = len(self.sizes)
            rows = [(-1,) * width if c is None else c for c in self.codes]
            table = self._coded = (np.array(rows, dtype=np.int64).reshape(len(rows), width),
                                   np.array([c is not None for c in self.codes]))
        return table

    @staticmethod
    def _unpaid(column: np.ndarray, lays: "_Lays", paid) -> np.ndarray:
        hits = [k for lay in paid if (k := lays.position.get(lay)) is not None] if paid else ()
        if not hits:
            return column
        column = column.copy()
        column[hits] = 0.0
        return column

    def _work_column(self, n: int) -> np.ndarray:
        work = self.c_work[n]
        known = self._columns.get(id(work))
        if known is None or known[0] is not work:
            known = self._columns[id(work)] = (work, np.array(work, dtype=np.float64))
        return known[1]

    def _input_terms(self, v: int, have: int, n: int, choice: list, forward: bool):
        """want -> what `local_cost` adds for input `v` (made in `have`) wanted as `want` by `n`."""
        paid = () if forward else self.paid(v, choice, n)
        memo: dict = {}

        def terms(want: int) -> tuple:
            t = memo.get(want)
            if t is None:
                if want in paid or want == have:
                    t = ()
                elif self.wary:
                    t = (self.tcost(v, have, want), self.tcost(v, want, self.finish(have)))
                else:
                    t = (self.tcost(v, have, want),)
                memo[want] = t
            return t
        return terms

    def _output_terms(self, v: int, choice: list, forward: bool):
        """layout -> what `local_cost` adds for output `v` made in it."""
        wants = self.fixed_wants[v] if forward else self.demands(v, choice)
        final = v in self.final
        memo: dict = {}

        def terms(lay: int) -> tuple:
            t = memo.get(lay)
            if t is None:
                t = tuple(self.tcost(v, lay, want) for want in wants if want != lay)
                if final:
                    t += (self.output_cost(v, lay),)
                memo[lay] = t
            return t
        return terms

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

    def total(self, choice: list) -> float:
        c_work, value_cost = self.c_work, self.value_cost
        return sum([c_work[n][i] for n, i in enumerate(choice)]) + sum(
            [value_cost(v, choice) for v in range(len(self.values))])

    # --- search --------------------------------------------------------------------------------
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
        # the last phase only lowers a total: on the plan kept
        return self.plan(first if second is None else self._relax(second))

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
        return choice

    def _improve_together(self, choice: list, rounds: int = 8, near: set | None = None) -> None:
        """Where data still moves, try moves of many nodes at once. (Adam reads a gradient in four
        places: reduce-scattering it instead of all-reducing it pays only if all four change
        together, and what they feed.) After the first round, only around what the last changed.

        Identical layers pose the same question once per layer: a value in the same place as one
        met before in the round (its class, `_value_classes`) is first given the move that paid
        there, one settle instead of a dozen, and kept if it pays here too; where no move paid and
        the value stands as that one did (`_around`), it is passed over. Anything else is searched
        afresh. `near`: only around these nodes, from the first round."""
        if self._classes is None:
            self._classes = self._value_classes()
        classes = self._classes
        changed: set | None = near
        for r in range(rounds):
            self._first_round = r == 0
            touched: set = set()
            self._held = {}  # value -> its cost in `choice` as it stands (`_held_cost`)
            sources_tried: set = set()  # a pending sum feeds several reductions: its producer is tried once
            first_of: dict = {}  # class -> (its first value's surroundings, or the move that paid there)
            for v in range(len(self.values)) if changed is None else self._near_values(changed):
                cost = self._held_cost(v, choice)
                if cost <= 0:
                    continue
                first = first_of.get(classes[v])
                if first is not None:
                    around, move = first
                    if move is None and around == self._around(v, choice, cost):
                        continue
                    if move is not None:
                        delta, changes = self._replay(move, v, choice)
                        if changes is not None and delta < -EPS:
                            self._apply(changes, choice, touched)
                            continue
                delta, changes, move = self._best_move(v, choice, cost, sources_tried)
                pays = changes is not None and delta < -EPS
                if first is None:
                    first_of[classes[v]] = (None, move) if pays else (self._around(v, choice, cost), None)
                if pays:
                    self._apply(changes, choice, touched)
            if not touched:
                return
            changed = touched

    def _apply(self, changes: dict, choice: list, touched: set) -> None:
        for n, i in changes.items():
            choice[n] = i
        touched.update(changes)
        self._held = {}

    def _held_cost(self, v: int, choice: list) -> float:
        """`value_cost(v, choice)` of the choice the moves start from, remembered until one is made:
        every move tried is measured against it (`_settle`)."""
        c = self._held.get(v)
        if c is None:
            c = self._held[v] = self.value_cost(v, choice)
        return c

    def _best_move(self, v: int, choice: list, cost: float, sources_tried: set) -> tuple:
        """The move of many nodes that lowers the total most for value `v`, moved at `cost`:
        (delta, the new choices or None, how to make it again: `_replay`)."""
        if self.relaxed and self._first_round:  # the last phase: first only the producer moves it
            # admits (`_relaxed`), then around what they changed every kind
            moves = [(*move, ("producer", -1, made)) for move, made in self._producer_moves(v, choice, below=cost)]
            return min(moves, key=lambda m: m[0], default=(0.0, None, None))
        moves = [(*self._redirect(v, lay, choice), ("redirect", -1, lay)) for lay in self._layouts_for(v, choice)]
        moves += [(*move, ("producer", -1, made)) for move, made in self._producer_moves(v, choice, below=cost)]
        for k, u in enumerate(self._pending_sources(v, choice)):
            lay = self.finish(self.out_layout(u, choice))
            moves.append((*self._redirect(u, lay, choice), ("redirect", k, lay)))
            # or make the sum pending no more: moving something smaller than v instead
            if u not in sources_tried and self._reads_less_than(u, v):
                sources_tried.add(u)
                moves += [(*move, ("producer", k, made)) for move, made in self._producer_moves(u, choice)]
        return min(moves, key=lambda m: m[0], default=(0.0, None, None))  # in order: the first least

    def _replay(self, move: tuple, v: int, choice: list) -> tuple[float, dict | None]:
        """The move `_best_move` found for a value of `v`'s class, made for `v`: the same kind,
        on the value in the same place (`v`, or its k-th pending source), to the same layout."""
        kind, k, lay = move
        if k >= 0:
            sources = self._pending_sources(v, choice)
            if k >= len(sources):
                return 0.0, None
            v = sources[k]
        if kind == "redirect":
            return self._redirect(v, lay, choice)
        n, j = self.values[v]
        i = self._by_out_layout(n, j, choice).get(lay) if len(self.c_ins[n]) > 1 else None
        return (0.0, None) if i is None else self._produce(n, i, choice)

    def _around(self, v: int, choice: list, cost: float) -> tuple:
        """What a value's moves see first: its cost, the choices of its producer, of the producer's
        inputs' producers and of its consumers, and the costs of the producer's inputs (two values
        of a class have these in the same order)."""
        n = self.values[v][0]
        near = [n, *(self.values[u][0] for u in self.inputs[n]), *(m for m, _ in self.consumers[v])]
        return cost, tuple(choice[m] for m in near), tuple(self._held_cost(u, choice) for u in self.inputs[n])

    def _value_classes(self, rounds: int = 6) -> list:
        """Per value: a class shared by values whose surroundings, `rounds` ops out, are the same
        (candidate lists, work, shapes, requested layouts, and how they connect): the same value
        in identical layers, away from where the layers differ. Colour refinement (Weisfeiler-
        Lehman) over the graph's nodes, a few rounds."""
        color = []
        codes: dict = {}
        for n in range(len(self.nodes)):
            c_ins = self.c_ins[n]
            what = (id(c_ins), id(self.c_work[n])) if len(c_ins) > 1 else (c_ins[0], self.c_outs[n][0], self.c_work[n][0])
            outs = tuple(None if v is None else (self.value_meta[v], tuple(self.final.get(v, ())))
                         for v in self.out_ids[n])
            color.append(codes.setdefault((what, outs), len(codes)))
        # Each round a node's colour is its own and its neighbours' before: the nodes it reads
        # (producer, output index) and those reading it (consumer, slot) per output. What never
        # changes (the output indices, the slots, how many read each output) is one int per node,
        # `wiring`, and the neighbours' colours one tuple, read by `itemgetter`: a round is a few
        # C calls per node, and the classes are those of keys holding each (colour, index) pair.
        wiring_codes: dict = {}
        wiring, neighbours = [], []
        for n, ins in enumerate(self.inputs):
            reads = [self.values[u] for u in ins]
            read_by = [None if v is None else self.consumers[v] for v in self.out_ids[n]]
            wiring.append(wiring_codes.setdefault(
                (tuple(j for _, j in reads), tuple(None if by is None else tuple(s for _, s in by) for by in read_by)),
                len(wiring_codes)))
            ids = [p for p, _ in reads] + [m for by in read_by if by is not None for m, _ in by]
            neighbours.append(operator.itemgetter(*ids) if len(ids) > 1 else
                              (lambda c, m=ids[0]: (c[m],)) if ids else (lambda c: ()))
        for _ in range(rounds):
            codes = {}
            color = [codes.setdefault((c, w, get(color)), len(codes)) for c, w, get in zip(color, wiring, neighbours)]
        return [(color[n], j) for n, j in self.values]

    def _bytes(self, v: int) -> int:
        shape, itemsize = self.value_meta[v]
        return math.prod(shape) * itemsize

    def _reads_less_than(self, u: int, v: int) -> bool:
        """Whether the op making `u` reads a value smaller than `v` (a head's weight, next to its
        logits): only then can changing it spare `v`'s reduction for less."""
        return any(self._bytes(w) < self._bytes(v) for w in self.inputs[self.values[u][0]])

    def _pending_sources(self, v: int, choice: list, depth: int = 3) -> list[int]:
        """Values upstream of `v` that carry the same pending sum (a few ops back): reducing
        there once may spare several reductions after. (RMSNorm's backward splits a partial
        gradient into two terms, each reduced; reducing the gradient before the split takes one.)"""
        found, frontier = [], [v]
        for _ in range(depth):
            step = []
            for w in frontier:
                for u in self.inputs[self.values[w][0]]:
                    lay = self.out_layout(u, choice)
                    if lay is not None and lay != self.finish(lay) and u not in found:
                        found.append(u)
                        step.append(u)
            frontier = step
        return found

    def _near_values(self, changed: set) -> list[int]:
        """The values, in order, made or read by a node of `changed`, or made by a node reading
        what one of them made."""
        near = set()
        for n in changed:
            near.update(self._made[n])
            near.update(self.inputs[n])
            for u in self._made[n]:
                for m, _ in self.consumers[u]:
                    near.update(self._made[m])
        return sorted(near)

    def _layouts_for(self, v: int, choice: list) -> list[int]:
        """The layouts, other than those wanted now, that some consumer of `v` could take it in
        and that are cheapest to reach (a few per mesh axis: dearer ones rarely pay)."""
        lays = self._taken(v)
        if not lays.ids:
            return []
        have = self.out_layout(v, choice)
        costs = self._tcosts(v, have, lays, outward=True)
        demands = self.demands(v, choice)
        order = np.argsort(costs, kind="stable")  # by cost, then layout: the ids are sorted
        found = []
        for k in order.tolist():
            if lays.ids[k] not in demands:
                found.append(lays.ids[k])
                if len(found) == len(self.sizes) + 2:
                    break
        return found

    def _taken(self, v: int) -> "_Lays":
        """The layouts some consumer of `v` with a choice could take it in (`_Lays`)."""
        known = self._taken_by.get(v)
        if known is None:
            lays = set()
            for m, slot in self.consumers[v]:
                if len(self.c_ins[m]) > 1:
                    lays.update(self._taking(m, slot))
            known = self._taken_by[v] = _Lays(np.array(sorted(lays), dtype=np.int64))
        return known

    def _redirect(self, v: int, lay: int, choice: list) -> tuple[float, dict | None]:
        old: dict = {}
        for m, slot in self.consumers[v]:
            if len(self.c_ins[m]) == 1 or self.c_ins[m][choice[m]][slot] == lay:
                continue
            options = self._taking(m, slot).get(lay)
            if not options:
                continue
            old.setdefault(m, choice[m])
            costs = self._every_local_cost(m, choice)
            choice[m] = min(options, key=costs.__getitem__)
        if not old:
            return 0.0, None
        return self._settle(old, choice)

    def _taking(self, m: int, slot: int) -> dict[int, list[int]]:
        """Layout -> the candidates of node `m` that take input `slot` in it, in order (shared by
        nodes that share a candidate list)."""
        c_ins = self.c_ins[m]
        known = self._by_slot.get((id(c_ins), slot))
        if known is None or known[0] is not c_ins:
            by_layout: dict[int, list[int]] = {}
            for i, ins in enumerate(c_ins):
                by_layout.setdefault(ins[slot], []).append(i)
            known = self._by_slot[(id(c_ins), slot)] = (c_ins, by_layout)
        return known[1]

    def _producer_moves(self, v: int, choice: list, below: float | None = None) -> list:
        """Change the producer of `v` to make it in another layout (the best candidate per layout):
        [((delta, new choices), layout)]; `below`: only layouts from which its consumers (and a
        requested result layout) are reached for less than that (`_reach`). In the search's last
        phase, ranked as `_reach` relaxes it, among equals as the first ranking would; in that
        phase's first round, only the layouts this admits that the first ranking did not (the
        others were tried before)."""
        n, j = self.values[v]
        if len(self.c_ins[n]) == 1:
            return []
        by_layout = self._by_out_layout(n, j, choice)
        if not by_layout:
            return []
        lays = _Lays(np.array(sorted(by_layout), dtype=np.int64))
        reach, relaxed = self._reach(v, lays, self.demands(v, choice), choice)
        if self.relaxed:
            ranked, order = relaxed, np.lexsort((lays.index, reach, relaxed))
            if self._first_round and below is not None:
                order = order[reach[order] >= below]
        else:
            ranked, order = reach, np.lexsort((lays.index, reach))
        moves = []
        for k in order[:len(self.sizes) + 2].tolist():
            if below is not None and ranked[k] >= below:
                break
            lay = lays.ids[k]
            moves.append((self._produce(n, by_layout[lay], choice), lay))
        return moves

    def _reach(self, v: int, lays: "_Lays", demands: set, choice: list) -> tuple[np.ndarray, np.ndarray | None]:
        """For each of `lays`: what reaching `demands` from it costs, those it cannot reach left
        out (and those reaching them only by a last resort), plus a requested result layout's, as a
        column (`_producer_moves`' ranking). A consumer
        taking a pending sum cannot take another layout's value as it is, but is chosen again after
        the move (`_settle`): such demands rank nothing out. In the search's last phase (`relaxed`),
        also the same sums with a demand left out where its consumer has a candidate taking the
        layout as it is (a sum over the dim the move splits, which then leaves a sum pending: a
        cross-entropy's gradient split over the vocabulary like the scores, not made whole on every
        rank and sliced); else None. Each term added in the demands' order: `tcost`'s sums."""
        reach = np.zeros(len(lays.ids))
        relaxed = np.zeros(len(lays.ids)) if self.relaxed else None
        if relaxed is not None:
            takers = [(self.c_ins[m][choice[m]][slot], self._taking(m, slot)) for m, slot in self.consumers[v]
                      if len(self.c_ins[m]) > 1]
        for w in demands:
            costs = self._tcosts(v, w, lays, outward=False)
            counted = costs < redistribute.LAST_RESORT  # (a pending sum made of a whole value: as none)
            reach += np.where(counted, costs, 0.0)
            if relaxed is not None:
                for want, taking in takers:
                    if want == w:
                        counted[[k for lay in taking if (k := lays.position.get(lay)) is not None]] = False
                relaxed += np.where(counted, costs, 0.0)
        if v in self.final:
            out = np.array([self.output_cost(v, lay) for lay in lays.ids])
            reach += out
            if relaxed is not None:
                relaxed += out
        return reach, relaxed

    def _by_out_layout(self, n: int, j: int, choice: list) -> dict[int, int]:
        """Layout -> the candidate of `n` making its output `j` so at the least local cost (other
        than the layout made now)."""
        by_layout: dict[int, int] = {}
        current = self.c_outs[n][choice[n]][j]
        costs = self._every_local_cost(n, choice)
        if len(costs) >= VECTOR_MIN and not self.repeated[n]:  # as columns: by layout, cost, then order
            lays, which = self._term_columns(n)[1][j]
            ids = np.array(lays.ids)[which]
            keep = np.flatnonzero((ids >= 0) & (ids != (-1 if current is None else current)))
            if len(keep):
                order = keep[np.lexsort((keep, np.asarray(costs)[keep], which[keep]))]
                firsts = order[np.concatenate(([True], which[order[1:]] != which[order[:-1]]))]
                by_layout = dict(zip(ids[firsts].tolist(), firsts.tolist()))
            return by_layout
        for i, outs in enumerate(self.c_outs[n]):
            if outs[j] is None or outs[j] == current:
                continue
            if outs[j] not in by_layout or costs[i] < costs[by_layout[outs[j]]]:
                by_layout[outs[j]] = i
        return by_layout

    def _produce(self, n: int, i: int, choice: list) -> tuple[float, dict]:
        """Node `n` changed to candidate `i`, and what follows (`_settle`)."""
        old = {n: choice[n]}
        choice[n] = i
        # an input made for this node alone is made in the layout it now reads (a sharded
        # parameter's initializer: the random block, then its scale, both split)
        for u in self.inputs[n]:
            p = self.values[u][0]
            if len(self.consumers[u]) == 1 and len(self.c_ins[p]) > 1 and p not in old:
                b = self.best(p, choice)
                if b != choice[p]:
                    old[p] = choice[p]
                    choice[p] = b
        return self._settle(old, choice)

    def _settle(self, old: dict, choice: list, limit: int = 64) -> tuple[float, dict]:
        """Choose again what lies downstream of the nodes in `old` (already changed in `choice`),
        measure the change in total cost, restore `choice`; return (delta, the new choices)."""
        heap = [m for n in list(old) for v in self.out_values(n) for m, _ in self.consumers[v]]
        heapq.heapify(heap)
        seen = set(old)
        while heap and len(old) < limit:
            m = heapq.heappop(heap)
            if m in seen or len(self.c_ins[m]) == 1:
                continue
            seen.add(m)
            b = self.best(m, choice, forward=True)
            if b != choice[m]:
                old.setdefault(m, choice[m])
                choice[m] = b
                for v in self.out_values(m):
                    for m2, _ in self.consumers[v]:
                        heapq.heappush(heap, m2)
        values = set()
        for m in old:
            values.update(self.inputs[m])
            values.update(self.out_values(m))
        after = sum(self.value_cost(v, choice) for v in values) + sum(self.c_work[m][choice[m]] for m in old)
        new = {m: choice[m] for m in old}
        for m, i in old.items():
            choice[m] = i
        before = sum(self._held_cost(v, choice) for v in values) + sum(self.c_work[m][choice[m]] for m in old)
        return after - before, new


class _Choice(list):
    """A search's choice of candidate per node (-1: none yet), counting for each value with many
    consumers (`Problem._hub_slots`) how many of their slots want each layout, as it changes."""

    __slots__ = ("_problem", "wants")

    def __init__(self, problem: Problem, n: int):
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


class _Lays:
    """The distinct layout ids of one column of candidates (-1: no tensor), sorted: as a tuple
    (`ids`), and as an index array with the no-tensor entries pointing at id 0 (`index`, `real`);
    each id's place among them (`position`, made when first read)."""

    def __init__(self, lays: np.ndarray):
        self.ids = tuple(lays.tolist())
        self.real = lays >= 0
        self.index = np.where(self.real, lays, 0)

    @functools.cached_property
    def position(self) -> dict[int, int]:
        return {lay: k for k, lay in enumerate(self.ids)}


def _priced_as(shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """What `redistribute.priced` reads of a value: every layout the search prices fits the
    value (`ops.candidates` keeps only those, and finishing a sum keeps the fit), so each block on
    the way is the whole divided exactly by the splits then in place, and the cost reads the shape
    only as its element count (a layout id's codes name the dims it splits, whatever the value's
    rank): the same floats, found once for a value, its transposes and its views (a flatten of
    (batch, sequence) to tokens, and back)."""
    return (math.prod(shape), itemsize)


def partition(graph: torch.fx.Graph, sizes: tuple[int, ...], input_layouts: list[Layout],
              output_layouts: list[Layout | None]) -> Plan:
    """Pick a strategy for every node; outputs end in `output_layouts` (None: the partitioner's
    choice, without pending sums).

    The search is a pure function of what `Problem` reads (each node's op, arguments, shapes,
    marks and inputs, the sizes, the boundary layouts), so a graph equal to one planned before in
    all of that gets that plan again, node by node, without a search: a step jitted afresh on the
    same model and mesh (a notebook's re-run, a test suite) plans once; with
    `NDFUNC_PLAN_CACHE_DIR` set, once across processes too (`plan_cache`)."""
    nodes, key, signatures = _problem_key(graph, sizes, input_layouts, output_layouts)
    known = _PLANS.get(key)
    if known is None:
        kept = plan_cache.entry(key)
        known = plan_cache.load(kept, len(nodes))  # a plan another process made (NDFUNC_PLAN_CACHE_DIR)
        if known is None:
            plan = _planned(Problem(graph, sizes, input_layouts, output_layouts, signatures))
            at = {n: i for i, n in enumerate(nodes)}
            # which nodes run whole is kept with the plan: a plan read back asks for no candidates
            whole = [i for i, n in enumerate(nodes) if runs_whole(n, sizes, signatures.get(n))]
            known = ([plan.strategy.get(n) for n in nodes], [(at[v[0]], v[1], lay) for v, lay in plan.outputs],
                     plan.cost, whole, plan.bound)
            plan_cache.store(kept, known)
        _PLANS[key] = known
        while len(_PLANS) > 64:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(key)
    strategies, outputs, cost, whole, bound = known
    return Plan(sizes, {n: s for n, s in zip(nodes, strategies) if s is not None},
                [((nodes[i], j), lay) for i, j, lay in outputs], cost, [nodes[i] for i in whole], bound)


def exact_settings() -> tuple[int, float]:
    """(`NDFUNC_EXACT_VARIABLES`, `NDFUNC_EXACT_SECONDS`): the largest integer program HiGHS is
    given (0: none) and how long it may take."""
    raw = os.environ.get("NDFUNC_EXACT_VARIABLES", "0"), os.environ.get("NDFUNC_EXACT_SECONDS", str(EXACT_SECONDS))
    try:
        return int(raw[0]), float(raw[1])
    except ValueError:
        raise ValueError(f"NDFUNC_EXACT_VARIABLES={raw[0]!r} and NDFUNC_EXACT_SECONDS={raw[1]!r} must be an "
                         "integer and a number of seconds, as NDFUNC_EXACT_VARIABLES=200000 NDFUNC_EXACT_SECONDS=60; "
                         "unset them for the search alone") from None


def _planned(problem: Problem) -> Plan:
    """The search's plan; where the problem is small enough (`EXACT_VARIABLES`), HiGHS's from it,
    proven optimal or with the bound it reached in `EXACT_SECONDS`, kept where cheaper."""
    plan = problem.solve()
    limit, seconds = exact_settings()
    if not limit or exact.size(problem) > limit:
        return plan
    found = exact.solve(problem, time_limit=seconds, start=plan.choice)
    if found.choice is not None and found.cost < plan.cost:
        return problem.plan(found.choice, bound=found.bound)
    return dataclasses.replace(plan, bound=found.bound)


_PLANS: collections.OrderedDict = collections.OrderedDict()  # problem key -> plan by node position


def _problem_key(graph: torch.fx.Graph, sizes, input_layouts, output_layouts) -> tuple[list, tuple, dict]:
    """The graph's nodes, a key equal for two problems the search cannot tell apart, and each
    op's signature as the key read it (node -> `strategy_key(node)[0]`: the candidates' and
    `runs_whole`'s, read once)."""
    nodes = list(graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    entries = []
    signatures = {}
    for node in nodes:
        val = node.meta.get("val")
        if node.op == "call_function":
            ins = tuple((at[p], j) for p, j in map(value_of, tensor_inputs(node)))
            outs = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensor_outputs(node))
            key = strategy_key(node)
            signatures[node] = key[0]
            entries.append((key, ins, outs))
        elif node.op == "output":
            entries.append(("output", tuple((at[p], j) for p, j in map(value_of, node.args[0]))))
        else:
            entries.append((node.op, (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None))
    return nodes, _Key((tuple(sizes), tuple(input_layouts), tuple(output_layouts), tuple(entries),
                        exact_settings())), signatures


class _Key(tuple):
    """A problem's key, its hash found once: a program's key holds an entry per node, and the plans
    remembered (`_PLANS`) hash it three times a lowering. (A tuple still: equal to, and written as,
    the tuple it holds.)"""

    def __hash__(self) -> int:
        known = self.__dict__.get("hash")
        if known is None:
            known = self.__dict__["hash"] = tuple.__hash__(self)
        return known
