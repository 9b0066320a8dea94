"""A traced step's partitioning problem as integers: nodes, values and layouts numbered, each
node's candidates as layout ids per input and output and their work, each value's consumers. What
the costs (`costs`), the search (`search`) and the exact solver (`exact`) read."""

from __future__ import annotations

import math
import operator

import numpy as np
import torch
from torch.distributed.tensor import Replicate

from ndfunc._src import graph_edits
from ndfunc._src.partition.planning import reachable, redistribute
from ndfunc._src.partition.planning.flops import node_flops
from ndfunc._src.partition.planning.layout import MANUAL, Layout, placement_is, replicated
from ndfunc._src.partition.planning.ops import candidates
from ndfunc._src.partition.planning.strategies import (
    Fitted,
    Strategy,
    tensor_inputs,
    tensor_outputs,
    value_of,
)

Value = tuple  # (producing node, output index)

VECTOR_MIN = 64  # a node with this many candidates has them priced as columns (`_vector_costs`)

HUB = 16  # a value with more consumers has what they want counted as the search chooses (`_Choice`)


class Arrays:
    """The graph as integers: nodes, values and layouts are indices, so the search hashes ints."""

    def __init__(self, graph: torch.fx.Graph, sizes: tuple[int, ...], input_layouts: list[Layout],
                 output_layouts: list[Layout | None], signatures: dict | None = None,
                 prices: redistribute.Prices | None = None):
        """`signatures`: node -> `strategy_key(node)[0]`, where the caller has them (`partition`).
        `prices`: what a collective over each axis and a flop cost (`redistribute.host_prices`
        unless given: this machine's)."""
        signatures = signatures or {}
        self.sizes = sizes
        self.prices = prices or redistribute.host_prices(tuple(sizes))
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
        self._transitions = None  # `costs._TRANSITIONS`' table for these prices
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
        self.widened = False  # `_layouts_for`: more layouts per value (the search's very last moves)
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
                found = self._reachable(candidates(node, sizes, signatures.get(node)), ins)
                if (held := self._written_argument(node, node_ids)) is not None:
                    found = [st for st in found if st.ins[0] == held] or found
                self._add_node(node, node_ids, found, ins, tensor_outputs(node), node_flops(node))
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

    def _written_argument(self, node: torch.fx.Node, node_ids: dict) -> Layout | None:
        """The layout of the argument `node` writes into in place (a BatchNorm's running
        statistics), where it writes into one: it reads it as it is laid out, so the write is the
        caller's (a write into a moved copy would be lost: lowering refuses it)."""
        base = node.args[0] if node.args else None
        if isinstance(base, torch.fx.Node) and base.op == "placeholder" and graph_edits.writes_into(node, base):
            return self.strategies[node_ids[base]][0].outs[0]
        return None

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
            # work on one rank, in the cost's unit (`Prices.flops`): divided over each mesh axis the
            # strategy splits or leaves partial, whole on axes where all its values are replicated
            rate = self.prices.flops
            work[flops] = [flops / split / rate for split in splits] if flops else [0.0] * len(splits)
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


def _priced_as(shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """What `redistribute.priced` reads of a value: every layout the search prices fits the
    value (`ops.candidates` keeps only those, and finishing a sum keeps the fit), so each block on
    the way is the whole divided exactly by the splits then in place, and the cost reads the shape
    only as its element count (a layout id's codes name the dims it splits, whatever the value's
    rank): the same floats, found once for a value, its transposes and its views (a flatten of
    (batch, sequence) to tokens, and back)."""
    return (math.prod(shape), itemsize)
