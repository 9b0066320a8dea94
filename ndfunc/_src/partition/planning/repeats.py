"""A repeated layer planned once: the program planned with three calls of a chain.

The tracer copies a repeated region's template at every call (`stamp`) and marks each copied
node with its call and its place in the template (`stamp.CALL`). Calls of one template that read
alike things from outside (inputs laid out alike, the same places of other calls, the same ops
between) and that each read what the one before made are a chain: a decoder's layers but its
first and last, which read the embedding and the head's gradient. Where a chain has `MIN_CALLS`
calls or more, the program is planned with only its first, second and last (`contracted`), so a
decoder with 8 layers or more with five of them:
- what read a call left out reads the same place of its chain's second call where that comes
  before the reader, else of the latest kept call before it (the chain's last call reads the
  second's output; in backward, the second reads the last's gradient);
- an op, or another region's call, that then computes what one made before it does, up to which
  input of the same layout it reads (AdamW's update of each left-out layer's weight, the cast of
  its gradient), is that one.
The plan is then given to every node (`expanded`): a call left out takes its second call's, an op
made one with another that one's, and an op the contracted program no longer needs that of the
first op computing what it does. The layers between the first and the last of the chain are
planned as one, as `jax.lax.scan` compiles one body, and the search grows with a program's
distinct layers, not with its depth.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx.node import map_arg

from ndfunc._src.partition.planning.search import Plan
from ndfunc._src.partition.planning.strategies import value_of
from ndfunc._src.stamp import CALL

# from this many calls in a chain on, the program is planned with three of them; below, a call or
# two saved is not worth a plan that can differ from the whole program's search
MIN_CALLS = 6


@dataclasses.dataclass
class Contraction:
    """A program with a chain's calls but three left out (`contracted`), and where each of the
    full program's nodes finds its plan in it (`expanded`)."""

    graph: torch.fx.Graph
    plan_of: dict  # a node of the full program -> the node of `graph` whose strategy it takes
    source: dict  # a node of `graph` -> the node of the full program it was made from
    left_out: int  # how many of the full program's nodes `graph` does not have
    input_layouts: list  # of `graph`'s inputs (those the full program's read only where left out are not)
    output_layouts: list  # of `graph`'s outputs (each value and layout requested once)
    output_at: list  # per output of the full program, its place among `graph`'s


