"""Which memory each value of a local program lives in, and how long it is read.

Views, getitems, a collective's wait and in-place ops return their first input's memory, an
`out=` op its `out` argument's; every other op makes a buffer of its own. The passes that reuse
memory (in place, donation) and the peak-memory estimate all reason about these buffers, so they
share this one account.
"""

from __future__ import annotations

import functools
import operator

import torch

from ndfunc._src import view_ops, write_ops

aten = torch.ops.aten
_WAIT = torch.ops._c10d_functional.wait_tensor.default
# results that are their first input's memory though their schemas say none is
_ALIASES = (operator.getitem, _WAIT, *view_ops.UNDECLARED_ALIASES)


def aliased(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input whose memory the node's result is: a view's base, an in-place op's target, an
    `out=` argument; None for an op that makes a buffer of its own."""
    if node.op != "call_function":
        return None
    if node.target in _ALIASES:
        base = node.args[0] if node.args else None
        return base if isinstance(base, torch.fx.Node) else None
    slot = _aliased_slot(node.target)
    if slot is None:
        return None
    i, name, kwarg_only = slot
    if name in node.kwargs:
        base = node.kwargs[name]
    else:
        base = node.args[i] if i < len(node.args) and not kwarg_only else None
    return base if isinstance(base, torch.fx.Node) else None


@functools.cache
def _aliased_slot(target) -> tuple[int, str, bool] | None:
    """Which argument an op's result aliases, read from its schema once per op: (position, name,
    keyword-only), or None where it makes a buffer of its own."""
    schema = getattr(target, "_schema", None)
    if schema is None or not any(r.alias_info is not None for r in schema.returns):
        return None
    sets = {a for r in schema.returns if r.alias_info is not None for a in r.alias_info.before_set}
    aliasing = [(i, arg) for i, arg in enumerate(schema.arguments) if arg.alias_info is not None]
    # a list of views (`split`) names its alias set on the elements: the base is the first aliasing argument
    matched = [(i, arg) for i, arg in aliasing if sets & set(arg.alias_info.before_set)] or aliasing[:1]
    if not matched:
        return None
    i, arg = matched[0]
    return i, arg.name, arg.kwarg_only


def buffer_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose buffer `node`'s result is (itself, unless it is a view or writes in place)."""
    while (base := aliased(node)) is not None:
        node = base
    return node


def buffer_roots(nodes) -> dict[torch.fx.Node, torch.fx.Node]:
    """`buffer_of` of every node of `nodes` (a graph's, in order), in one pass (a base comes before
    its views): a chain of in-place updates is walked once, not once per link. The output node
    makes no buffer and has none."""
    root: dict = {}
    for n in nodes:
        if n.op == "output":
            continue
        base = aliased(n)
        root[n] = n if base is None else root[base]
    return root


def written_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """The positions of `gm`'s inputs that it writes into (an in-place op or `out=` on them or a view,
    BatchNorm's running statistics)."""
    placeholders = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    root = buffer_roots(gm.graph.nodes)
    written = set()
    for n in gm.graph.nodes:
        for value in write_ops.written_values(n) if n.op == "call_function" else ():  # (BatchNorm's: undeclared)
            if isinstance(value, torch.fx.Node) and (i := placeholders.get(root[value])) is not None:
                written.add(i)
    return sorted(written)


def lifetimes(nodes: list[torch.fx.Node]) -> tuple[dict, dict]:
    """`(root, last)`: the node whose buffer each node's result is, and for each such buffer the
    index of the last node reading it through any alias (results: to the end; inputs, which their
    caller holds, and constants: to the end; a buffer nobody reads: where it is made). A
    collective reads its inputs until its wait: it may run in the background from where it is
    issued (gloo's gathers and all-to-alls do; the functional all-reduce copies its input first:
    this is the safe side)."""
    root = buffer_roots(nodes)
    last: dict = {}
    for i, n in enumerate(nodes):
        if n.op == "output":
            for a in n.all_input_nodes:
                last[root[a]] = len(nodes)
            continue
        last.setdefault(root[n], len(nodes) if n.op in ("placeholder", "get_attr") else i)
        reads = n.all_input_nodes
        if n.target is _WAIT and n.args and isinstance(n.args[0], torch.fx.Node):  # the collective's inputs
            reads = [*reads, *n.args[0].all_input_nodes]
        for a in reads:
            last[root[a]] = max(last[root[a]], i)
    return root, last


def readers(node: torch.fx.Node, through_copies: bool = True) -> list[torch.fx.Node]:
    """Every node that reads `node`'s memory, through its aliases (not the program's output); a
    collective's wait among them, as it reads in the background until then.
    `through_copies=False`: a `copy_` into it starts a new value, whose readers are not counted."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output":
                continue
            out.append(u)
            out += [w for w in u.users if w.target is _WAIT]  # u is a collective, reading until then
            if aliased(u) is n and (through_copies or u.target is not aten.copy_.default):
                todo.append(u)
    return out
