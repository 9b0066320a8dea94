"""`nf.ring_attention`: sequence-sharded attention as a ring of key/value blocks.

Without it, attention whose sequence is split over an axis gathers every key and value on every
rank (memory and traffic of the whole sequence per rank). With it, each rank keeps its blocks of
Q, K and V; the K, V blocks travel the ring for `axis_size` steps, and each step's partial result
merges into the running one by an online softmax on the log-sum-exp, in fp32 (fp64 for fp64). Backward is a ring
too: each rank computes its blocks' gradients from the saved output and log-sum-exp, and the
key/value gradients travel with their blocks until they are home. The causal mask comes from
positions (the mask the model builds from them), so any layout of the sequence is right;
`nf.zigzag` lays a batch out so that rank r holds chunks r and 2n-1-r; with `load_balance='zigzag'`
each block is computed in quarters (a rank's two chunks of queries by the block's two of keys) and,
on real ranks, the quarters no query sees are skipped: 2n + 1 of 4n on every rank, half the work.

`is_causal=True` without a mask (Hugging Face's sdpa path) is the causal mask of the sequence in
order: each rank's queries are positions `rank * block ..`, and the mask comes from those. Neither
(an encoder's attention, every key seen) is a mask that hides nothing; no block is skipped.

The pass marks each attention (forward and backward) in the traced program; the partitioner may
then keep its keys and values split over the axis, and the lowering writes the ring there.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import warnings

import torch
from torch.distributed.tensor import Shard

from ndfunc._src import attention
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.planning.attention_rule import attention_flops
from ndfunc._src.partition.planning.layout import local_shape
from ndfunc._src.partition.planning.ops import register
from ndfunc._src.partition.planning.strategies import tensor_inputs, value_of
from ndfunc._src.point_to_point import across_ranks, permute_blocks
from ndfunc._src.sharding.errors import ShardingWarning, user_stacklevel
from ndfunc._src.torch_compat import FakeTensor, LocalTensor
from ndfunc._src.transforms.base import Transform
from ndfunc._src.view_ops import RESHAPES

ATTENTION, ATTENTION_BACKWARD = attention.attention_op, attention.attention_backward_op


@dataclasses.dataclass(frozen=True)
class ring_attention(Transform):  # noqa: N801 - a transform is named like the function it stands for
    """Attention with its sequence split over `axis` runs as a ring over that axis.

    `load_balance='zigzag'`: the batch is laid out by `nf.zigzag` and a rank skips the quarters of
    key/value blocks its queries cannot see, about half of them (on real ranks; simulated ranks
    compute every one, to the same result). `None`: every block is computed, whatever the layout.

    Use: `nf.jit(step, mesh=mesh, ..., transforms=[nf.ring_attention('cp')])`, with a batch that
    carries `positions` (the causal mask is built from them).
    """

    axis: str = "cp"
    load_balance: str | None = "zigzag"

    def __post_init__(self):
        if not isinstance(self.axis, str):
            raise TypeError(f"ring_attention: axis is a mesh axis name (e.g. 'cp'), got {self.axis!r}.")
        if self.load_balance not in ("zigzag", None):
            raise ValueError(f"ring_attention: load_balance is 'zigzag' or None, got {self.load_balance!r}.")

    def axes_used(self) -> tuple[str, ...]:
        return (self.axis,)

    def traced(self, program) -> None:
        live = program.axis_position(self.axis)
        if live is None:
            return  # a size-1 axis: nothing is split, nothing to do
        dim = program.mesh.axis_names.index(self.axis)
        mesh = program.mesh  # global ranks by coordinate (row-major on an abstract mesh, as on a Mesh)
        grid = mesh.device_mesh.mesh if hasattr(mesh, "device_mesh") else \
            torch.arange(mesh.size).reshape(mesh.axis_sizes)
        # each rank's next along the axis, its other coordinates the same
        peers = tuple(zip(grid.flatten().tolist(), grid.roll(-1, dim).flatten().tolist()))
        ring = _Ring(live=live, axis=self.axis, size=grid.shape[dim], peers=peers, skip=self.load_balance == "zigzag")
        marked = 0
        for node in program.traced.graph.nodes:
            if node.target in (ATTENTION, ATTENTION_BACKWARD):
                prog.keep_split(node, ring)
                prog.set_local_op(node, _lower)
                marked += 1
        if not marked:
            raise ValueError(
                f"nf.ring_attention({self.axis!r}): {program.name} has no scaled-dot-product attention to run "
                f"as a ring. Attention written as matmuls and a softmax (Hugging Face's "
                f"attn_implementation='eager') is not one op: use torch.nn.functional.scaled_dot_product_attention "
                f"(attn_implementation='sdpa'), or leave the transform out (the sequence split then gathers keys "
                f"and values).")

    def partitioned(self, program) -> None:
        """Warn where the batch's sequences, two or more a rank, are gathered over the axis to be
        flattened to tokens (`_strided_gathers`)."""
        gathered = _strided_gathers(program, self.axis)
        sequences = _sequences_a_rank(program, self.axis)
        if gathered and sequences > 1:  # (with one, a gather there is the plan's choice, not the batch's)
            names = ", ".join(n.name for n in gathered[:3]) + (", ..." if len(gathered) > 3 else "")
            warnings.warn(
                f"nf.ring_attention({self.axis!r}): {program.name} takes {sequences} sequences a rank, and where "
                f"it flattens (batch, sequence) to tokens (a loss's targets and scores) a rank's tokens are "
                f"strided, which no layout holds: the plan gathers the sequence over {self.axis!r} before "
                f"{len(gathered)} such flattens ({names}), moving (and often computing) what one sequence a rank "
                f"keeps split. Pass one sequence a rank per step under context parallelism, and nf.accumulate "
                f"micro-batches for a larger batch (as nf.plan and torchtitan do).",
                ShardingWarning, stacklevel=user_stacklevel())


def _strided_gathers(program, axis: str) -> list[torch.fx.Node]:
    """The flattens of `program` (a view or reshape) whose input the plan holds split over mesh
    axis `axis` on a dim merged with the dims before it, where a rank's block would be two or more
    runs of the merged dim (its sequences, each a run of tokens: strided in the result, which a
    layout cannot hold), and gathers there first."""
    live = program.axis_position(axis)
    if live is None or program.plan is None:
        return []
    plan, found = program.plan, []
    for node in program.traced.graph.nodes:
        if node.target not in RESHAPES or node not in plan.strategy or prog.is_manual(node):
            continue  # (inside an nf.shard_map region every value is a rank's own block)
        (x,) = tensor_inputs(node)
        have, want = plan.out_layout(value_of(x)), plan.strategy[node].ins[0]
        if not isinstance(have[live], Shard) or isinstance(want[live], Shard):
            continue
        shape = tuple(x.meta["val"].shape)
        if _runs(shape, tuple(node.meta["val"].shape), local_shape(shape, have, program.sizes), have[live].dim) > 1:
            found.append(node)
    return found


def _sequences_a_rank(program, axis: str) -> int:
    """The most sequences a rank takes of an input of integers (token ids, positions, targets)
    whose second dim, the sequence, is split over mesh axis `axis`: its first dim's block; 0 if
    none is."""
    live = program.axis_position(axis)
    most = 0
    for node in program.traced.graph.find_nodes(op="placeholder") if live is not None else ():
        val = node.meta.get("val")
        if node not in program.plan.strategy or not isinstance(val, torch.Tensor) or (
                val.ndim < 2 or val.is_floating_point() or val.is_complex()):
            continue
        lay = program.plan.strategy[node].outs[0]
        if isinstance(lay[live], Shard) and lay[live].dim == 1:
            most = max(most, local_shape(tuple(val.shape), lay, program.sizes)[0])
    return most


def _runs(shape: tuple, out_shape: tuple, local: tuple, d: int) -> int:
    """Into how many runs a block (`local`) of `shape` split on dim `d` falls in the reshape to
    `out_shape`: the product of its sizes on the dims `d` is merged with before it (1 where `d`
    starts an output dim)."""
    ends = set(itertools.accumulate(out_shape, operator.mul, initial=1))  # where output dims start
    start = d
    while start > 0 and math.prod(shape[:start]) not in ends:
        start -= 1
    return math.prod(local[start:d])


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The mark on an attention node: its keys stay split on partitioned axis `live` (`axis`)."""

    live: int
    axis: str
    size: int
    peers: tuple  # (global rank, its next along the axis)
    skip: bool  # skip the blocks no query sees


