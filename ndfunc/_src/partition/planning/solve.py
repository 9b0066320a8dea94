"""Choose a strategy for every node of a traced step, for the whole graph at once.

The cost of a choice is what its collectives take (`redistribute.cost`: `collective_cost`'s
alpha-beta seconds on each axis's link, in bytes sent at the fastest link's rate), summed over
every place a value must change layout for a consumer, plus each node's floating-point work on one
rank (divided by the mesh axes its strategy splits, at the machine's rate: `Prices.flops`). A value
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
makes, a second search runs with them admitted from the start (as many rounds of many-node moves),
and its plan is kept where cheaper (the first's last phase spared where the second's is kept by
far before it: `SECOND_FAR`): under FSDP and CP that one keeps every layer's tokens split
over cp, where the first settles on gathering them for the MLP and splitting its weights over cp,
and moving many nodes at once never undoes that. On the plan kept, moves of many nodes once more,
each value tried in more layouts (HSDP's gradient reduce-scattered along the dim its parameter is
split on, not along another and then exchanged), and single-node moves: moves of many nodes can
leave one open (a sum's two terms each gathered, where gathering the sum is one gather).
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
import os

import torch

from ndfunc._src.partition.planning import exact, plan_cache, redistribute, refine, repeats
from ndfunc._src.partition.planning.columns import Columns
from ndfunc._src.partition.planning.costs import Costs
from ndfunc._src.partition.planning.layout import Layout
from ndfunc._src.partition.planning.move_kinds import MoveKinds
from ndfunc._src.partition.planning.moves import Moves
from ndfunc._src.partition.planning.ops import runs_whole, strategy_key
from ndfunc._src.partition.planning.problem import Arrays
from ndfunc._src.partition.planning.search import Plan, Search
from ndfunc._src.partition.planning.strategies import tensor_inputs, tensor_outputs, value_of

__all__ = ["Plan", "Problem", "exact_settings", "partition"]

# `NDFUNC_EXACT_VARIABLES=N`: the search's plan is handed to HiGHS (`exact`) where its integer
# program has at most N variables (none by default: the exact optimum by the cost model replicates
# the work of the suite's small models where the search keeps it split, see docs/planning.md),
# given `NDFUNC_EXACT_SECONDS` to prove it
EXACT_SECONDS = 30.0

# HiGHS's plan replaces the search's where it is this much cheaper by the cost model: below it the
# search's is within the promise (`docs/planning.md`) and the model's differences are smaller than
# what it leaves out (memory, overlap)
EXACT_GAIN = 0.01


class Problem(Search, Moves, MoveKinds, Columns, Costs, Arrays):
    """A traced step's partitioning problem: the graph as integers (`problem.Arrays`), what a
    choice costs (`costs`, `columns`), the search (`search`, `moves`, `move_kinds`)."""


def partition(graph: torch.fx.Graph, sizes: tuple[int, ...], input_layouts: list[Layout],
              output_layouts: list[Layout | None], prices: redistribute.Prices | None = None) -> Plan:
    """Pick a strategy for every node; outputs end in `output_layouts` (None: the partitioner's
    choice, without pending sums). `prices`: the links' and a rank's rates (`redistribute.Prices`;
    this machine's unless given).

    The search is a pure function of what `Problem` reads (each node's op, arguments, shapes,
    marks and inputs, the sizes, the boundary layouts, the prices), so a graph equal to one planned
    before in all of that gets that plan again, node by node, without a search: a step jitted afresh
    on the same model and mesh (a notebook's re-run, a test suite) plans once; with
    `NDFUNC_PLAN_CACHE_DIR` set, once across processes too (`plan_cache`)."""
    prices = prices or redistribute.host_prices(tuple(sizes))
    nodes, key, signatures = _problem_key(graph, sizes, input_layouts, output_layouts, prices)
    known, kept_in = _PLANS.get(key, (None, None))
    where = plan_cache.directory()
    if known is not None and where is not None and where != kept_in:
        plan_cache.store(plan_cache.entry(key), known)  # remembered here, and now kept there too
        _PLANS[key] = known, where
    if known is None:
        kept = plan_cache.entry(key)
        known = plan_cache.load(kept, len(nodes))  # a plan another process made (NDFUNC_PLAN_CACHE_DIR)
        if known is None:
            plan = _repeats_planned(graph, sizes, input_layouts, output_layouts, signatures, prices)
            at = {n: i for i, n in enumerate(nodes)}
            # which nodes run whole is kept with the plan: a plan read back asks for no candidates
            whole = [i for i, n in enumerate(nodes) if runs_whole(n, sizes, signatures.get(n))]
            known = ([plan.strategy.get(n) for n in nodes], [(at[v[0]], v[1], lay) for v, lay in plan.outputs],
                     plan.cost, whole, plan.bound)
            plan_cache.store(kept, known)
        _PLANS[key] = known, where
        while len(_PLANS) > 64:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(key)
    strategies, outputs, cost, whole, bound = known
    return Plan(sizes, {n: s for n, s in zip(nodes, strategies) if s is not None},
                [((nodes[i], j), lay) for i, j, lay in outputs], cost, [nodes[i] for i in whole], bound)



# problem key -> (plan by node position, the plan cache directory it is kept in: a directory set
# since, as a notebook may, gets it too, for the processes that read it)
_PLANS: collections.OrderedDict = collections.OrderedDict()



def _problem_key(graph: torch.fx.Graph, sizes, input_layouts, output_layouts,
                 prices) -> tuple[list, tuple, dict]:
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
                        exact_settings(), refine.variables(), prices)), signatures



class _Key(tuple):
    """A problem's key, its hash found once: a program's key holds an entry per node, and the plans
    remembered (`_PLANS`) hash it three times a lowering. (A tuple still: equal to, and written as,
    the tuple it holds.)"""

    def __hash__(self) -> int:
        known = self.__dict__.get("hash")
        if known is None:
            known = self.__dict__["hash"] = tuple.__hash__(self)
        return known



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



def _repeats_planned(graph: torch.fx.Graph, sizes, input_layouts, output_layouts, signatures: dict,
                     prices) -> Plan:
    """`_planned` of the problem `graph` is planned as (`problem_of`), expanded to every node."""
    problem, contraction = problem_of(graph, sizes, input_layouts, output_layouts, signatures, prices)
    plan = _planned(problem)
    return plan if contraction is None else repeats.expanded(contraction, plan, graph)


def problem_of(graph: torch.fx.Graph, sizes, input_layouts, output_layouts, signatures: dict | None = None,
               prices=None) -> tuple[Problem, repeats.Contraction | None]:
    """The problem the search is given for `graph`: of the graph, or of it with a chain of alike
    calls planned through three of them (`repeats`), and that contraction (None: none). A
    contraction that would give a node the plan of one whose candidates are another's (another
    op signature: a mark some layers' nodes have) is not made."""
    signatures = signatures or {}
    contraction = repeats.contracted(graph, input_layouts, output_layouts)
    if contraction is not None:
        key = lambda n: signatures[n] if n in signatures else strategy_key(n)[0]  # noqa: E731
        if any(n.op == "call_function" and key(n) != key(contraction.source[kept])
               for n, kept in contraction.plan_of.items()):
            contraction = None
    if contraction is None:
        return Problem(graph, sizes, input_layouts, output_layouts, signatures, prices), None
    own = {new: signatures[n] for new, n in contraction.source.items() if n in signatures}
    return Problem(contraction.graph, sizes, contraction.input_layouts, contraction.output_layouts, own,
                   prices), contraction


def _planned(problem: Problem) -> Plan:
    """The search's plan, improved one mesh axis at a time where an axis is small enough
    (`refine`); where the problem is small enough (`EXACT_VARIABLES`), HiGHS's from it, proven
    optimal or with the bound it reached in `EXACT_SECONDS`, kept where cheaper. Neither holds
    more than the search's plan at any point where memory can peak (`memory`)."""
    plan = searched = problem.solve()
    if limit := refine.variables():
        choice = refine.refine(problem, plan.choice, limit, refine.SECONDS)
        if choice is not plan.choice:
            plan = problem.plan(choice)
    limit, seconds = exact_settings()
    if not limit or exact.size(problem) > limit:
        return plan
    found = exact.solve(problem, time_limit=seconds, start=plan.choice, memory=refine.bound(problem, searched.choice))
    if found.choice is not None and found.cost < (1 - EXACT_GAIN) * plan.cost:
        return problem.plan(found.choice, bound=found.bound)
    return dataclasses.replace(plan, bound=found.bound)

