"""Reading a lowered program: its text, and what it costs per rank."""

from __future__ import annotations

import dataclasses
import operator
import types

import torch

from ndfunc._src.buffers import lifetimes
from ndfunc._src.partition.passes.breakdown import MemoryBreakdown, breakdown, value_bytes
from ndfunc._src.partition.planning.layout import describe
from ndfunc._src.partition.program import collectives, comm


def _fmt(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_fmt(v) for v in val) + ")"
    return repr(val)


def _op_name(target) -> str:
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, types.FunctionType):
        return f"{target.__module__}.{target.__qualname__}"  # a Python function (ring, CPU kernels)
    name = str(target)
    return name.removeprefix("aten.").removesuffix(".default")


def _arg(a) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    return repr(a)


def as_text(program, gm: torch.fx.GraphModule | None = None) -> str:
    """The local program (`program.local`, or `gm`, a rewrite of it with its metadata filled)."""
    program.ensure_meta()
    gm = program.local if gm is None else gm
    names = program.axis_names
    header = (f"# {program.name}: the program each rank runs; mesh "
              f"{dict(zip(program.mesh.axis_names, program.mesh.axis_sizes))}, partitioned over {names or '()'}")
    lines = [header]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    paths = list(program.traced.input_paths) + ["coords"]
    layouts = list(program.in_layouts) + [None]
    lines.append(f"def {program.name}(")
    for node, path, lay in zip(placeholders, paths, layouts):
        where = "" if lay is None else " " + describe(lay, names)
        lines.append(f"    {node.name}: {_fmt(node.meta.get('val'))}{where},  # {path}")
    lines.append("):")
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
        line = f"    {node.name}: {_fmt(node.meta.get('val'))} = {_op_name(node.target)}({args})"
        if (c := comm(node)) is not None:
            line += f"  # {c.describe()}"
        lines.append(line)
    out = gm.graph.find_nodes(op="output")[0]
    results = ", ".join(f"{a.name} {describe(lay, names)}" for a, (_, lay) in zip(out.args[0], program.plan.outputs))
    lines.append(f"    return ({results})")
    return "\n".join(lines)


def cost_analysis(program, gm: torch.fx.GraphModule | None = None) -> dict:
    """What one run of the local program (or `gm`, as `as_text`) costs each rank."""
    from ndfunc._src.partition.planning.flops import graph_flops

    program.ensure_meta()
    gm = program.local if gm is None else gm
    by_kind: dict[str, float] = {}
    counts: dict[str, int] = {}
    by_axes: dict[tuple[str, ...], dict[str, dict]] = {}
    for _, c in collectives(gm):
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.moved
        counts[c.kind] = counts.get(c.kind, 0) + 1
        these = by_axes.setdefault(c.axes, {}).setdefault(c.kind, {"count": 0, "bytes": 0.0})
        these["count"] += 1
        these["bytes"] += c.moved
    return {
        "flops": float(graph_flops(gm.graph)),
        "comm_bytes": {"total": float(sum(by_kind.values())), **by_kind},
        "collectives": counts,
        "by_axes": by_axes,
        "peak_memory_bytes": peak_memory(gm),
    }


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """What one run of the local program holds per rank, in bytes (JAX's `memory_analysis()`
    names): its arguments (each rank's blocks), its results, the part of the results written into
    donated arguments' buffers (`alias`), what lives in between (`temp`: the peak beyond arguments
    and results), and the peak itself (from liveness: fx frees a value after its last use).
    `breakdown`: the same by kind (parameters, optimizer state, gradients, gathered parameters,
    activations), the figures FSDP's and Megatron's closed forms give."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int
    peak_memory_in_bytes: int
    breakdown: MemoryBreakdown | None = None

    def __str__(self) -> str:
        def gib(b: int) -> str:
            return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"

        return (f"arguments {gib(self.argument_size_in_bytes)}, outputs {gib(self.output_size_in_bytes)} "
                f"({gib(self.alias_size_in_bytes)} in donated buffers), temporaries "
                f"{gib(self.temp_size_in_bytes)}, peak {gib(self.peak_memory_in_bytes)} per rank")

    def plot(self, ax=None):
        """A matplotlib Figure of the bytes alive while each op of the local program runs, stacked by
        kind (`breakdown`'s), the peak marked. Every rank runs this one SPMD program, so it is each
        rank's memory. `ax`: draw into these axes instead of a new figure. Needs matplotlib
        (`pip install 'ndfunc[notebook]'`)."""
        from ndfunc._src.figures import memory_figure

        if self.breakdown is None or self.breakdown.live is None:
            raise ValueError("MemoryAnalysis.plot: this analysis has no account of each op (made by hand?); "
                             "draw the one `memory_analysis()` of a lowered step returns.")
        live = self.breakdown.live
        return memory_figure(live.by_kind, live.ops, live.forward_ends, ax=ax)


def memory_analysis(program, gm: torch.fx.GraphModule | None = None) -> MemoryAnalysis:
    """Per-rank bytes of the local program (or `gm`, as `as_text`): arguments, outputs, temporaries, peak."""
    program.ensure_meta()
    gm = program.local if gm is None else gm
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"][:-1]  # coords last: not an argument
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    arguments = sum(value_bytes(n.meta.get("val")) for n in inputs)
    results = [value_bytes(o.meta.get("val")) if isinstance(o, torch.fx.Node) else 0 for o in outputs]
    alias = sum(results[j] for j in program.donation)
    peak = peak_memory(gm)
    return MemoryAnalysis(arguments, sum(results), alias, max(0, peak - arguments - sum(results) + alias), peak,
                          breakdown(program, gm))


def peak_memory(gm: torch.fx.GraphModule) -> int:
    """Peak bytes alive at once in one run of `gm` (fx frees a value after its last use): inputs
    for the whole run, views and in-place results sharing their base's buffer."""
    return max(live_bytes(list(gm.graph.nodes))[0].values(), default=0)


def live_bytes(nodes: list[torch.fx.Node]) -> tuple[dict, dict]:
    """`(live, sizes)`: the bytes alive while each node runs (what it makes included, what it
    reads last not yet freed), and the size of each buffer by its last reader (`lifetimes`)."""
    root, last = lifetimes(nodes)
    change = [0] * (len(nodes) + 2)  # bytes made at i, freed after i
    sizes: dict = {}
    for i, n in enumerate(nodes):
        if root.get(n) is n:
            size = value_bytes(n.meta.get("val"))
            change[i] += size
            change[last[n] + 1] -= size
            if last[n] < len(nodes):
                sizes.setdefault(nodes[last[n]], []).append(size)
    live, total = {}, 0
    for n, delta in zip(nodes, change):
        total += delta
        live[n] = total
    return live, sizes
