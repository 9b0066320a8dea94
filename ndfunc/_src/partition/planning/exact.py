"""The partitioner's problem as an integer program, solved exactly by HiGHS (`highspy`).

The search (`solve.Problem.solve`) is fast and local; this is its certificate. The same cost as
`Problem.total` (each node's work, plus for every value the price of moving it from the layout
its producer makes to each distinct layout its consumers take, plus what its requested outputs
cost), written as a mixed-integer linear program:

- `x[n, i]` (binary): node `n` takes candidate `i`; one per node.
- `d[v, b]` (in [0, 1]): some consumer takes value `v` in layout `b` (at least each consumer's
  choice of `b`: costs are non-negative, so it is 1 only where one does).
- `z[v, a, b]` (>= 0): `v` made in `a` and taken in `b`, priced `tcost(v, a, b)`. For a value with
  one consumer slot, `z` is the joint choice of producer and consumer (rows and columns sum to
  their choices: the tight "transportation" form); for a value read by many, `z >= made(a) +
  d(b) - 1`.

- where memory is bounded (`solve`'s `memory`), a row per point of the program keeping the bytes
  held there within its bound (`memory.rows`), added only at the points an answer overflowed.

HiGHS proves its answer optimal, or, stopped at a time limit, returns its best plan and a lower
bound on every plan's cost (`Exact.bound`): a plan's gap to that bound is a certificate of how far
from optimal it can be.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

import highspy
import numpy as np

from ndfunc._src.partition.planning import memory as held
from ndfunc._src.partition.planning.costs import _Choice


@dataclasses.dataclass(frozen=True)
class Exact:
    """What HiGHS made of a problem: its best choice per node (None where it found none), that
    choice's cost by `Problem.total`, the proven lower bound on any choice's cost, and whether it
    proved `cost` optimal (within `gap`)."""

    choice: list[int] | None
    cost: float
    bound: float
    optimal: bool
    variables: int
    seconds: float

    def gap(self, cost: float) -> float:
        """How much more than the optimum `cost` can be, at most, as a fraction of the bound."""
        return (cost - self.bound) / max(self.bound, 1e-12)


class _Columns:
    """Variables as they are added: objective coefficient, integrality, upper bound."""

    def __init__(self):
        self.c: list[float] = []
        self.integral: list[int] = []
        self.upper: list[float] = []

    def add(self, cost: float, integral: bool, upper: float = 1.0) -> int:
        self.c.append(cost)
        self.integral.append(int(integral))
        self.upper.append(upper)
        return len(self.c) - 1


class _Rows:
    """Constraints `lower <= sum(coef * var) <= upper`, as COO triplets."""

    def __init__(self):
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        r = len(self.lower)
        for col, val in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lower.append(lower)
        self.upper.append(upper)


def _model(problem, open_: list | None = None, memory: dict | None = None, byte_price: float = 0.0):
    """Variables and rows for `problem` (late candidates admitted: every candidate at its work).
    `open_`: per node, the candidates it may take (None: all); a node with one is held there, and
    a value no open node makes or reads is left out (its cost is then not in `constant`).
    `memory`: per point of the program, the most bytes per rank it may hold (`memory.rows`; or,
    at `byte_price` a byte, those bytes priced). Returns
    (columns, rows, x: node -> open candidate -> column, or None where the node is held,
    constant: cost that no choice changes)."""
    cols, rows = _Columns(), _Rows()
    x: list[list[int] | None] = []
    constant = 0.0
    opens = open_ or [None] * len(problem.nodes)
    for n, work in enumerate(problem.c_work):
        some = range(len(work)) if opens[n] is None else opens[n]
        if len(some) == 1:
            x.append(None)
            constant += work[some[0]]
            continue
        x.append([cols.add(work[i], True) for i in some])
        rows.add([(col, 1.0) for col in x[n]], 1.0, 1.0)

    def lays(m: int, table: list, slot: int) -> list:
        return [c[slot] for c in table[m]] if opens[m] is None else [table[m][i][slot] for i in opens[m]]

    values = range(len(problem.values))
    if open_ is not None:
        values = sorted({v for n, cs in enumerate(x) if cs is not None
                         for v in (*problem.inputs[n], *problem.out_values(n))})
    if memory:  # every value's layouts, those of values no open node touches held
        made_by = {v: _by_layout(lays(n, problem.c_outs, j), x[n]) for v, (n, j) in enumerate(problem.values)}
        read_by = {v: [_by_layout(lays(m, problem.c_ins, slot), x[m]) for m, slot in problem.consumers[v]]
                   for v in range(len(problem.values))}
        held.rows(problem, cols, rows, made_by, read_by, memory, byte_price)
    for v in values:
        n, j = problem.values[v]
        made = _by_layout(lays(n, problem.c_outs, j), x[n])
        if v in problem.final:  # what its requested outputs cost, by the layout it is made in
            for a, terms in made.items():
                price = problem.output_cost(v, a)
                constant += _linear(cols, rows, terms, price)
        readers = [_by_layout(lays(m, problem.c_ins, slot), x[m]) for m, slot in problem.consumers[v]]
        if not readers:
            continue
        if len(readers) == 1:
            constant += _joint(problem, v, cols, rows, made, readers[0])
        else:
            constant += _shared(problem, v, cols, rows, made, readers)
    return cols, rows, x, constant


def _by_layout(lays: list, columns: list[int] | None) -> dict:
    """layout -> the columns choosing it (None: a node with one candidate, always it)."""
    out: dict = {}
    for i, lay in enumerate(lays):
        if lay is not None:
            out.setdefault(lay, []).append(None if columns is None else columns[i])
    return out


def _linear(cols, rows, terms: list, price: float) -> float:
    """Adds `price` times the indicator `sum(terms)` to the objective; returns its constant part."""
    if price == 0.0:
        return 0.0
    if terms == [None]:
        return price
    for col in terms:
        if np.isfinite(price):
            cols.c[col] += price
        else:  # a layout change no collective makes: the choice is out
            cols.upper[col] = 0.0
    return 0.0


def _indicator(cols, rows, terms: list) -> tuple[int | None, float]:
    """A column equal to `sum(terms)` (a choice of layout), or (None, 1.0) where it is always made."""
    if terms == [None]:
        return None, 1.0
    if len(terms) == 1:
        return terms[0], 0.0
    col = cols.add(0.0, False)
    rows.add([(col, 1.0), *[(t, -1.0) for t in terms]], 0.0, 0.0)
    return col, 0.0


def _joint(problem, v, cols, rows, made: dict, taken: dict) -> float:
    """One consumer slot: `z[a, b]` sums to the producer's choice of `a` over `b` and to the
    consumer's choice of `b` over `a`."""
    if len(made) == 1 or len(taken) == 1:  # one side fixed: the other's choice prices it directly
        constant = 0.0
        for a, a_terms in made.items():
            for b, b_terms in taken.items():
                if a != b:
                    price = problem.tcost(v, a, b)
                    constant += _linear(cols, rows, b_terms if len(made) == 1 else a_terms, price)
        return constant
    _transport(cols, rows, made, taken, lambda a, b: problem.tcost(v, a, b) if a != b else 0.0)
    return 0.0


