"""The search: every ND layout of a cluster with the options that matter, priced and ranked.

Enumeration: every factorization `num_gpus = dp_replicate x dp_shard x cp x tp` with tp inside a
node and dividing `n_kv_heads`, cp dividing `seq_len`, and the global batch divisible by
`dp_replicate x dp_shard`; for each, every remat policy and, where FSDP runs, reshard-after-forward
and prefetch on and off. Micro-batches are not enumerated one by one: in this cost model a larger
micro-batch does the same compute with fewer collectives (FSDP runs once per micro-batch, TP and CP
pay latency per call), so the largest one that fits memory dominates and is the one kept. Under
CP it is one sequence a rank, the rest accumulated: that is what ndfunc's programs run at CP's cost
(torchtitan's published CP rows run so too). With two or more a rank, the loss's flatten of
(batch, sequence) to tokens makes a rank's tokens strided, and the partitioner gathers the last
hidden states over `cp` and computes the logits whole there (Llama-3-8B, 2 layers, 1x8x4x4, fsdp +
bf16 + full remat + ring attention, two sequences a rank against one: 5.0x the peak memory, 1.9x
the bytes sent and 2.0x the flops for twice the tokens; `benchmarks/shape_only.py --batch-per-rank`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from ndfunc._src.planner.cluster import GB, GiB, Cluster, check_cluster
from ndfunc._src.planner.estimate import Efficiency, Estimate, estimate
from ndfunc._src.planner.layout import Layout, Options
from ndfunc._src.planner.memory import Memory, memory_per_rank
from ndfunc._src.planner.model import REMAT_POLICIES, TransformerShape, check_remat

COLUMNS = ("#", "layout", "options", "GiB/rank", "step s", "tok/s/GPU", "MFU", "exposed comm s",
           "NVLink GB", "fabric GB")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The layouts that fit, fastest first (ties: less memory, then less traffic), and what the search
    left out.

    `considered` counts (layout, remat, FSDP option) candidates; `dropped` those with no micro-batch
    that fits memory; `closest` is the one that needs the least memory (its layout, options and
    memory), fitting or not: where nothing fits, `advice()` reads it. `table(top)` renders a `rich`
    table, each layout once with its best options; `str(plan)` the same in plain text.
    """

    model: TransformerShape
    cluster: Cluster
    global_batch: int
    seq_len: int
    efficiency: Efficiency
    rows: tuple[Estimate, ...]
    considered: int
    dropped: int
    closest: tuple[Layout, Options, Memory] | None = None
    remat: tuple[str, ...] = REMAT_POLICIES  # the policies the search tried

    @property
    def best(self) -> Estimate:
        if not self.rows:
            raise ValueError(f"no layout fits: {self.title()}. {self.advice()}")
        return self.rows[0]

    def advice(self) -> str:
        """Where nothing fits: what the layout closest to fitting needs, and what would make room."""
        if self.closest is None:
            return ("No layout divides this model, batch and sequence on these GPUs: tp must divide the key/value "
                    "heads and fit in a node, cp the sequence length, the data-parallel size the global batch.")
        layout, options, memory = self.closest
        device = self.cluster.device
        state = memory.params + memory.grads + memory.optimizer
        said = (f"The least any layout needs is {memory.total / GiB:,.1f} GiB per rank ({layout}, {options}: "
                f"{memory}), over the {device.memory_bytes / GiB:.0f} GiB of one {device.name}.")
        floor = state + memory.overhead  # what no sequence length or batch changes
        if floor > device.memory_bytes:
            return (f"{said} Parameters, gradients and optimizer state alone take {state / GiB:,.1f} GiB a rank "
                    f"sharded {layout.fsdp_size * layout.tp} ways: add GPUs (about "
                    f"{math.ceil(floor / device.memory_bytes)}x as many) or GPUs with more memory; a shorter sequence "
                    f"or smaller batch cannot help.")
        more_remat = "full" not in self.remat
        return (f"{said} Shorten sequences, lower the global batch per GPU"
                f"{', allow full remat' if more_remat else ''}, or add GPUs.")

    def title(self) -> str:
        c = self.cluster
        return (
            f"{self.model.name} on {c.num_gpus} x {c.device.name} ({c.gpus_per_node}/node), global batch "
            f"{self.global_batch} x {self.seq_len} tokens: {len(self.rows)} fit of {self.considered} "
            f"({self.dropped} dropped for memory); GB = what each rank sends per step"
        )

    def shown(self, top: int = 10, distinct: bool = True) -> list[Estimate]:
        """The `top` rows a table shows; with `distinct`, each layout once, with its best options
        (the rest differ in flags that cost time or memory and would crowd the table)."""
        out, seen = [], set()
        for e in self.rows:
            if len(out) == top:
                break
            if not (distinct and e.layout in seen):
                out.append(e)
                seen.add(e.layout)
        return out

    def cells(self, top: int = 10, distinct: bool = True) -> list[tuple[str, ...]]:
        """The table's rows as strings, `COLUMNS` order."""
        out = []
        for i, e in enumerate(self.shown(top, distinct), 1):
            t = e.time
            out.append((
                str(i), str(e.layout), str(e.options), f"{e.memory.total / GiB:.1f}", f"{t.total:.3f}",
                f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.mfu:.1%}", f"{t.tp + t.cp + t.fsdp + t.dp:.3f}",
                f"{e.intra_bytes / GB:.1f}", f"{e.inter_bytes / GB:.1f}",
            ))
        return out

    def table(self, top: int = 10, distinct: bool = True):
        """A `rich.table.Table` of the `top` rows (print it with `rich.print` or a Console)."""
        import rich.table  # only for rendering: planning needs no terminal library

        table = rich.table.Table(title=self.title())
        for name in COLUMNS:
            table.add_column(name, justify="left" if name in ("layout", "options") else "right")
        for row in self.cells(top, distinct):
            table.add_row(*row)
        return table

    def __str__(self) -> str:
        rows = [COLUMNS, *self.cells()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        lines = ["  ".join(c.ljust(w) if i in (1, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        return "\n".join([self.title(), *lines])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: TransformerShape, cluster: Cluster, global_batch: int, seq_len: int) -> list[Layout]:
    """Every layout `Layout.check` accepts, in a fixed order."""
    g, out = cluster.num_gpus, []
    for tp in divisors(g):
        if tp > cluster.gpus_per_node or model.n_kv_heads % tp:
            continue
        for cp in divisors(g // tp):
            if seq_len % cp:
                continue
            for dp_shard in divisors(g // (tp * cp)):
                dp_replicate = g // (tp * cp * dp_shard)
                if global_batch % (dp_replicate * dp_shard) == 0:
                    out.append(Layout(dp_replicate, dp_shard, cp, tp))
    return out


def plan(
    model: TransformerShape, *, cluster: Cluster, global_batch: int, seq_len: int,
    remat: tuple[str, ...] | str = REMAT_POLICIES, float8: bool = False, efficiency: Efficiency = Efficiency(),
) -> Plan:
    """Rank every layout of `cluster` for `model` at `global_batch` sequences of `seq_len` tokens,
    trying each of the `remat` policies (one by name, or several).

    Example:
        >>> p = plan(TransformerShape.named("llama3-8b"), cluster=Cluster.of("h100", 16), global_batch=64,
        ...          seq_len=4096)
        >>> p.best.layout.tp <= 8 and p.rows == tuple(sorted(p.rows, key=lambda e: round(e.time.total, 9)))
        True
    """
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan: {name} must be an int >= 1, got {value!r}.")
    if isinstance(remat, str):  # one policy
        remat = (remat,)
    if not remat:
        raise ValueError(f"plan: remat names the policies to try, one or more of {', '.join(REMAT_POLICIES)}; "
                         f"got none.")
    for r in remat:
        check_remat(r)
    check_cluster(cluster, "plan")
    if float8 and cluster.device.peak_fp8_flops is None:
        raise ValueError(f"plan: {cluster.device.name} has no fp8 tensor cores; plan with float8=False.")
    rows, considered, dropped, closest = [], 0, 0, None
    for layout in layouts(model, cluster, global_batch, seq_len):
        local = global_batch // layout.dp_size
        sharded = layout.fsdp_size > 1
        flags = itertools.product((True, False), repeat=2) if sharded else [(True, True)]
        for policy, (reshard, prefetch) in itertools.product(remat, list(flags)):
            considered += 1
            for mb in [1] if layout.cp > 1 else reversed(divisors(local)):
                options = Options(policy, mb, local // mb, reshard, prefetch, float8)
                memory = memory_per_rank(model, layout, options, seq_len)
                if closest is None or memory.total < closest[2].total:
                    closest = (layout, options, memory)
                if memory.total <= cluster.device.memory_bytes:
                    rows.append(estimate(model, layout, options, cluster=cluster, global_batch=global_batch,
                                         seq_len=seq_len, efficiency=efficiency))
                    break
            else:
                dropped += 1
    # ties (CP hidden behind attention prices like more data parallelism): less memory, then less traffic
    rows.sort(key=lambda e: (round(e.time.total, 9), e.memory.total, e.inter_bytes, e.intra_bytes))
    return Plan(model, cluster, global_batch, seq_len, efficiency, tuple(rows), considered, dropped, closest,
                tuple(remat))
