"""The sharding rule, flops and kernel of `ndfunc.attention` and its backward (`_src/attention.py`
traces and runs them; `nf.ring_attention` lowers the ring on the axis it marks).
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ndfunc._src import attention
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.planning.strategies import Strategy, tensor_inputs, tensor_outputs


def rule(node: torch.fx.Node, sizes: tuple[int, ...]) -> list[Strategy]:
    """Attention (`ndfunc.attention`) forward and backward: q, k, v (B, H, L, K) split alike on batch or
    heads (grouped key/value heads split by the same factor); the mask follows where it has the
    dim, else stays whole; logsumexp (B, H, L) follows q.

    With an explicit mask (not `is_causal`, whose mask assumes the block starts at position 0) the
    sequence may be split too: each rank's queries against every key and value (gathered), the mask's
    rows following the queries; in backward the key and value gradients are then partial sums
    over that axis. On the axis `nf.ring_attention` marked, where it divides the sequence, keys and
    values (and their gradients) stay split instead: the lowering writes a ring there."""
    backward = node.target is attention.attention_backward_op
    ins = tensor_inputs(node)
    outs = tensor_outputs(node)
    q = attention.argument(node, "query")
    kv = {attention.argument(node, "key"), attention.argument(node, "value")}
    mask = attention.argument(node, "attn_mask")
    causal = attention.argument(node, "is_causal")
    q_shape = tuple(q.meta["val"].shape)
    seq = Shard(2)
    ring = getattr(prog.kept_split(node), "live", None)  # nf.ring_attention's axis: keys stay split
    if ring is not None and any(t.meta["val"].shape[2] % sizes[ring] for t in (q, *kv)):
        ring = None  # a sequence the axis does not divide (a vision tower's CLS and patches): as without the ring
    per_axis = [Replicate(), Shard(0), Shard(1)] + ([] if causal else [seq])
    # on the ring's axis the sequence is what is split (else the cheapest plan may well split the
    # batch there instead, which is data parallelism, not context parallelism)
    options = [[seq] if axis == ring else per_axis for axis in range(len(sizes))]
    found = []
    for combo in itertools.product(*options):
        def follow(t: torch.Tensor | None, key_side: bool, grad: bool = False, broadcast: bool = False):
            """`t`'s layout under `combo`; a `broadcast` mask lines its dims up with q's from the
            right, as broadcasting does (an (L, S) mask's first dim is q's sequence)."""
            if t is None:
                return None
            lay = []
            for axis, p in enumerate(combo):
                dim = p.dim - (4 - t.ndim) if broadcast and isinstance(p, Shard) else getattr(p, "dim", None)
                if p == seq and key_side and axis == ring:
                    lay.append(seq)  # keys, values and their gradients travel the ring
                elif p == seq and key_side:
                    lay.append(Partial("sum") if grad else Replicate())  # every key, each rank's queries
                elif isinstance(p, Shard) and (not 0 <= dim < t.ndim or t.shape[dim] != q_shape[p.dim]) and not (
                        p.dim == 1 and t.ndim == 4 and t.shape[1] > 1):
                    lay.append(Replicate())  # a broadcast mask dim: every block needs all of it
                else:
                    lay.append(Shard(dim) if isinstance(p, Shard) else p)
            return tuple(lay)
        out_lays = tuple(follow(o, backward and j in (1, 2), grad=True) for j, o in enumerate(outs))
        found.append(Strategy(out_lays, tuple(follow(a.meta["val"], a in kv, broadcast=a is mask) for a in ins)))
    return found


def attention_flops(q: torch.Tensor, k: torch.Tensor) -> int:
    """Attention of queries `q` (B, H, Lq, K) over keys `k` (.., Lk, K): 4·B·H·Lq·Lk·K."""
    b, h, lq, d = q.shape
    return 4 * b * h * lq * k.shape[-2] * d


def flops(node: torch.fx.Node) -> int:
    """Attention: 4·B·H·Lq·Lk·K, as torch's formula for its flash kernels."""
    return attention_flops(node.args[0].meta["val"], node.args[1].meta["val"])


def backward_flops(node: torch.fx.Node) -> int:
    """Its backward: 2.5 times the forward, as for torch's flash kernels."""
    return attention_flops(node.args[1].meta["val"], node.args[2].meta["val"]) * 5 // 2


def kernel(node: torch.fx.Node, args) -> tuple:
    """Attention's kernel for the mesh's device (the device its inputs were traced on): the CPU
    flash kernel; on CUDA flash, memory-efficient or cuDNN (`attention.choose`)."""
    q = attention.argument(node, "query").meta["val"]
    masked = attention.argument(node, "attn_mask") is not None
    v = attention.argument(node, "value").meta["val"]
    return attention.with_kernel(node.target, args, attention.choose(q.device.type, q.dtype, q.shape[-1], masked,
                                                                      v.shape[-1]))