def _shared(problem, v, cols, rows, made: dict, readers: list) -> float:
    """Many consumer slots, each distinct layout taken paid once. Made in one layout: `d[b]` is at
    least each consumer's choice of `b`, priced from it. Else each consumer's joint choice with the
    producer (`_transport`), and `y[a, b]` at least every consumer's: the tight form, where
    `y >= made(a) + d(b) - 1` leaves HiGHS a relaxation too weak to prune with."""
    if len(made) == 1:
        (a, terms), = made.items()
        wanted: dict = {}
        for taken in readers:
            for b, group in taken.items():
                wanted.setdefault(b, []).append(group)
        constant = 0.0
        for b, groups in wanted.items():
            price = problem.tcost(v, a, b) if a != b else 0.0
            if price == 0.0:
                continue
            if any(g == [None] for g in groups):  # a consumer with one candidate always takes it
                constant += price
                continue
            d = cols.add(price, False) if np.isfinite(price) else cols.add(0.0, False, upper=0.0)
            for g in groups:
                rows.add([(d, 1.0), *[(t, -1.0) for t in g]], 0.0, np.inf)
        return constant
    y: dict = {}
    for taken in readers:
        if len(taken) == 1:  # this consumer always takes `b`: the producer's choice of `a` pays
            (b, _), = taken.items()
            z = {(a, b): _indicator(cols, rows, terms) for a, terms in made.items()}
        else:
            z = _transport(cols, rows, made, taken, lambda a, b: 0.0)
        for (a, b), (col, fixed) in z.items():
            if a == b:
                continue
            if (a, b) not in y:
                price = problem.tcost(v, a, b)
                y[a, b] = cols.add(price, False) if np.isfinite(price) else cols.add(0.0, False, upper=0.0)
            rows.add([(y[a, b], 1.0), (col, -1.0)], 0.0, np.inf)
    return 0.0


