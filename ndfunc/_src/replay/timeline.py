"""A lowered step's time on a cluster, read from the program each rank runs.

`estimate` prices a Llama shape by closed forms. `program_time` prices what ndfunc will run: any
step lowered shape-only (`nf.jit(step).lower(*stand_ins)` over an `AbstractMesh`), a Hugging Face
model's as well as the project's Llama, replayed op by op as a GPU runs it:

- one compute stream runs the ops in program order. An op takes its roofline time: the larger of
  the flops it runs (`executed_share` of those counted: half for a causal kernel, 2n + 1 of 4n
  quarter blocks for a zigzag ring over n ranks) over the peak for its dtype times the efficiency
  for its kind (`Efficiency.matmul`; `Efficiency.attention` for attention kernels and rings), and
  the bytes it reads and writes over the memory bandwidth. Views, `getitem`s and waits take none.
- A collective is issued when the compute stream reaches it. It runs on the stream of the link
  its group crosses (NVLink, or the fabric where its mesh axes span nodes: `collective_cost.machine`)
  after what was issued before it there, for `collective_cost.seconds` of the bytes a rank sends
  (`Comm.moved`, a ring's share): the price the partitioner and the closed forms give it too.
- A `wait_tensor` holds the compute stream until its collective is done. A collective nothing
  waits for (a ring attention: its hops run beside the blocks it computes) holds the compute
  stream for the longer of its compute and its communication.

The step takes until every stream is idle. Overlap is what the program's schedule allows and no
more: `nf.fsdp`'s prefetched gathers hide behind the layer before them; a tensor-parallel
all-reduce that the next op waits for hides behind nothing. What it leaves out: kernel launch
overheads (an eager program of small ops runs slower than its roofline) and link contention
between streams of one level beyond the order they are issued in.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch

from ndfunc._src import collective_cost, view_ops
from ndfunc._src.forward import on_workers
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.passes.breakdown import value_bytes
from ndfunc._src.partition.planning.flops import executed_share, is_attention, node_flops
from ndfunc._src.planner.cluster import Cluster, Device, check_cluster
from ndfunc._src.planner.estimate import Efficiency

# What kernels sustain of the datasheet peak, op by op. The closed forms' `Efficiency()` folds the
# ops that are not matmuls into its matmul figure; a replay prices those ops itself, by their bytes.
# Attention 0.35: FlashAttention-2's utilisation of an H100 (Shah et al. 2024, "FlashAttention-3",
# sec. 1). Matmuls 0.6: a round figure for cuBLAS's bf16 GEMMs at a training step's shapes on a
# Hopper part (about 600 of H100's 989 TFLOPS). Assumptions, not fitted to the validation rows.
KERNELS = Efficiency(matmul=0.6, attention=0.35)

_WAIT = torch.ops._c10d_functional.wait_tensor.default
def _free(target) -> bool:
    """Whether an op moves no bytes of its own: it aliases its input (`view_ops`; a reshape views
    where it can, and the lowering asks for one only where a view of the global value was traced)."""
    return target is operator.getitem or target in view_ops.RESHAPES or view_ops.aliases_input(target)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One run of a program on the cluster's streams, in seconds from its start (what
    `ProgramTime.plot` draws): `compute`, the spans the compute stream runs ops; `waits`, the spans
    it waits on collectives (and the tail of those still running when it is done);
    `collectives`, `(link level, start, end, mesh axes)` of each collective that takes time."""

    total: float
    compute: tuple[tuple[float, float], ...]
    waits: tuple[tuple[float, float], ...]
    collectives: tuple[tuple[str, float, float, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True)
class ProgramTime:
    """Seconds one run of a local program takes on a cluster, and where they go.

    `total`: until every stream is idle. `compute`: the compute stream's own work (ops' roofline
    times). `exposed`: what the compute stream waited on collectives, `total - compute` (with the
    tail of collectives still running when it finished). `links`: seconds each link level
    (`intra`, `inter`) was busy; `sent`: bytes a rank sent over each. `flops`: per rank.
    `runs`: each run's `Timeline`, in order (`plot` draws them).
    """

    total: float
    compute: float
    links: dict[str, float]
    sent: dict[str, float]
    flops: float
    runs: tuple[Timeline, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def exposed(self) -> float:
        return self.total - self.compute

    def times(self, n: int) -> ProgramTime:
        """`n` runs one after another (a micro-batch's program under gradient accumulation)."""
        return ProgramTime(n * self.total, n * self.compute, {k: n * v for k, v in self.links.items()},
                           {k: n * v for k, v in self.sent.items()}, n * self.flops, self.runs * n)

    def __add__(self, other: ProgramTime) -> ProgramTime:
        """This run, then `other`'s."""
        return ProgramTime(self.total + other.total, self.compute + other.compute,
                           {k: v + other.links[k] for k, v in self.links.items()},
                           {k: v + other.sent[k] for k, v in self.sent.items()}, self.flops + other.flops,
                           self.runs + other.runs)

    def __str__(self) -> str:
        busy = ", ".join(f"{k} {v:.3f}" for k, v in self.links.items() if v)
        return (f"{self.total:.3f} s (compute {self.compute:.3f}, exposed comm {self.exposed:.3f}; links busy: "
                f"{busy or 'none'})")

    def plot(self, ax=None):
        """A matplotlib Figure of the replay: a lane per stream (compute, then each link that carries
        a collective), bars where the compute stream runs ops and one per collective (coloured by
        its mesh axes), the compute stream's waits on communication hatched red; the runs one after
        another, from 0 to `total`.
        `ax`: draw into these axes. Needs matplotlib (`pip install 'ndfunc[notebook]'`)."""
        from ndfunc._src.figures import timeline_figure

        if not self.runs:
            raise ValueError("ProgramTime.plot: this time has no replay to draw (made by hand?); draw what "
                             "program_time returns.")
        lanes: dict[str, list] = {"compute": [], "intra": [], "inter": []}
        waits = []
        offset = 0.0
        for run in self.runs:
            lanes["compute"] += [(offset + a, offset + b, "") for a, b in run.compute]
            waits += [(offset + a, offset + b) for a, b in run.waits]
            for level, a, b, axes in run.collectives:
                lanes[level].append((offset + a, offset + b, " x ".join(axes)))
            offset += run.total
        named = {"compute": lanes["compute"]} | {f"{k}-node link": v for k, v in lanes.items() if k != "compute" and v}
        return timeline_figure(named, waits, self.total, ax=ax)


@on_workers  # under nf.processes: replayed where the lowered step lives
def program_time(lowered, cluster: Cluster, efficiency: Efficiency = KERNELS) -> ProgramTime:
    """`lowered`'s local program (a `Lowered` or a `Program`) replayed on `cluster`'s devices and
    links (see the module's text), at `efficiency` (`KERNELS`: kernels' own rates); its mesh is
    the cluster's ranks, row-major.

    Example:
        >>> import ndfunc as nf, torch
        >>> from ndfunc.plan import Cluster, program_time
        >>> from ndfunc.sharding import AbstractMesh, NamedSharding, P
        >>> mesh = AbstractMesh({"dp_shard": 8})
        >>> split = NamedSharding(mesh, P("dp_shard"))
        >>> w = nf.ShapeDtypeStruct((4096, 4096), torch.bfloat16, sharding=split)
        >>> x = nf.ShapeDtypeStruct((8, 4096), torch.bfloat16, sharding=split)
        >>> t = program_time(nf.jit(lambda w, x: x @ w, mesh=mesh).lower(w, x), Cluster.of("h100", 8))
        >>> t.links["intra"] > 0 and t.total >= t.compute
        True
    """
    program = getattr(lowered, "program", lowered)
    if not hasattr(program, "local"):
        raise TypeError(f"program_time: expected a step lowered over stand-ins (a Lowered: nf.jit(step, "
                        f"mesh=...).lower(*stand_ins)) or its Program, got a {type(lowered).__name__}.")
    check_cluster(cluster, "program_time")
    program.ensure_meta()
    mesh = program.mesh
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if math.prod(sizes.values()) != cluster.num_gpus:
        raise ValueError(f"program_time: the program's mesh {sizes} has {math.prod(sizes.values())} ranks; the cluster "
                         f"has {cluster.num_gpus} GPUs. Lower the step on a mesh of the cluster's size.")
    links = collective_cost.machine(sizes, cluster)
    device = cluster.device
    t = 0.0  # the compute stream
    compute = 0.0
    free = {"intra": 0.0, "inter": 0.0}  # when each link's stream is next idle
    busy = {"intra": 0.0, "inter": 0.0}
    sent = {"intra": 0.0, "inter": 0.0}
    done: dict[torch.fx.Node, float] = {}  # a collective -> when it finishes
    flops = 0.0
    spans = _Spans()
    for node in program.local.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _WAIT:
            t = spans.wait(t, done.get(node.args[0], 0.0))
            continue
        work, f = op_seconds(node, device, efficiency)
        flops += f
        c = prog.comm(node)
        if c is None:
            t += work
            compute += work
            continue
        level, link = links.link(c.axes)
        seconds = collective_cost.seconds(c.kind, math.prod(sizes[a] for a in c.axes), c.bytes, link, sent=c.moved)
        start = max(t, free[level])
        free[level] = done[node] = start + seconds
        busy[level] += seconds
        sent[level] += c.moved
        if seconds:
            spans.collectives.append((level, start, done[node], c.axes))
        if not any(u.target is _WAIT for u in node.users):  # nothing waits for it: it runs in line
            compute += work
            t = spans.wait(t + work, done[node])
    total = max(t, *free.values())
    return ProgramTime(total, compute, busy, sent, flops, (spans.timeline(t, total),))


class _Spans:
    """What `program_time` records for its `Timeline`: the compute stream's busy spans run from
    one wait to the next."""

    def __init__(self):
        self.busy_from = 0.0
        self.compute, self.waits, self.collectives = [], [], []

    def wait(self, t: float, until: float) -> float:
        """The compute stream, at `t`, waits until `until` (if later); returns when it goes on."""
        if until > t:
            self._close(t)
            self.waits.append((t, until))
            self.busy_from = until
        return max(t, until)

    def timeline(self, t: float, total: float) -> Timeline:
        self._close(t)
        if total > t:  # the collectives still running after the last op
            self.waits.append((t, total))
        return Timeline(total, tuple(self.compute), tuple(self.waits), tuple(self.collectives))

    def _close(self, t: float) -> None:
        if t > self.busy_from:
            self.compute.append((self.busy_from, t))


def op_seconds(node: torch.fx.Node, device: Device, efficiency: Efficiency) -> tuple[float, float]:
    """`(seconds, flops)` of one op of a local program on `device`: its roofline time (module text)."""
    if _free(node.target):
        return 0.0, 0.0
    flops = node_flops(node)
    moved = value_bytes(node.meta.get("val")) + sum(value_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    seconds = moved / device.memory_bandwidth
    if flops:
        kind = efficiency.attention if is_attention(node.target) else efficiency.matmul
        seconds = max(seconds, flops * executed_share(node) / (_peak(device, node) * kind))
    return seconds, float(flops)


def _peak(device: Device, node: torch.fx.Node) -> float:
    """The peak rate for the dtype an op multiplies in: its first tensor input's."""
    dtype = next((a.meta["val"].dtype for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)),
                 torch.bfloat16)
    if dtype.itemsize == 1 and dtype.is_floating_point and device.peak_fp8_flops is not None:
        return device.peak_fp8_flops
    if dtype in (torch.float32, torch.float64):
        return device.peak_fp32
    return device.peak_bf16_flops
