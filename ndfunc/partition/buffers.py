"""Which memory each value of a local program lives in, and how long it is read.

Views, getitems, a collective's wait and in-place ops return their first input's memory; every
other op makes a buffer of its own. The passes that reuse memory (in place, donation) and the
peak-memory estimate all reason about these buffers, so they share this one account.
"""

from __future__ import annotations

import operator

import torch

aten = torch.ops.aten
_ALIASES = (operator.getitem, torch.ops._c10d_functional.wait_tensor.default, aten._unsafe_view.default)


def shape_dtype(node: torch.fx.Node) -> tuple | None:
    """(shape, dtype) of a node's tensor result, from its metadata or the lowering's note
    (`meta['ndfunc_local']`, for passes that run before metadata is filled)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape), val.dtype
    return node.meta.get("ndfunc_local")


def aliases_input(node: torch.fx.Node) -> bool:
    """Whether the node's result shares its first input's memory."""
    t = node.target
    if t in _ALIASES:
        return True
    schema = getattr(t, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def lifetimes(nodes: list[torch.fx.Node]) -> tuple[dict, dict]:
    """`(root, last)`: the node whose buffer each node's result is, and for each such buffer the
    index of the last node reading it through any alias (results: to the end; inputs, which their
    caller holds: to the end; a buffer nobody reads: where it is made)."""
    root: dict = {}
    last: dict = {}
    for i, n in enumerate(nodes):
        if n.op == "output":
            for a in n.all_input_nodes:
                last[root[a]] = len(nodes)
            continue
        aliasing = n.op == "call_function" and n.args and isinstance(n.args[0], torch.fx.Node) and aliases_input(n)
        root[n] = root[n.args[0]] if aliasing else n
        last.setdefault(root[n], len(nodes) if n.op == "placeholder" else i)
        for a in n.all_input_nodes:
            last[root[a]] = max(last[root[a]], i)
    return root, last


def readers(node: torch.fx.Node, through_copies: bool = True) -> list[torch.fx.Node]:
    """Every node that reads `node`'s memory, through its aliases (not the program's output).
    `through_copies=False`: a `copy_` into it starts a new value, whose readers are not counted."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output":
                continue
            out.append(u)
            if aliases_input(u) and u.args[0] is n and (through_copies or u.target is not aten.copy_.default):
                todo.append(u)
    return out