def _transport(cols, rows, made: dict, taken: dict, price) -> dict:
    """`z[a, b]` (>= 0, `price(a, b)` each), its rows summing to the producer's choice of `a` and
    its columns to the consumer's choice of `b`: (column, 0.0) per pair."""
    z = {}
    for a in made:
        for b in taken:
            p = price(a, b)
            z[a, b] = (cols.add(p, False) if np.isfinite(p) else cols.add(0.0, False, upper=0.0)), 0.0
    for a, terms in made.items():
        rows.add([*[(z[a, b][0], 1.0) for b in taken], *[(t, -1.0) for t in terms]], 0.0, 0.0)
    for b, terms in taken.items():
        rows.add([*[(z[a, b][0], 1.0) for a in made], *[(t, -1.0) for t in terms]], 0.0, 0.0)
    return z


def size(problem, open_: list | None = None) -> int:
    """About how many variables `_model` makes of `problem` (`open_` as there), found without making
    them (the pairs of layouts a value is made and taken in dominate): whether a solve is worth it."""
    opens = open_ or [None] * len(problem.nodes)
    total = sum(len(w) if o is None else len(o) for w, o in zip(problem.c_work, opens)
                if len(w) > 1 and (o is None or len(o) > 1))
    layouts: dict = {}  # (id(candidate layouts), slot, side) -> the distinct layouts there

    def distinct(m: int, lists, slot: int) -> int:
        if opens[m] is not None:
            return len({lists[i][slot] for i in opens[m]})
        key = (id(lists), slot)
        known = layouts.get(key)
        if known is None or known[0] is not lists:
            known = layouts[key] = (lists, len({c[slot] for c in lists}))
        return known[1]

    for v, (n, j) in enumerate(problem.values):
        made = distinct(n, problem.c_outs[n], j)
        if made == 1:
            continue
        total += sum(made * distinct(m, problem.c_ins[m], slot) for m, slot in problem.consumers[v])
    return total


