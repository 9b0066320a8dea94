"""Planning from a step: each layout's own program lowered shape-only, its memory read, its time
replayed on the cluster (`timeline`).

`plan` prices a Llama shape by closed forms, for every layout, in a fraction of a second.
`plan_step` prices what ndfunc will run for the layouts it is given: any model (a Hugging Face
one called as it is, a custom loss, remat, transforms), at seconds a layout, the time to lower it.
Use `plan` to find the few layouts worth it and `plan_step` to check them on your own step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

from ndfunc._src.planner.cluster import GB, GiB, Cluster, check_cluster
from ndfunc._src.planner.estimate import Efficiency
from ndfunc._src.planner.layout import Layout
from ndfunc._src.planner.memory import OVERHEAD_BYTES
from ndfunc._src.replay.timeline import KERNELS, ProgramTime, program_time

STEP_COLUMNS = ("#", "layout", "GiB/rank", "step s", "tok/s/GPU", "HFU", "exposed comm s", "NVLink GB",
                "fabric GB", "lowered s")


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """One layout's lowered step, priced.

    `memory_bytes`: the peak of the step's programs (`memory_analysis`) plus the planner's fixed
    allowance for what lives outside them (CUDA context, NCCL buffers: `memory.OVERHEAD_BYTES`).
    `time`: one optimizer step, each program's replay as many times as the step runs it. `hfu`:
    the flops executed (recomputation included) per second over the device's bf16 peak.
    """

    layout: Layout
    memory_bytes: float
    time: ProgramTime
    tokens_per_s_per_gpu: float
    hfu: float
    fits: bool
    lowered_s: float

    def __str__(self) -> str:
        return (f"{self.layout}: {self.memory_bytes / GiB:.1f} GiB/rank, {self.time.total:.3f} s/step, "
                f"{self.tokens_per_s_per_gpu:,.0f} tok/s/GPU, HFU {self.hfu:.1%}")


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The layouts whose step fits, fastest first; those that do not fit, and those that could not
    be lowered (with why)."""

    cluster: Cluster
    tokens_per_step: int
    rows: tuple[StepEstimate, ...]
    too_big: tuple[StepEstimate, ...]
    failed: tuple[tuple[Layout, str], ...]

    @property
    def best(self) -> StepEstimate:
        if not self.rows:
            raise ValueError(f"no layout fits: {self.title()}.")
        return self.rows[0]

    def title(self) -> str:
        c = self.cluster
        return (f"the step on {c.num_gpus} x {c.device.name} ({c.gpus_per_node}/node), {self.tokens_per_step:,} tokens "
                f"a step: {len(self.rows)} fit, {len(self.too_big)} too big, {len(self.failed)} not lowered")

    def cells(self) -> list[tuple[str, ...]]:
        """The table's rows as strings, `STEP_COLUMNS` order: those that fit, ranked, then those that
        do not (no rank, their memory marked)."""
        return [(str(i) if e.fits else "-", str(e.layout), f"{e.memory_bytes / GiB:.1f}{'' if e.fits else ' > mem'}",
                 f"{e.time.total:.3f}", f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.hfu:.1%}", f"{e.time.exposed:.3f}",
                 f"{e.time.sent['intra'] / GB:.1f}", f"{e.time.sent['inter'] / GB:.1f}", f"{e.lowered_s:.1f}")
                for i, e in enumerate((*self.rows, *self.too_big), 1)]

    def table(self):
        """A `rich.table.Table` of the rows (print it with `rich.print` or a Console)."""
        import rich.table

        table = rich.table.Table(title=self.title())
        for name in STEP_COLUMNS:
            table.add_column(name, justify="left" if name == "layout" else "right")
        for row in self.cells():
            table.add_row(*row)
        return table

    def __str__(self) -> str:
        rows = [STEP_COLUMNS, *self.cells()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(STEP_COLUMNS))]
        lines = ["  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines += [f"not lowered: {lay}: {why}" for lay, why in self.failed]
        return "\n".join([self.title(), *lines])


def plan_step(lower: Callable[[Layout], object], layouts: Iterable[Layout], *, cluster: Cluster,
              tokens_per_step: int, efficiency: Efficiency = KERNELS) -> StepPlan:
    """Lower the step for each of `layouts` and rank them by the replayed time of its programs.

    `lower(layout)` returns the step lowered over stand-ins on `layout.mesh` (an `AbstractMesh`
    of the cluster's size): a `Lowered`, or a list of `(Lowered, times)` for a step of several
    programs (gradient accumulation: the micro-batch's `grad_accum` times, then the update once).
    `tokens_per_step`: the tokens one optimizer step trains on, over all ranks. A layout whose
    lowering raises is kept in `failed` with the error's text. `efficiency`: what kernels sustain
    of the device's peaks (`timeline.KERNELS` unless given).

    Example:
        >>> import ndfunc as nf, torch
        >>> from ndfunc.plan import Cluster, Layout, plan_step
        >>> from ndfunc.sharding import NamedSharding, P
        >>> def lower(layout):
        ...     split = NamedSharding(layout.mesh, P(("dp_shard", "tp")))
        ...     w = nf.ShapeDtypeStruct((4096, 4096), torch.bfloat16, sharding=split)
        ...     x = nf.ShapeDtypeStruct((64, 4096), torch.bfloat16, sharding=split)
        ...     return nf.jit(lambda w, x: (x @ w).sum(), mesh=layout.mesh).lower(w, x)
        >>> p = plan_step(lower, [Layout(dp_shard=8), Layout(dp_shard=2, tp=4)], cluster=Cluster.of("h100", 8),
        ...               tokens_per_step=64)
        >>> len(p.rows), p.best.time.total > 0
        (2, True)
    """
    check_cluster(cluster, "plan_step")
    if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1:
        raise ValueError(f"plan_step: tokens_per_step must be an int >= 1, got {tokens_per_step!r}.")
    rows, too_big, failed = [], [], []
    for layout in layouts:
        if layout.num_gpus != cluster.num_gpus:
            raise ValueError(f"plan_step: {layout!r} uses {layout.num_gpus} GPUs; the cluster has {cluster.num_gpus}.")
        start = time.perf_counter()
        try:
            made = lower(layout)
        except Exception as e:  # noqa: BLE001 - a layout the step cannot take is reported, not fatal
            failed.append((layout, f"{type(e).__name__}: {e}"))
            continue
        programs = _programs(made)
        e = _priced(layout, programs, cluster, tokens_per_step, efficiency, time.perf_counter() - start)
        (rows if e.fits else too_big).append(e)
    rows.sort(key=lambda e: (e.time.total, e.memory_bytes))
    return StepPlan(cluster, tokens_per_step, tuple(rows), tuple(too_big), tuple(failed))


def _programs(made) -> list[tuple[object, int]]:
    """What `lower(layout)` returned, as (Lowered, times) pairs; a clear error for anything else."""
    if hasattr(made, "program"):
        return [(made, 1)]
    expected = ("expected the step lowered over stand-ins on layout.mesh (a Lowered: nf.jit(step, "
                "mesh=layout.mesh).lower(*stand_ins)), or a list of (Lowered, times) pairs for a step of several "
                "programs")
    if hasattr(made, "lower"):
        raise TypeError(f"plan_step: lower(layout) returned the jitted step itself; {expected}: call .lower(...) "
                        f"on it.")
    pairs = list(made) if isinstance(made, (list, tuple)) else None
    if not pairs or not all(isinstance(p, tuple) and len(p) == 2 and hasattr(p[0], "program") for p in pairs):
        got = type(made).__name__ if pairs is None else f"{type(made).__name__} of {[type(p).__name__ for p in made]}"
        raise TypeError(f"plan_step: lower(layout) returned a {got}; {expected}.")
    for _, times in pairs:
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise ValueError(f"plan_step: a program runs a whole number of times a step, >= 1; lower(layout) "
                             f"gave {times!r}.")
    return pairs


def _priced(layout: Layout, programs: Sequence[tuple[object, int]], cluster: Cluster, tokens: int,
            efficiency: Efficiency, lowered_s: float) -> StepEstimate:
    total = None
    peak = 0
    for lowered, times in programs:
        t = program_time(lowered, cluster, efficiency).times(times)
        total = t if total is None else total + t
        peak = max(peak, lowered.memory_analysis().peak_memory_in_bytes)
    memory = peak + OVERHEAD_BYTES
    tps = tokens / total.total / cluster.num_gpus
    hfu = total.flops / total.total / cluster.device.peak_bf16_flops
    return StepEstimate(layout, float(memory), total, tps, hfu, memory <= cluster.device.memory_bytes, lowered_s)
