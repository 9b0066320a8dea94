"""The kinds of many-node move: redirect a value to another layout for its consumers
(`_redirect`), or change its producer to make it in another (`_producer_moves`), then settle what
lies downstream (`_settle`)."""

from __future__ import annotations

import heapq

import numpy as np

from ndfunc._src.partition.planning import reachable, redistribute
from ndfunc._src.partition.planning.columns import _Lays
from ndfunc._src.partition.planning.problem import VECTOR_MIN


class MoveKinds:
    """Each kind of many-node move, measured against the choice it starts from."""

    def _layouts_for(self, v: int, choice: list) -> list[int]:
        """The layouts, other than those wanted now, that some consumer of `v` could take it in
        and that are cheapest to reach (a few per mesh axis: dearer ones rarely pay). Once the
        search has settled (`widened`), five times as many for a value made as a pending sum: a
        gradient reduce-scattered where every reader takes it, not where the cheapest to reach
        puts it."""
        lays = self._taken(v)
        if not lays.ids:
            return []
        have = self.out_layout(v, choice)
        costs = self._tcosts(v, have, lays, outward=True)
        demands = self.demands(v, choice)
        order = np.argsort(costs, kind="stable")  # by cost, then layout: the ids are sorted
        wide = self.widened and have is not None and reachable.bits(self.codes[have])
        found = []
        for k in order.tolist():
            if lays.ids[k] not in demands:
                found.append(lays.ids[k])
                if len(found) == (5 if wide else 1) * (len(self.sizes) + 2):
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