def solve(problem, time_limit: float = 60.0, gap: float = 1e-6, start: list[int] | None = None,
          open_: list | None = None, presolve: bool = True, relaxation_first: bool = False,
          memory: np.ndarray | None = None) -> Exact:
    """The least-cost choice of `problem` (a `solve.Problem`; its late candidates are admitted),
    proven within `gap` of optimal, or HiGHS's best and its bound after `time_limit` seconds.
    `start`: a choice to begin from (the search's), so HiGHS prunes against it from the first node.
    `open_`: per node, the candidates it may take (None: all), `start`'s among them; no bound is
    then sought (-inf). `presolve`: HiGHS's, which pays on a whole program, not on one axis's few
    candidates a node (`refine`). `relaxation_first`: the linear relaxation solved first, which is
    all where it proves `start` within `gap` of optimal or where its optimum is integral (so, on
    one axis's candidates, nearly always: a quarter of the integer program's time).

    `memory`: per point of the program (`memory.spans(problem).points`), the most bytes per rank
    it may hold (None: no bound; `start` must hold within). Solved without it, then bounded at the
    points where the answer holds more, and solved again, until an answer holds within: each
    answer's cost, of a program bounded at fewer points, is a lower bound, so the last is optimal
    where each solve was (a row at every point makes a knapsack of what is nearly a network
    problem). An answer over only at points already bounded is over by HiGHS's tolerance, and
    kept."""
    began = time.perf_counter()
    limits: dict = {}
    while True:
        left = time_limit - (time.perf_counter() - began)
        found = _solve(problem, limits, max(left, 0.0), gap, start, open_, presolve, relaxation_first)
        if memory is None or found.choice is None:
            return found
        over = [r for r in np.flatnonzero(held.profile(problem, found.choice) > memory).tolist() if r not in limits]
        if not over:
            return dataclasses.replace(found, seconds=time.perf_counter() - began)
        if time.perf_counter() - began >= time_limit:
            return Exact(None, np.inf, found.bound, False, found.variables, time.perf_counter() - began)
        limits.update((r, float(memory[r])) for r in over)


def priced(problem, points, price: float, time_limit: float, gap: float, start: list[int], open_: list) -> Exact:
    """`solve` (one axis's: `open_`, the relaxation first, no presolve) with the bytes held at
    `points` (indices of `memory.spans(problem).points`) priced at `price` each: a Lagrangian
    relaxation of bounding them (`refine`). Its cost is `Problem.total`'s, the price left out."""
    return _solve(problem, dict.fromkeys(points, 0.0), time_limit, gap, start, open_, False, True, price)


def _solve(problem, limits: dict, time_limit: float, gap: float, start: list[int] | None, open_: list | None,
           presolve: bool, relaxation_first: bool, price: float = 0.0) -> Exact:
    """`solve` with the points in `limits` (an index of `memory.spans(problem).points` -> the
    most bytes per rank it may hold) bounded, or priced at `price` a byte (`priced`)."""
    began = time.perf_counter()
    if problem._late:
        problem._admit(problem._late)
        problem._late = []
    cols, rows, x, constant = _model(problem, open_, limits, price)
    n = len(cols.c)
    opens = open_ or [None] * len(problem.nodes)
    candidate = lambda node, i: i if opens[node] is None else opens[node][i]  # noqa: E731 - position -> candidate
    if not n:
        choice = _chosen(problem, [candidate(node, 0) for node in range(len(problem.nodes))])
        cost = problem.total(choice)
        return Exact(choice, cost, cost if open_ is None else -np.inf, True, 0, time.perf_counter() - began)
    if relaxation_first:
        # (`start`'s cost is its objective only where nothing is priced beyond `Problem.total`)
        settled = _relaxed(problem, cols, rows, x, constant, candidate, time_limit - (time.perf_counter() - began),
                           gap, None if price else start, presolve)
        if settled is not None:
            choice, cost, bound = settled
            return Exact(choice, cost, bound if open_ is None else -np.inf, True, n, time.perf_counter() - began)
    highs = _highs(cols, rows, max(time_limit - (time.perf_counter() - began), 0.0), gap, presolve)
    if start is not None:
        picked = [(col, float(candidate(node, i) == start[node])) for node, cs in enumerate(x) if cs is not None
                  for i, col in enumerate(cs)]
        highs.setSolution(len(picked), np.array([c for c, _ in picked], dtype=np.int32),
                          np.array([v for _, v in picked]))
    highs.run()
    info = highs.getInfo()
    bound = constant + info.mip_dual_bound if np.isfinite(info.mip_dual_bound) and open_ is None else -np.inf
    seconds = time.perf_counter() - began
    if info.primal_solution_status != 2:  # (kSolutionStatusFeasible) no plan found in the time given
        return Exact(None, np.inf, bound, False, n, seconds)
    values = np.array(highs.getSolution().col_value)
    choice = _chosen(problem, [candidate(node, 0 if cs is None else int(np.argmax(values[cs])))
                               for node, cs in enumerate(x)])
    cost = problem.total(choice)
    optimal = highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return Exact(choice, cost, min(bound, cost), optimal, n, seconds)


