"""How long nf.jit takes to trace, partition and lower the llama train step, by depth.

    python benchmarks/compile_time.py [--layers 2 8 32] [--mesh dp=2,tp=2]

Runs in simulation (the program does not depend on how ranks are made). The arguments are laid out
before `lower` (as a training loop holds them), and that is timed apart. Prints seconds per stage
and per layer: the total should grow linearly with depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import ndfunc as nf
from models import llama
from ndfunc._src.partition import lower as lowering
from ndfunc._src.partition.planning.solve import partition
from ndfunc._src.trace import trace
from ndfunc.sharding import P

RULES = [("batch", "dp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp")]


def stages(n_layers: int, mesh_axes: dict) -> dict:
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=n_layers)
    params = llama.init(cfg, nf.random.key(0))
    opt = nf.optim.adamw(1e-3)
    state = opt.init(params)
    batch = {"tokens": torch.zeros(8, 32, dtype=torch.long), "targets": torch.zeros(8, 32, dtype=torch.long)}

    def step(params, state, batch):
        loss, grads = nf.value_and_grad(llama.loss)(params, batch, cfg)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss

    mesh = nf.make_mesh(**mesh_axes)
    rules = [(name, axis) for name, axis in RULES if axis in mesh_axes]
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), rules)
    bspec = nf.sharding.logical_to_mesh(("batch", None), rules)
    sspec = nf.optim.state_shardings(state, pspec)
    jitted = nf.jit(step, mesh=mesh, in_shardings=(pspec, sspec, bspec), out_shardings=(pspec, sspec, P()))
    # the arguments laid out first, as a training loop holds them: placing data is not compiling
    with mesh:
        t0 = time.perf_counter()
        params, state, batch = nf.device_put((params, state, batch), (pspec, sspec, bspec))
        place = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered = jitted.lower(params, state, batch)
    total = time.perf_counter() - t0
    # the same stages again, separately, for the breakdown
    program = lowered.program
    t0 = time.perf_counter()
    traced = trace(step, (params, state, batch))
    t1 = time.perf_counter()
    plan = partition(traced.graph, program.sizes, program.in_layouts, program.out_layouts)
    t2 = time.perf_counter()
    groups = [mesh.device_mesh.get_group(i).group_name for i in program.axes]
    lowering.lower(traced.graph, plan, program.axis_names, groups)
    t3 = time.perf_counter()
    return {"layers": n_layers, "nodes": len(traced.graph.nodes), "trace_s": t1 - t0, "partition_s": t2 - t1,
            "lower_s": t3 - t2, "total_s": total, "place_s": place}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--mesh", default="dp=2,tp=2", help="axis=size,... (simulated ranks: their product)")
    args = parser.parse_args()
    axes = {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))}
    n = 1
    for v in axes.values():
        n *= v
    with nf.simulate(n):
        print(f"mesh {axes}")
        for layers in args.layers:
            r = stages(layers, axes)
            print(f"{r['layers']:3d} layers {r['nodes']:6d} nodes: trace {r['trace_s']:.2f} s, partition "
                  f"{r['partition_s']:.2f} s, lower {r['lower_s']:.2f} s; nf.jit lower {r['total_s']:.2f} s "
                  f"({r['total_s'] / layers:.2f} s/layer; placing the arguments before: {r['place_s']:.2f} s)")


if __name__ == "__main__":
    main()
