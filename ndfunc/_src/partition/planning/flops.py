"""Floating-point work of one graph node, from its values' shapes.

An op's registered formula (`ndfunc._src.partition.planning.ops`: `ndfunc.attention`), else PyTorch's
(`torch.utils.flop_counter`: matmuls, convolutions, its own attention kernels). Other
ops count nothing: next to the matmuls they are noise.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

from ndfunc._src import attention
from ndfunc._src.partition.planning.ops import rule_of

aten = torch.ops.aten

# PyTorch's own attention kernels, forward and backward, as a program on CUDA may call them
_TORCH_ATTENTION = frozenset(getattr(aten, name) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward") if hasattr(aten, name))


def node_flops(node: torch.fx.Node) -> int:
    if node.op != "call_function":
        return 0
    target = node.target
    rule = rule_of(target)
    if rule is not None and rule.flops is not None:
        return rule.flops(node)
    if getattr(target, "overloadpacket", None) not in flop_registry:
        return 0
    vals = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))  # (fx's walk, in C)
    formula = flop_registry.get(getattr(target, "overloadpacket", None))
    if formula is None:
        return 0
    try:
        return int(formula(*vals[0], out_val=node.meta.get("val"), **vals[1]))
    except Exception:  # noqa: BLE001 - a formula that does not take these arguments counts nothing
        return 0


def is_attention(target) -> bool:
    """Whether `target`'s flops are attention's: ndfunc's attention ops and the transforms' rings
    (registered so), PyTorch's attention kernels."""
    rule = rule_of(target)
    return (rule is not None and rule.attention) or getattr(target, "overloadpacket", None) in _TORCH_ATTENTION


def executed_share(node: torch.fx.Node) -> float:
    """The share of `node_flops` the op's slowest rank runs: what its registered rule says (a ring
    skipping what no query sees, `OpRule.executed`); half for an attention kernel told
    `is_causal`, which skips the blocks above the diagonal its formula counts; else all."""
    rule = rule_of(node.target)
    if rule is not None and rule.executed is not None:
        return rule.executed(node)
    schema = getattr(node.target, "_schema", None)
    if (is_attention(node.target) and schema is not None and any(a.name == "is_causal" for a in schema.arguments)
            and attention.argument(node, "is_causal")):
        return 0.5
    return 1.0


def graph_flops(graph: torch.fx.Graph) -> int:
    return sum(node_flops(n) for n in graph.nodes)
