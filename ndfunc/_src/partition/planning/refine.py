"""The search's plan improved one mesh axis at a time, each axis solved exactly by HiGHS.

The search settles where only a joint move of many nodes would lower the cost: under FSDP and TP
it runs the MLP with `tp` as a second data axis, where Megatron's split of the hidden dim (in
forward and backward alike) costs less; under CP it gathers a layer's input for the attention
projections, where keeping the tokens split and gathering keys and values costs less. Each such
move changes the placements along one mesh axis. So, axis by axis, every node may take any of its
candidates that agrees with its current one along every other axis and does no more work, and
HiGHS (`exact`) finds the cheapest such plan of the whole program at once (block coordinate
descent); rounds over the axes until none lowers the cost.

No more work per node, and no input or output split less along the axis: the cost model leaves
memory out, and at a toy's dims its optimum runs the step whole on every rank (a gathered batch
costs less than reduced gradients), and at any dims it would gather what the search kept split to
save memory (sequence parallelism's layer inputs, a vocabulary-parallel loss's logits, FSDP's
weights between their uses). A plan refined keeps every split of work and of data the search
found. (So Megatron's split of an MLP under FSDP and TP, which holds its input whole on every tp
rank where the search splits it by the batch, is left to the search.)
"""

from __future__ import annotations

import os
import time

from torch.distributed.tensor import Shard

from ndfunc._src.partition.planning import exact

ROUNDS = 3  # over every axis; the plans measured stop improving after one or two

# `NDFUNC_REFINE_VARIABLES=N`: an axis is solved where its integer program has at most N variables
# (a one-layer tiny Llama's 4D step has about 10,000 an axis; a deep step is refined as the program
# its search is given, a few layers: `repeats`). 0, the default, leaves the search's plan: every
# lowering would pay for it, and it does not yet reach the optimum everywhere (docs/planning.md)
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
    for _ in range(ROUNDS):
        improved = False
        for axis in range(len(problem.sizes)):
            left = seconds - (time.perf_counter() - began)
            if left <= 0:
                break
            open_ = _open_along(problem, choice, axis)
            if all(len(o) == 1 for o in open_) or exact.size(problem, open_) > max_variables:
                continue
            found = exact.solve(problem, time_limit=left, gap=GAP, start=choice, open_=open_, presolve=False,
                                relaxation_first=True)
            if found.choice is not None and found.cost < cost * (1 - 1e-9):
                choice, cost, improved = found.choice, found.cost, True
        if not improved:
            break
    return choice if cost < first else given


def _open_along(problem, choice: list, axis: int) -> list[list[int]]:
    """Per node, the candidates that agree with its chosen one along every mesh axis but `axis`,
    do no more work and split along `axis` every input and output it splits there (its chosen one
    first among them)."""
    ids: dict = {}  # a layout along the other axes -> an id of it
    apart = [ids.setdefault(_without(lay, axis), len(ids)) for lay in problem.layouts]
    split = [isinstance(lay[axis], Shard) for lay in problem.layouts]  # split along `axis`, per layout id
    key = lambda lays: tuple(None if lay is None else apart[lay] for lay in lays)  # noqa: E731
    splits = lambda lays: [lay is not None and split[lay] for lay in lays]  # noqa: E731
    seen: dict = {}  # (id(candidate list), chosen) -> the open candidates: identical layers ask once
    out = []
    for n, i in enumerate(choice):
        ins, outs, work = problem.c_ins[n], problem.c_outs[n], problem.c_work[n]
        memo = (id(ins), id(work), i)
        some = seen.get(memo)
        if some is None or some[0] is not ins:
            want, most, kept = (key(ins[i]), key(outs[i])), work[i] * (1 + 1e-9), splits((*ins[i], *outs[i]))
            some = seen[memo] = (ins, [i, *(k for k in range(len(ins)) if k != i and work[k] <= most
                                           and (key(ins[k]), key(outs[k])) == want
                                           and all(b or not a for a, b in zip(kept, splits((*ins[k], *outs[k])))))])
        out.append(some[1])
    return out


def _without(layout, axis: int) -> tuple:
    return (*layout[:axis], *layout[axis + 1:])
