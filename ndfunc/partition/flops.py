"""Floating-point work of one graph node, from its values' shapes.

PyTorch's flop formulas (`torch.utils.flop_counter`) for matmuls, convolutions and the CUDA
attention kernels, plus the CPU flash-attention kernels they lack (forward 4·B·H·Lq·Lk·K, backward
2.5 times that, as for the CUDA ones). Other ops count nothing: next to the matmuls they are noise.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten


def _attention(q: torch.Tensor, k: torch.Tensor) -> int:
    b, h, lq, d = q.shape
    return 4 * b * h * lq * k.shape[-2] * d


def node_flops(node: torch.fx.Node) -> int:
    if node.op != "call_function":
        return 0
    target = node.target
    attention = (aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    if target not in attention and getattr(target, "overloadpacket", None) not in flop_registry:
        return 0
    vals = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta.get("val"), (node.args, node.kwargs))
    if target is aten._scaled_dot_product_flash_attention_for_cpu.default:
        return _attention(vals[0][0], vals[0][1])
    if target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        return _attention(vals[0][1], vals[0][2]) * 5 // 2
    formula = flop_registry.get(getattr(target, "overloadpacket", None))
    if formula is None:
        return 0
    try:
        return int(formula(*vals[0], out_val=node.meta.get("val"), **vals[1]))
    except Exception:  # noqa: BLE001 - a formula that does not take these arguments counts nothing
        return 0


def graph_flops(graph: torch.fx.Graph) -> int:
    return sum(node_flops(n) for n in graph.nodes)