def _lower(ctx: prog.LoweringContext, node, strategy, op, args, kwargs):
    """The local op for a ring-marked attention: the ring where its keys are split over the ring
    axis (and what it sends, for `as_text` and `cost_analysis`), else the op itself."""
    ring = prog.kept_split(node)
    backward = node.target is ATTENTION_BACKWARD
    k_slot = 2 if backward else 1
    if strategy.ins[k_slot][ring.live] != SEQ:
        return op, args, kwargs, None
    named = dict(zip((a.name for a in node.target._schema.arguments), args))
    q, k, v = named["query"], named["key"], named["value"]
    kv = k.meta["val"]
    mask, causal = named.get("attn_mask"), bool(named.get("is_causal"))
    # every block is masked (by the mask's columns, or the causal mask's), or none: a kernel that takes
    # a mask either way (the one the ring's merges were checked with on GPUs)
    kernel = attention.choose(kv.device.type, kv.dtype, kv.shape[-1], masked=True)
    common = dict(mask=mask, causal=causal, scale=named.get("scale"), kernel=kernel, coords=ctx.coords,
                  axis=ctx.axis_names.index(ring.axis), size=ring.size, peers=ring.peers,
                  skip=ring.skip and (mask is not None or causal))  # (a mask hiding nothing: no block to skip)
    shape = local_shape(tuple(kv.shape), strategy.ins[k_slot], ctx.sizes)
    block = math.prod(shape) * kv.element_size()
    n = ring.size
    # forward: K and V go round n-1 times; backward: K and V n-1 times, dK and dV n times (summed
    # in fp32, or fp64)
    moved = 2 * (n - 1) * block + (2 * n * block * attention.accumulator(kv.dtype).itemsize // kv.element_size()
                                   if backward else 0)
    sent = (2, *shape)  # a key block and a value block
    comm = prog.Comm("ppermute", (ring.axis,), sent, sent, kv.dtype, kv.device, None, 2 * block, moved)
    if backward:
        return ring_backward, (named["grad_out"], q, k, v, named["out"], named["logsumexp"]), common, comm
    return ring_forward, (q, k, v), common, comm


