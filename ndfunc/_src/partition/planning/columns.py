"""A node's candidates priced as float64 columns where it has many (a 4-axis op has hundreds):
each input's and output's terms found once per distinct layout and gathered to every candidate,
the same floats in the same order as `Costs.local_cost`'s sums."""

from __future__ import annotations

import functools

import numpy as np

from ndfunc._src.partition.planning import redistribute

PRICED_TOGETHER = 64  # this many new layout changes in a column are walked together (`_tcosts`)


class Columns:
    """`Costs.local_costs` of every candidate at once, as columns."""

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
                                                   itemsize, self.prices)
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
