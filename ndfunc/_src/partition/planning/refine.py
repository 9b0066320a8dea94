"""The search's plan improved one mesh axis at a time, each axis solved exactly by HiGHS.

The search settles where only a joint move of many nodes would lower the cost: under FSDP and TP
it runs the MLP with `tp` as a second data axis, where Megatron's split of the hidden dim (in
forward and backward alike) costs less; under CP it gathers a layer's input for the attention
projections, where keeping the tokens split and gathering keys and values costs less. Each such
move changes the placements along one mesh axis. So, axis by axis, every node may take any of its
candidates that agrees with its current one along every other axis and does no more work, and
HiGHS (`exact`) finds the cheapest such plan of the whole program at once (block coordinate
descent); rounds over the axes until none lowers the cost.

No node does more work, and no point where memory can peak holds more bytes per rank than the
search's plan holds there (`memory.profile`): the cost model prices time alone, and its optimum runs a
toy's step whole on every rank (a gathered batch costs less than reduced gradients) and gathers,
at any dims, what the search kept split to save memory (sequence parallelism's layer inputs, a
vocabulary-parallel loss's logits, FSDP's weights between their uses). A refined plan is as fast
or faster than the search's and peaks no higher, point by point; `exact.solve` with the same bound finds the
cheapest plan that holds no more, the reference a refined plan is measured against.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ndfunc._src.partition.planning import exact, memory

ROUNDS = 3  # over every axis; the plans measured stop improving after one or two

PRICES = 6  # solves of an axis with memory priced (`_priced`)


# `NDFUNC_REFINE_VARIABLES=N`: an axis is solved where its integer program has at most N variables
# (a one-layer tiny Llama's 4D step has about 10,000 an axis; a deep step is refined as the program
# its search is given, a few layers: `repeats`). 0, the default, leaves the search's plan: every
# lowering would pay for it, a tenth to a second and a half (docs/planning.md)
VARIABLES = 0

# ... in at most this many seconds in all
SECONDS = 10.0

# an axis's solve stops within this fraction of its optimum: proving the last of it takes HiGHS
# most of its time, and the search's plan is kept where it is this close
GAP = 1e-3


def variables() -> int:
    """`NDFUNC_REFINE_VARIABLES`, or the default (`VARIABLES`: none)."""
    raw = os.environ.get("NDFUNC_REFINE_VARIABLES", str(VARIABLES))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"NDFUNC_REFINE_VARIABLES={raw!r} must be an integer, as NDFUNC_REFINE_VARIABLES=100000 "
                         "(0, the default: the search's plan as it ends)") from None


def refine(problem, choice: list, max_variables: int, seconds: float) -> list:
    """`choice` (the search's, late candidates admitted) improved axis by axis (the module's
    text), where an axis's integer program has at most `max_variables` variables; `seconds`: the
    time all of it may take. Returns the cheaper choice (`choice` itself where none is)."""
    given, began = choice, time.perf_counter()
    choice = exact._chosen(problem, list(choice))  # (a plan's is a plain list)
    cost = first = problem.total(choice)
    budget = bound(problem, choice)
    for _ in range(ROUNDS):
        improved = False
        for axis in range(len(problem.sizes)):
            left = seconds - (time.perf_counter() - began)
            if left <= 0:
                break
            open_ = _open_along(problem, choice, axis)
            if all(len(o) == 1 for o in open_) or exact.size(problem, open_) > max_variables:
                continue
            found = _within(problem, choice, open_, budget, began + seconds)
            if found is not None and found.cost < cost * (1 - 1e-9):
                choice, cost, improved = found.choice, found.cost, True
        if not improved:
            break
    return choice if cost < first else given


def _within(problem, choice: list, open_: list, budget, deadline: float) -> exact.Exact | None:
    """HiGHS's answer of `open_` (from `choice`) that is cheaper than `choice` and holds within
    `budget` at every point, or None. Solved first without a bound on memory (one axis's program,
    whose relaxation is nearly always integral). Where that answer holds too much somewhere:
    the bytes held at those points priced, from the price at which its excess costs what it saves,
    doubled until an answer holds within and halved back towards the last that did not
    (`_priced`); then, each node keeping that answer's choice or taking the unbounded one's, the
    cheapest plan that holds within, with memory bounded (a knapsack: over the nodes the two
    differ at, a fraction of a second; over the axis's whole program, many seconds)."""
    cost = problem.total(choice)
    free = exact.solve(problem, time_limit=max(deadline - time.perf_counter(), 0.0), gap=GAP, start=choice,
                       open_=open_, presolve=False, relaxation_first=True)
    if free.choice is None or free.cost >= cost * (1 - 1e-9):
        return None
    at = memory.profile(problem, free.choice)
    if not np.any(at > budget):
        return free
    found = _priced(problem, choice, open_, budget, deadline, free, at)
    start = choice if found is None else found.choice
    between = [[c] if c == f else [c, f] for c, f in zip(start, free.choice)]
    crossed = exact.solve(problem, time_limit=max(deadline - time.perf_counter(), 0.0), gap=GAP, start=start,
                          open_=between, memory=budget)
    if crossed.choice is not None and crossed.cost < (cost if found is None else found.cost) * (1 - 1e-9):
        return crossed
    return found


def _priced(problem, choice: list, open_: list, budget, deadline: float, free: exact.Exact, at) -> exact.Exact | None:
    """The cheapest answer found, cheaper than `choice` and within `budget`, with the bytes held
    where answers held too much priced (`_within`); `free`: the unpriced answer, holding `at`."""
    cost, best = problem.total(choice), None
    over = np.flatnonzero(at > budget)
    points = set(over.tolist())
    price = (cost - free.cost) / float(np.sum(at[over] - budget[over]))
    low, high = 0.0, None  # a price whose answer held too much; one whose answer held within
    for _ in range(PRICES):
        if time.perf_counter() >= deadline:
            break
        found = exact.priced(problem, sorted(points), price, deadline - time.perf_counter(), GAP, choice, open_)
        if found.choice is None:
            break
        at = memory.profile(problem, found.choice)
        over = np.flatnonzero(at > budget)
        if len(over):  # too little a price
            points.update(over.tolist())
            low, price = price, 2 * price if high is None else (price + high) / 2
            continue
        if found.cost < cost * (1 - 1e-9) and best is not None and found.cost >= best.cost:
            break  # (a lower price found nothing cheaper)
        if found.cost < cost * (1 - 1e-9):
            best = found
        high, price = price, (low + price) / 2  # within: try less
    return best


def bound(problem, choice: list):
    """What each point of the program may hold, refining `choice`: as much as it holds there
    (`memory.profile`), and a part in a billion, so that it is itself within."""
    return memory.profile(problem, choice) * (1 + 1e-9) + 1.0


def _open_along(problem, choice: list, axis: int) -> list[list[int]]:
    """Per node, the candidates that agree with its chosen one along every mesh axis but `axis`
    and do no more work (its chosen one first among them)."""
    ids: dict = {}  # a layout along the other axes -> an id of it
    apart = [ids.setdefault(_without(lay, axis), len(ids)) for lay in problem.layouts]
    key = lambda lays: tuple(None if lay is None else apart[lay] for lay in lays)  # noqa: E731
    seen: dict = {}  # (id(candidate list), chosen) -> the open candidates: identical layers ask once
    out = []
    for n, i in enumerate(choice):
        ins, outs, work = problem.c_ins[n], problem.c_outs[n], problem.c_work[n]
        memo = (id(ins), id(work), i)
        some = seen.get(memo)
        if some is None or some[0] is not ins:
            want, most = (key(ins[i]), key(outs[i])), work[i] * (1 + 1e-9)
            some = seen[memo] = (ins, [i, *(k for k in range(len(ins)) if k != i and work[k] <= most
                                           and (key(ins[k]), key(outs[k])) == want)])
        out.append(some[1])
    return out


def _without(layout, axis: int) -> tuple:
    return (*layout[:axis], *layout[axis + 1:])
