"""Moves of many nodes at once, where data still moves: a value given another layout for all its
consumers, or its producer changed, and everything downstream chosen again (`move_kinds`), kept
where the total falls. Identical layers are searched once: a value in the same place of another
layer (its class, by colour refinement) is first given the move that paid there."""

from __future__ import annotations

import math
import operator


from ndfunc._src.partition.planning.costs import EPS


class Moves:
    """Rounds of many-node moves (`_improve_together`)."""

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
