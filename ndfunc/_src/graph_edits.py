"""Small edits of a traced FX graph: what a node aliases, and nodes added with their fake values.

The tracer's rewrites of in-place writes (`writes`, `copy_slices`) read a node's aliasing from its
ATen schema and add nodes whose values they compute on the graph's own fake tensors.
"""

from __future__ import annotations

import contextlib

import torch

from ndfunc._src import cast_ops, write_ops
from ndfunc._src.view_ops import returns_view


def aliases(node: torch.fx.Node) -> bool:
    """Whether `node`'s result may share memory with an input (a view, an in-place op's result)."""
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def is_view(node: torch.fx.Node) -> bool:
    """Whether `node` is a view of its first argument (aliases it without writing)."""
    return returns_view(node.target)


def writes_into(node: torch.fx.Node, tensor: torch.fx.Node) -> bool:
    """Whether `node` writes in place into its first argument, `tensor`."""
    return bool(node.args) and node.args[0] is tensor and write_ops.writes_first(node.target)


def owned(node: torch.fx.Node) -> bool:
    """Whether `node` is a tensor the step made and reads only through `node`: made by an op that
    returns new memory, or a view of such a tensor that nothing else reads (`mm`'s result as
    `_unsafe_view` gives it its shape)."""
    while node.op == "call_function" and aliases(node):
        source = node.args[0] if node.args else None
        if not (is_view(node) and isinstance(source, torch.fx.Node) and len(source.users) == 1):
            return False
        node = source
    return node.op == "call_function"


def call(gm: torch.fx.GraphModule, made: list, target, *args, **kwargs) -> torch.fx.Node:
    """A node calling `target`, at the graph's insertion point, noted in `made`."""
    node = gm.graph.call_function(target, args, kwargs)
    made.append(node)
    return node


def annotate(made: list, like: torch.fx.Node, order: dict | None = None) -> None:
    """Give the nodes `made` in place of `like` its annotations (a backward's, a remat region's),
    their values on `like`'s fake tensors (a factory's too: nothing real is allocated) and, in
    `order`, places between `like` and the node before it, in the order they were made."""
    mode = getattr(like.meta.get("val"), "fake_mode", None)
    for i, node in enumerate(made, start=1):
        if order is not None:
            order[node] = order[like] - 1 + i / (len(made) + 1)
        node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        with mode if mode is not None else contextlib.nullcontext():
            node.meta["val"] = node.target(*args, **kwargs)


def moved(gm: torch.fx.GraphModule, made: list, x: torch.fx.Node, like: torch.Tensor,
          dtype: bool = True) -> torch.fx.Node:
    """`x` on `like`'s device (and, with `dtype`, of its dtype): a copy where either differs."""
    have = x.meta["val"]
    change = {}
    if have.device != like.device:
        change["device"] = like.device
    if dtype and have.dtype != like.dtype:
        change["dtype"] = like.dtype
    return call(gm, made, cast_ops.CAST, x, **change) if change else x