def contracted(graph: torch.fx.Graph, input_layouts: list, output_layouts: list) -> Contraction | None:
    """`graph` with each chain of `MIN_CALLS` or more alike calls planned through three of them
    (the module's text); None where it has no such chain."""
    nodes = list(graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    calls = _calls(nodes)
    layout_of = dict(zip([n for n in nodes if n.op == "placeholder"], input_layouts))
    described = _described(nodes, layout_of, {n: key for places in calls.values() for key, n in places.items()})
    groups: dict = {}
    for call, places in calls.items():
        groups.setdefault(_signature(places, described), []).append(call)
    stand_in: dict = {}  # a node left out -> the same place in the chain's second call
    kept_at: dict = {}  # (chain, place) -> its kept nodes there, in program order
    place_of: dict = {}  # a node of a chain -> (chain, place)
    for chain, members in groups.items():
        members.sort(key=lambda c: min(at[n] for n in calls[c].values()))
        if len(members) < MIN_CALLS or not all(_follows(calls[b], calls[a]) for a, b in zip(members, members[1:])):
            continue
        second = calls[members[1]]
        for i, call in enumerate(members):
            for place, node in calls[call].items():
                place_of[node] = chain, place
                if 2 <= i < len(members) - 1:
                    stand_in[node] = second[place]
                else:
                    kept_at.setdefault((chain, place), []).append(node)
    if not stand_in:
        return None
    for kept in kept_at.values():
        kept.sort(key=at.__getitem__)
    graph_, env, source = _built(nodes, at, stand_in, place_of, kept_at, layout_of)
    plan_of = None if graph_ is None else _plans_of(nodes, env, stand_in, place_of, layout_of, graph_)
    if plan_of is None:
        return None
    alive = set(graph_.nodes)
    inputs = [layout_of[n] for n in nodes if n.op == "placeholder" and env[n] in alive]
    outputs, output_at = _outputs_once(graph_, output_layouts)
    return Contraction(graph_, plan_of, source, len(nodes) - len(graph_.nodes), inputs, outputs, output_at)


def expanded(contraction: Contraction, plan: Plan, graph: torch.fx.Graph) -> Plan:
    """`plan` (of `contraction.graph`) as a plan of the full `graph`: every node the strategy of
    where it finds its plan, every output leaf its final layout."""
    strategy = {node: plan.strategy[kept] for node, kept in contraction.plan_of.items()
                if kept in plan.strategy}  # (a tuple's `getitem` has none: its producer's says)
    output = next(iter(graph.find_nodes(op="output")))
    outputs = [(value_of(a), plan.outputs[i][1]) for a, i in zip(output.args[0], contraction.output_at)]
    return Plan(plan.sizes, strategy, outputs, plan.cost)


def _calls(nodes: list) -> dict:
    """call -> {(template, part, place, occurrence): node}: the nodes the tracer copied for each call
    (a place met again is a copy made after tracing: `nf.remat`'s recomputation)."""
    calls: dict = {}
    for n in nodes:
        mark = n.meta.get(CALL)
        if mark is None or n.op != "call_function":
            continue
        template, part, call, place = mark
        places = calls.setdefault(call, {})
        occurrence = 0
        while (template, part, place, occurrence) in places:
            occurrence += 1
        places[template, part, place, occurrence] = n
    return calls


def _described(nodes: list, layout_of: dict, place: dict) -> dict:
    """node -> what it is, as an id equal for nodes alike in every call: an input, by its layout; a
    call's node, by its place (`place`: `_calls`' key, less the call); an op between calls, by its
    op, shape and what it reads, so that the cast of one layer's gradient of a weight and of
    another layer's of the same weight are alike, and not the cast of another weight's."""
    ids: dict = {}
    described: dict = {}
    for node in nodes:
        if node.op == "placeholder":
            what = _input(node, layout_of.get(node))
        elif node in place:
            what = ("call", place[node])
        else:
            what = (node.op, node.target, _shape(node), tuple(described[a] for a in node.all_input_nodes))
        described[node] = ids.setdefault(what, len(ids))
    return described


def _signature(places: dict, described: dict) -> tuple:
    """What makes two calls alike: their places, and what each place reads from outside the call
    (`_described`)."""
    inside = set(places.values())
    outside = tuple((place, slot, described[a]) for place, node in sorted(places.items())
                    for slot, a in enumerate(node.all_input_nodes) if a not in inside)
    return tuple(sorted(places)), outside


def _follows(call: dict, before: dict, depth: int = 4) -> bool:
    """Whether `call` reads what `before` made, directly or through a few ops between them."""
    made, inside = set(before.values()), set(call.values())
    frontier = {a for n in call.values() for a in n.all_input_nodes if a not in inside}
    for _ in range(depth):
        if frontier & made:
            return True
        frontier = {a for n in frontier if CALL not in n.meta for a in n.all_input_nodes}
    return bool(frontier & made)


def _built(nodes: list, at: dict, stand_in: dict, place_of: dict, kept_at: dict,
           layout_of: dict) -> tuple[torch.fx.Graph | None, dict, dict]:
    """The contracted graph, each full program's node's node in it, and what each of its nodes was
    made from: the nodes left out skipped,
    what read them reading their stand-in where it comes before the reader, else the latest kept
    node of their place before it, and an op that so reads what a node made before computes (an
    input of the same layout for another) that one.
    Ops left with no reader are dropped (the update of a left-out layer's weight, made one with
    another's, leaves the scaling of its state read by none)."""
    graph = torch.fx.Graph()
    env: dict = {}
    source: dict = {}  # a node of `graph` -> the node it was made from
    ids: dict = {}  # what a node of `graph` computes -> an id
    id_of: dict = {}  # a node of `graph` -> the id of what it computes
    same: dict = {}  # an id -> the first node of `graph` that computes it
    moved: set = set()  # nodes reading a node left out, at any remove

    def read(a, reader):
        if a not in stand_in:
            return env[a]
        if at[stand_in[a]] < at[reader]:
            return env[stand_in[a]]
        before = [k for k in kept_at[place_of[a]] if at[k] < at[reader]]
        if not before:
            raise _NotAlike
        return env[before[-1]]

    for node in nodes:
        if node in stand_in:
            continue
        try:
            args = map_arg(node.args, lambda a, reader=node: read(a, reader))
            kwargs = map_arg(node.kwargs, lambda a, reader=node: read(a, reader))
        except _NotAlike:
            return None, env, {}
        if node.op == "placeholder":
            what = _input(node, layout_of[node])
        elif node.op == "call_function" and node not in place_of:
            shown = lambda a: id_of[a]  # noqa: E731
            what = _computes(node, args, kwargs, shown)
        else:
            what = ("node", node.name)
        if node.op == "call_function" and node not in place_of and \
                any(a in stand_in or a in moved for a in node.all_input_nodes):
            moved.add(node)
            known = same.get(ids.get(what))
            if known is not None:
                env[node] = known
                continue
        new = env[node] = graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        new.meta = dict(node.meta)
        source[new] = node
        id_of[new] = ids.setdefault(what, len(ids))
        same.setdefault(id_of[new], new)
    for new in reversed(list(graph.nodes)):  # (an op the full program reads nothing of stays: a write)
        if new.op in ("call_function", "placeholder") and not new.users and source[new].users:
            graph.erase_node(new)
            del source[new]
    return graph, env, source


def _outputs_once(graph: torch.fx.Graph, layouts: list) -> tuple[list, list]:
    """`graph`'s outputs each made once per layout requested (the updates of the left-out layers'
    weights are the second's, as its update is theirs): their layouts, and where each of the full
    program's outputs is among them."""
    output = next(iter(graph.find_nodes(op="output")))
    place: dict = {}
    values, kept, at = [], [], []
    for a, lay in zip(output.args[0], layouts):
        key = (a, lay)
        if key not in place:
            place[key] = len(values)
            values.append(a)
            kept.append(lay)
        at.append(place[key])
    output.args = (type(output.args[0])(values), *output.args[1:])
    return kept, at


def _plans_of(nodes: list, env: dict, stand_in: dict, place_of: dict, layout_of: dict, graph) -> dict | None:
    """Where each node of the full program takes its plan in the contracted one (`expanded`): a
    chain's node left out, its stand-in's; a node there, or made one with a node there, that
    node's; a node the contracted program no longer reads, that of the first node there computing
    what it does with every node left out read as its stand-in. None where some node finds none."""
    alive = set(graph.nodes)
    ids: dict = {}
    id_of: dict = {}
    first: dict = {}  # an id -> the first node there that computes it
    for node in nodes:
        if node.op == "output":
            continue
        if node in place_of:
            what = ("node", stand_in.get(node, node).name)
        elif node.op == "placeholder":
            what = _input(node, layout_of[node])
        else:
            shown = lambda a: ("value", id_of[a])  # noqa: E731
            what = _computes(node, node.args, node.kwargs, shown)
        id_of[node] = ids.setdefault(what, len(ids))
        if node not in stand_in and env[node] in alive:
            first.setdefault(id_of[node], node)
    plan_of = {}
    for node in nodes:
        if node.op == "output":
            continue
        own = env[stand_in.get(node, node)]
        if own not in alive:
            twin = first.get(id_of[node])
            if twin is None:
                return None
            own = env[twin]
        plan_of[node] = own
    return plan_of


def _input(node: torch.fx.Node, layout) -> tuple:
    """What an input is, to tell alike ones: its layout and shape (not which it is)."""
    return "input", layout, _shape(node)


def _computes(node: torch.fx.Node, args, kwargs, shown) -> tuple:
    """What `node` computes with `args` and `kwargs` for its arguments, each node among them as
    `shown` tells it: its op, its shape and them."""
    return node.target, _shape(node), repr(map_arg(args, shown)), repr(map_arg(kwargs, shown))


def _shape(node: torch.fx.Node) -> tuple | None:
    val = node.meta.get("val")
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None


class _NotAlike(Exception):
    """A call left out is read before any kept call of its chain: not a repeat of the others."""