def _relaxed(problem, cols, rows, x, constant, candidate, time_limit, gap, start, presolve) -> tuple | None:
    """The linear relaxation's answer where it settles the integer program (`solve`'s
    `relaxation_first`): (choice, cost, bound), `start` itself where no choice is `gap` cheaper;
    None where the integer program must be solved."""
    highs = _highs(cols, rows, time_limit, gap, presolve)
    highs.setOptionValue("solve_relaxation", True)
    highs.run()
    if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    bound = constant + highs.getInfo().objective_function_value
    if start is not None:
        began_at = _chosen(problem, list(start))
        cost = problem.total(began_at)
        if bound >= cost * (1 - gap):
            return began_at, cost, min(bound, cost)
    values = np.array(highs.getSolution().col_value)
    picks = []
    for node, cs in enumerate(x):
        if cs is None:
            picks.append(candidate(node, 0))
            continue
        taken = values[cs]
        if np.any(np.minimum(taken, 1 - taken) > 1e-6):
            return None  # fractional: branch
        picks.append(candidate(node, int(np.argmax(taken))))
    choice = _chosen(problem, picks)
    return choice, problem.total(choice), bound


def _new_highs():
    """A `highspy.Highs`; the process's first writes HiGHS's banner to file descriptor 1 as it is
    made, before any option can say otherwise: that one is made with the descriptor pointed away."""
    global _BANNER_SHOWN
    with _MAKING:
        if _BANNER_SHOWN:
            return highspy.Highs()
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                highs = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        _BANNER_SHOWN = True
        return highs


_MAKING = threading.Lock()
_BANNER_SHOWN = False


def _highs(cols: _Columns, rows: _Rows, time_limit: float, gap: float, presolve: bool = True):
    """A HiGHS instance holding the model, quiet, stopping at `time_limit` or `gap`, its presolve
    on or off."""
    col_of = np.array(rows.cols, dtype=np.int64)
    by_column = np.lexsort((np.array(rows.rows), col_of))  # column-wise, as HiGHS reads it
    start = np.concatenate([[0], np.cumsum(np.bincount(col_of, minlength=len(cols.c)))])
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cols.c), len(rows.lower)
    lp.col_cost_ = np.array(cols.c)
    lp.col_lower_ = np.zeros(len(cols.c))
    lp.col_upper_ = np.array(cols.upper)
    lp.row_lower_ = np.array(rows.lower)
    lp.row_upper_ = np.array(rows.upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start.astype(np.int32)
    lp.a_matrix_.index_ = np.array(rows.rows, dtype=np.int32)[by_column]
    lp.a_matrix_.value_ = np.array(rows.vals)[by_column]
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                       for i in cols.integral]
    highs = _new_highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", max(float(time_limit), 0.0))  # (HiGHS refuses a negative one: no limit)
    highs.setOptionValue("mip_rel_gap", float(gap))
    highs.setOptionValue("threads", 1)
    if not presolve:
        highs.setOptionValue("presolve", "off")
    highs.passModel(lp)
    return highs


def _chosen(problem, picks: list[int]) -> list[int]:
    """`picks` as the search's choice type (it counts what many-consumer values are wanted in)."""
    choice = _Choice(problem, len(picks))
    for n, i in enumerate(picks):
        choice[n] = i
    return choice