SEQ = torch.distributed.tensor.Shard(2)


# --- the ring, on each rank's blocks (plain tensors on real ranks, LocalTensors in simulation) ---

def _shift(x: torch.Tensor, peers: tuple) -> torch.Tensor:
    """Each rank's block to the next rank along the ring (`peers`: (global rank, next) pairs)."""
    return permute_blocks(x, peers)


def _block_mask(mask, causal: bool, q: torch.Tensor, k: torch.Tensor, coords, axis: int, size: int,
                step: int) -> torch.Tensor | None:
    """Which keys of the block a rank holds at `step` (its own at 0, then the previous rank's, ...)
    its queries may attend, (.., rows, block columns): the mask's columns for it, or `is_causal`'s
    made for this block alone (the sequences in order: rank i holds queries i * rows .. and keys
    i * columns ..; torch's top-left causal mask, key j seen by query i where j <= i; never the
    whole rows x sequence, 2 GB a rank at 128k tokens over 8), or None (neither: every key)."""
    if mask is not None:
        return _block(mask, coords, axis, size, step)[0]
    if not causal:
        return None
    rows, cols = q.shape[2], k.shape[2]
    queries = coords[axis] * rows + torch.arange(rows, device=q.device)
    keys = torch.remainder(coords[axis] - step, size) * cols + torch.arange(cols, device=q.device)
    return (keys[None, :] <= queries[:, None]).reshape(1, 1, rows, cols)


