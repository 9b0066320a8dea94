"""The predicted step of one layout: compute, each collective on its link, what overlap hides.

`estimate` is a pure function of numbers. Each collective's bytes and seconds are
`collective_cost`'s, on the link its group crosses (`Layout.machine`), as the partitioner and
the replay price one. Its model, per rank and per optimizer step:

- compute = executed matmul flops / (peak x `Efficiency.matmul`) + executed attention flops /
  (bf16 peak x `Efficiency.attention`) (`TransformerShape.executed_flops_per_token`), the work
  of `global_batch * seq_len / dp_size` tokens split over `cp x tp` ranks (a mixture's experts
  at the bf16 peak under float8 too: they run in the compute dtype);
- TP (Megatron with sequence parallelism): per layer an all-gather before and a reduce-scatter
  after attention and after the MLP, the same in backward and again in a full remat's recompute,
  each of `micro_batch * seq_len / cp * dim * 2 B`, plus one pair for embedding and output in
  each direction; on the compute stream's critical path, never overlapped;
- CP (ring attention): `cp - 1` hops of the local K and V (`2 * tokens * kv_dim / tp * 2 B`) per
  layer forward, twice that in backward (K, V and their gradients), again under full remat;
  overlapped with the attention it feeds, so only what exceeds the attention time shows;
- FSDP over `dp_shard x cp`: all-gather of bf16 weights in forward, again in backward when
  resharded after forward, reduce-scatter of fp32 gradients (torchtitan's default reduce dtype),
  every micro-batch; prefetched behind compute except the first gather and the last reduce (the
  embedding's and one layer's); without prefetch every all-gather waits;
- HSDP: an fp32 all-reduce of each gradient shard over `dp_replicate`, behind compute like the
  reduce-scatter; plain DP (no sharding): one fp32 all-reduce per step behind the last backward;
- a mixture of experts under TP: its MLP blocks' weights are whole over `tp` (each rank runs its
  own tokens through them), so their fp32 gradients (each rank's FSDP shard of them) are
  all-reduced over `tp` every micro-batch, behind compute like HSDP's, counted with TP's time;
- the optimizer: AdamW reads weight, gradient and two moments and writes three (28 B per local
  parameter) at HBM bandwidth.
"""

from __future__ import annotations

import dataclasses

from ndfunc._src.collective_cost import Link, sent_bytes
from ndfunc._src.planner.cluster import GiB, Cluster, check_cluster
from ndfunc._src.planner.layout import Layout, Options
from ndfunc._src.planner.memory import Memory, memory_per_rank
from ndfunc._src.planner.model import TransformerShape

FP32 = 4
ADAM_BYTES_PER_PARAM = 28  # read p, g, m, v (4 x 4 B), write p, m, v (3 x 4 B)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of peak the kernels reach; one setting for every layout and every row.

    `matmul` 0.40: a round figure for what a training step's GEMMs sustain of datasheet peak on
    H100-class parts, once the small ones, launches and stragglers are counted (torchtitan reports
    33-39% MFU for Llama 3 8B on power-capped H100s, MFU that includes slower attention).
    `attention` 0.20 of bf16 peak per *executed* (causal) flop: FlashAttention-2, what PyTorch's
    SDPA runs, reaches at best 35% of H100's peak in its forward pass (Shah et al. 2024,
    "FlashAttention-3", sec. 1); backward, causal tiles and ring attention's per-block merges are
    slower. Both are single constants for every layout and every validation row, not fitted per
    row; the attention figure is pinned mostly by the long-sequence rows of
    benchmarks/plan_validation.py, the only published rows attention dominates.

    Example:
        >>> Efficiency()
        Efficiency(matmul=0.4, attention=0.2)
    """

    matmul: float = 0.40
    attention: float = 0.20

    def __post_init__(self) -> None:
        for field in ("matmul", "attention"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Efficiency.{field} must be in (0, 1], got {getattr(self, field)!r}.")


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step: compute plus what each kind of communication leaves exposed."""

    compute: float
    tp: float
    cp: float
    fsdp: float
    dp: float
    optimizer: float

    @property
    def total(self) -> float:
        return sum(dataclasses.astuple(self))

    def __str__(self) -> str:
        parts = ", ".join(f"{f.name} {getattr(self, f.name):.3f}" for f in dataclasses.fields(self))
        return f"{self.total:.3f} s ({parts})"


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One layout with its options, priced: memory per rank, step time, throughput, traffic.

    `intra_bytes` / `inter_bytes` are what each rank sends per step over NVLink / the fabric;
    `mfu` uses the model-flops convention (`TransformerShape.model_flops_per_token`) over the
    device's dense bf16 peak, as torchtitan reports it.
    """

    layout: Layout
    options: Options
    memory: Memory
    time: StepTime
    tokens_per_s_per_gpu: float
    mfu: float
    intra_bytes: float
    inter_bytes: float
    fits: bool

    def __str__(self) -> str:
        return (
            f"{self.layout} [{self.options}]: {self.memory.total / GiB:.1f} GiB/rank, {self.time.total:.3f} s/step, "
            f"{self.tokens_per_s_per_gpu:,.0f} tok/s/GPU, MFU {self.mfu:.1%}"
        )


def estimate(
    model: TransformerShape, layout: Layout, options: Options, *, cluster: Cluster, global_batch: int,
    seq_len: int, efficiency: Efficiency = Efficiency(),
) -> Estimate:
    """Price `layout` with `options` for `global_batch` sequences of `seq_len` tokens per step.

    Example:
        >>> m, c = TransformerShape.named("llama3-8b"), Cluster.of("h100", 8)
        >>> e = estimate(m, Layout(dp_shard=8), Options("selective", micro_batch=1), cluster=c,
        ...              global_batch=8, seq_len=8192)
        >>> e.fits, e.time.tp, e.inter_bytes
        (True, 0.0, 0.0)
    """
    check_cluster(cluster, "estimate")
    layout.check(model, cluster, global_batch, seq_len)
    local = global_batch // layout.dp_size
    if options.micro_batch * options.grad_accum != local:
        raise ValueError(
            f"micro_batch {options.micro_batch} x grad_accum {options.grad_accum} must equal the per-rank batch "
            f"{local} (global batch {global_batch} / dp_replicate x dp_shard {layout.dp_size})."
        )
    dev, accum = cluster.device, options.grad_accum
    if options.float8 and dev.peak_fp8_flops is None:
        raise ValueError(f"{dev.name} has no fp8 tensor cores; price this layout with float8=False.")
    traffic = {"intra": 0.0, "inter": 0.0}
    links = layout.machine(cluster)  # each collective priced on its group's link (`collective_cost`)

    def on(axis: str) -> tuple[str, Link]:
        return links.link(layout.group(axis))

    # compute: this rank's share of the batch's executed flops
    work = local * seq_len / (layout.cp * layout.tp)
    layers, experts, output, attention = model.executed_flops_per_token(seq_len, options.remat)
    mm_peak = dev.peak_fp8_flops if options.float8 else dev.peak_bf16_flops
    attention_time = work * attention / (dev.peak_bf16_flops * efficiency.attention)
    compute = work * (layers / mm_peak + (experts + output) / dev.peak_bf16_flops) / efficiency.matmul + attention_time

    # TP: all-gather + reduce-scatter pairs (an all-reduce's cost) on the critical path
    tokens = options.micro_batch * seq_len / layout.cp
    tp_time = 0.0
    if layout.tp > 1:
        pairs = model.n_layers * (6 if options.remat == "full" else 4) + 2
        size = tokens * model.dim * options.compute_bytes
        level, link = on("tp")
        tp_time = accum * pairs * link.all_reduce(layout.tp, size)
        traffic[level] += accum * pairs * sent_bytes("all_reduce", layout.tp, size)

    # CP: ring hops of K and V, hidden behind the attention they feed
    cp_time = 0.0
    if layout.cp > 1:
        hops = (layout.cp - 1) * (4 if options.remat == "full" else 3) * model.n_layers * accum
        size = 2 * tokens * model.kv_dim / layout.tp * options.compute_bytes
        level, link = on("cp")
        cp_time = max(0.0, hops * link.send(size) - attention_time)
        traffic[level] += hops * sent_bytes("permute", layout.cp, size)

    # FSDP (and HSDP's all-reduce of the shards), hidden behind compute where prefetch allows
    fsdp_time = dp_time = 0.0
    behind = 0.0  # compute time the collectives hidden behind it take (DDP's: of the last backward)
    params = model.local_params(layout.tp)
    if layout.fsdp_size > 1:
        n, (level, link) = layout.fsdp_size, on("fsdp")
        gathers = 2 if options.reshard_after_forward else 1
        gather, reduce = link.all_gather(n, params * options.compute_bytes), link.reduce_scatter(n, params * FP32)
        # the first units gathered and the last reduced (the embedding's and one layer's) have no
        # compute to hide behind; without prefetch no all-gather has
        edge = model.embedding_params / layout.tp + model.local_layer_params(layout.tp)
        first, last = link.all_gather(n, edge * options.compute_bytes), link.reduce_scatter(n, edge * FP32)
        if options.prefetch:
            exposed, hidden = first + last, gathers * gather + reduce - first - last
        else:
            exposed, hidden = gathers * gather + last, reduce - last
        fsdp_time = accum * exposed + max(0.0, accum * hidden - compute)
        behind = accum * hidden
        traffic[level] += accum * (gathers * sent_bytes("all_gather", n, params * options.compute_bytes)
                                   + sent_bytes("reduce_scatter", n, params * FP32))
        if layout.dp_replicate > 1:  # HSDP: all-reduce each fp32 gradient shard across replicas
            size = params / n * FP32
            level, rep = on("dp_replicate")
            budget = max(0.0, compute - behind)
            busy = accum * rep.all_reduce(layout.dp_replicate, size)
            dp_time, behind = max(0.0, busy - budget), behind + busy
            traffic[level] += accum * sent_bytes("all_reduce", layout.dp_replicate, size)
    elif layout.dp_replicate > 1:  # DDP: one all-reduce per step, behind the last backward
        (level, rep), r = on("dp_replicate"), layout.dp_replicate
        last_backward = compute / accum * 2 / 3
        tail = rep.all_reduce(r, model.local_layer_params(layout.tp) * FP32)
        dp_time = tail + max(0.0, rep.all_reduce(r, params * FP32) - last_backward)
        behind = min(last_backward, rep.all_reduce(r, params * FP32))
        traffic[level] += sent_bytes("all_reduce", r, params * FP32)

    whole = model.n_layers * model.layer_whole_over_tp_params
    if layout.tp > 1 and whole:  # a mixture's MLP blocks, whole over tp: their gradients summed there
        size, (level, link) = whole / layout.fsdp_size * FP32, on("tp")
        if layout.fsdp_size > 1:  # each micro-batch's shards, behind compute as HSDP's
            rounds, budget = accum, max(0.0, compute - behind)
        else:  # once a step, behind the last backward (as DDP's, which goes first)
            rounds, budget = 1, max(0.0, compute / accum * 2 / 3 - behind)
        tp_time += max(0.0, rounds * link.all_reduce(layout.tp, size) - budget)
        traffic[level] += rounds * sent_bytes("all_reduce", layout.tp, size)

    local_params = model.local_params(layout.tp) / layout.fsdp_size
    optimizer = local_params * ADAM_BYTES_PER_PARAM / dev.memory_bandwidth
    time = StepTime(compute, tp_time, cp_time, fsdp_time, dp_time, optimizer)
    memory = memory_per_rank(model, layout, options, seq_len)
    tps = global_batch * seq_len / time.total / layout.num_gpus
    return Estimate(
        layout=layout, options=options, memory=memory, time=time, tokens_per_s_per_gpu=tps,
        mfu=model.model_flops_per_token(seq_len) * tps / dev.peak_bf16_flops,
        intra_bytes=traffic["intra"], inter_bytes=traffic["inter"], fits=memory.total <= dev.memory_bytes,
    )