def _block(mask: torch.Tensor, coords, axis: int, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask's columns for the key block a rank holds at `step` (its own at 0, then the
    previous rank's, ...): `(rows x block columns, source index)`."""
    source = torch.remainder(coords[axis] - step, size).reshape(1)
    b, h, rows, cols = mask.shape
    return mask.reshape(b, h, rows, size, cols // size).index_select(3, source).squeeze(3), source


def _visible(m) -> bool:
    """Whether any query sees any key of this block (always True where it cannot be known here, or
    with no mask)."""
    if m is None or isinstance(m, (LocalTensor, FakeTensor)):
        return True
    return bool((m if m.dtype == torch.bool else m > -math.inf).any())


def _halves(n: int, skip: bool) -> list[slice]:
    """The parts a block's rows or columns are computed in: with `skip`, its two halves (a zigzag
    rank's two chunks), so that a rank skips the quarters its queries cannot see; else the whole."""
    return [slice(0, n // 2), slice(n // 2, n)] if skip and n % 2 == 0 else [slice(0, n)]


@across_ranks
def ring_forward(q, k, v, *, mask, causal, scale, kernel, coords, axis, size, peers, skip):
    """(out, logsumexp) of this rank's queries against every rank's keys, the keys and values
    travelling the ring. Each block by `kernel` (the device's attention kernel; no score matrix
    held), in quarters with `skip` (those no query sees skipped on real ranks: half of every
    other rank's block under zigzag); the parts merge by their log-sum-exps, in fp32 (fp64 for
    fp64)."""
    acc, run, scale = attention.accumulator(q.dtype), attention.KERNELS[kernel], attention.default_scale(q, scale)
    rows, cols = _halves(q.shape[2], skip), _halves(k.shape[2], skip)
    out = [torch.zeros(q[:, :, r].shape, dtype=acc, device=q.device) for r in rows]
    lse = [torch.full(q[:, :, r].shape[:-1], -math.inf, dtype=acc, device=q.device) for r in rows]
    for step in range(size):
        block = _block_mask(mask, causal, q, k, coords, axis, size, step)
        for i, r in enumerate(rows):
            for c in cols:
                m = None if block is None else block[:, :, r, c]
                if skip and not _visible(m):
                    continue
                m = None if m is None else attention.additive(m, q.dtype)
                part_out, part_lse = run.forward(q[:, :, r], k[:, :, c], v[:, :, c], m, False, scale)
                part_out, part_lse = part_out.to(acc), part_lse.to(acc)
                if m is not None:
                    # a row that sees no key of this part: kernels say lse 0 (or -inf) and out 0
                    # (or nan); it is -inf, and adds nothing
                    seen = (m > -math.inf).any(-1).expand(part_lse.shape)
                    part_lse = part_lse.masked_fill(~seen, -math.inf)
                    part_out = part_out.masked_fill(~seen.unsqueeze(-1), 0.0)
                new = torch.logaddexp(lse[i], part_lse)
                keep = torch.exp(lse[i] - new).nan_to_num(0.0).unsqueeze(-1)
                take = torch.exp(part_lse - new).nan_to_num(0.0).unsqueeze(-1)
                out[i] = out[i] * keep + part_out * take
                lse[i] = new
        if step < size - 1:
            k, v = _shift(k, peers), _shift(v, peers)
    return torch.cat(out, 2).to(q.dtype), torch.cat(lse, 2)


@across_ranks
def ring_backward(grad_out, q, k, v, out, lse, *, mask, causal, scale, kernel, coords, axis, size, peers, skip):
    """(dq, dk, dv): each block's gradients by `kernel`'s backward, given the whole output and
    log-sum-exp (so each block's softmax is the global one); dk and dv travel with their keys and
    values, in fp32 (fp64 for fp64), and are home after `size` steps."""
    acc, run, scale = attention.accumulator(q.dtype), attention.KERNELS[kernel], attention.default_scale(q, scale)
    # a row that sees no key on any rank (left padding under a causal mask) has lse -inf, and out
    # 0 whatever its scores: a finite lse there makes every block's probabilities 0 (its keys all
    # masked), so its gradients are 0, as torch's kernels give, not exp(-inf + inf)'s nan
    lse = lse.masked_fill(lse == -math.inf, 0.0)
    rows, cols = _halves(q.shape[2], skip), _halves(k.shape[2], skip)
    dq = [torch.zeros(q[:, :, r].shape, dtype=acc, device=q.device) for r in rows]
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for step in range(size):
        block = _block_mask(mask, causal, q, k, coords, axis, size, step)
        dk_parts = [torch.zeros(k[:, :, c].shape, dtype=acc, device=k.device) for c in cols]
        dv_parts = [torch.zeros(v[:, :, c].shape, dtype=acc, device=v.device) for c in cols]
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                m = None if block is None else block[:, :, r, c]
                if skip and not _visible(m):
                    continue
                dq_part, dk_part, dv_part = run.backward(
                    grad_out[:, :, r], q[:, :, r], k[:, :, c], v[:, :, c], out[:, :, r], lse[:, :, r],
                    None if m is None else attention.additive(m, q.dtype), False, scale)
                dq[i] = dq[i] + dq_part.to(acc)
                dk_parts[j], dv_parts[j] = dk_parts[j] + dk_part.to(acc), dv_parts[j] + dv_part.to(acc)
        dk, dv = dk + torch.cat(dk_parts, 2), dv + torch.cat(dv_parts, 2)
        if step < size - 1:
            k, v = _shift(k, peers), _shift(v, peers)
        dk, dv = _shift(dk, peers), _shift(dv, peers)
    return torch.cat(dq, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _queries_keys(node: torch.fx.Node) -> tuple[torch.Tensor, torch.Tensor]:
    """A ring node's local queries and keys (metadata values)."""
    q, k = node.args[1:3] if node.target is ring_backward else node.args[:2]
    return q.meta["val"], k.meta["val"]


def _ring_flops(node: torch.fx.Node) -> int:
    """A rank's queries against every rank's keys: `size` blocks of the kernel's work (blocks the
    mask hides are counted: which ones depends on the rank); backward 2.5 times forward, as the
    kernels' own formulas."""
    work = node.kwargs["size"] * attention_flops(*_queries_keys(node))
    return work * 5 // 2 if node.target is ring_backward else work


def _ring_executed(node: torch.fx.Node) -> float:
    """The share of `_ring_flops` a rank runs: with `skip` under zigzag, 2 x size + 1 of the
    4 x size quarter blocks (`ring_forward`), on every rank; else all."""
    size, (q, _) = node.kwargs["size"], _queries_keys(node)
    halved = node.kwargs["skip"] and len(_halves(q.shape[2], True)) == 2
    return (2 * size + 1) / (4 * size) if halved else 1.0


register(ring_forward, flops=_ring_flops, attention=True, executed=_ring_executed)
register(ring_backward, flops=_ring_flops, attention=True, executed=_ring_executed)


# --- the zigzag layout -----------------------------------------------------------------------

def zigzag_order(length: int, size: int) -> torch.Tensor:
    """Token order that puts chunks r and 2n-1-r of a sequence cut in 2n chunks on rank r, when
    the sequence is then split into n contiguous blocks."""
    if length % (2 * size):
        raise ValueError(f"zigzag: a sequence of {length} tokens does not cut into 2 x {size} equal chunks; "
                         f"use a length divisible by {2 * size}.")
    chunks = torch.arange(length).reshape(2 * size, length // (2 * size))
    return torch.cat([torch.cat([chunks[r], chunks[2 * size - 1 - r]]) for r in range(size)])


def zigzag(batch: dict, size: int) -> dict:
    """`batch` (tokens, targets, ... of shape (B, L)) with its sequences in zigzag order for `size`
    ranks, and `positions` (each token's place in its original sequence) added if absent."""
    tokens = next(iter(batch.values()))
    order = zigzag_order(tokens.shape[1], size)
    out = {k: v.index_select(1, order) for k, v in batch.items()}
    out.setdefault("positions", order.expand(tokens.shape).contiguous())
    return out


def unzigzag(x: torch.Tensor, size: int) -> torch.Tensor:
    """Back to the original token order along dim 1 (per-token losses, logits)."""
    return x.index_select(1, torch.argsort(zigzag_order(x.shape[1], size)))
