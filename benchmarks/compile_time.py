"""How long nf.jit takes to lower the llama train step, by depth and by mesh size.

    python benchmarks/compile_time.py [--layers 2 8 32 80] [--meshes 1,2,2,2 2,2,2,2 ...]
                                      [--config tiny] [--hf] [--repeat N] [--json OUT] [--whole]
                                      [--slope 1,16,1,1 2,2,2,2 ... [--slope-layers 8 32]]

Each row lowers the step of `models.train` (AdamW, the ParallelConfig's rules on activations) over
`nf.ShapeDtypeStruct` stand-ins on an `AbstractMesh` (the program simulated or real ranks get, with
nothing laid out or allocated: placing data is not compiling), and prints the program's nodes, the
nodes the partitioner plans (a chain of alike layers planned through three of them:
`planning/repeats.py`), and the seconds of `Jitted.lower` and of its parts: the partitioner's
candidate strategies (DTensor's rules asked, with the contraction), its search, and the rest
(tracing and the passes after the search).
Every row starts from cold caches (no candidate, layout change or plan remembered from a row
before), as a fresh process would. Depth rows use `--depth-mesh`; mesh rows use `--mesh-layers`.
`--slope`: each of these meshes lowered at the two depths of `--slope-layers`, and the lower time
split into what every layer adds and what is paid once (a line through the two), by how many axes
the mesh splits: the search is solved once per distinct layer, so more axes can cost more once
without costing more per layer. (Alone, it lowers a 2-layer step first and does not count it: a
process's first lowering also pays torch's warm-up.)
`--hf`: the same step for transformers' `LlamaForCausalLM` of the config's dims, called as it is
(`models.train --hf-model`), its layers found alike and traced once (`nf.nn.functional`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import optree
import torch

import ndfunc as nf
from models import hf, llama, train
from ndfunc._src import pipeline
from ndfunc._src.partition.planning import costs, ops, repeats, solve, strategies
from ndfunc.sharding import NamedSharding, P

MESHES = ["1,2,1,2", "1,2,2,2", "2,2,2,2", "2,4,2,4", "2,8,4,4"]  # dp_replicate, dp_shard, cp, tp: 4 to 256
# (1,024 ranks: `--config small --meshes 2,32,4,4`; the tiny model's dims do not split 128 ways)


def cold() -> None:
    """Forget what the partitioner remembers between programs."""
    ops._CACHE.clear()
    ops._WHOLE.clear()
    strategies._LAYOUTS.clear()
    strategies._COMBINED.clear()
    strategies._FITS.clear()
    costs._TRANSITIONS.clear()
    solve._PLANS.clear()


def row(cfg: llama.LlamaConfig, sizes: tuple[int, ...], seq: int = 64) -> dict:
    config = nf.ParallelConfig(*sizes)
    # stand-ins on an abstract mesh: a 1,024-rank row costs what a 4-rank one does to set up, and
    # the program is the one simulated or real ranks get (tests/test_shape_only.py)
    mesh = config.build_abstract_mesh()
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), pspec))
    return timed(config, mesh, params, lambda opt: train.make_step(cfg, opt, config.rules), cfg.n_layers, seq)


def hf_row(cfg: llama.LlamaConfig, sizes: tuple[int, ...], seq: int = 64) -> dict:
    """`row` for transformers' LlamaForCausalLM of `cfg`'s dims, called as it is (`models.train
    --hf-model`'s step; made on the meta device, its buffers empty: no value changes the program)."""
    import transformers  # noqa: PLC0415 - only this row needs it

    config = nf.ParallelConfig(*sizes)
    mesh = config.build_abstract_mesh()
    params, loss = train.abstract_hf_model(transformers.LlamaConfig(**hf.config_to_hf(cfg, torch.float32)), mesh)
    return timed(config, mesh, params, lambda opt: train.make_loss_step(loss, opt, config.rules), cfg.n_layers, seq)


def timed(config: nf.ParallelConfig, mesh, params, make_step, layers: int, seq: int) -> dict:
    """Seconds of lowering `make_step(opt)` (AdamW) over `params` and a batch of stand-ins, from
    cold caches, and of the partitioner's parts."""
    opt = nf.optim.adamw(1e-3, weight_decay=0.1)
    state = opt.init(params)
    batch = train.abstract_batch(config, mesh, config.dp_world_size, seq * config.cp_size)
    laid_out = optree.tree_map(nf.sharding_of, (params, state))  # results leave as they came
    step = nf.jit(make_step(opt), mesh=mesh, out_shardings=(*laid_out, P()))
    cold()
    t0 = time.perf_counter()
    lowered = step.lower(params, state, batch)
    total = time.perf_counter() - t0
    # the parts, again, from cold caches: the search's own time apart from the candidates'
    program = lowered.program
    cold()
    graph = program.traced.graph
    with pipeline.young_collections_only():  # as `lower` runs it: without full collections
        t0 = time.perf_counter()
        # the problem the search is given, as lowering makes it
        problem, contraction = solve.problem_of(graph, program.sizes, program.in_layouts, program.out_layouts)
        planned = graph if contraction is None else contraction.graph
        t1 = time.perf_counter()
        problem.solve()
        t2 = time.perf_counter()
    return {"layers": layers, "mesh": list(mesh.axis_sizes), "ranks": config.total_size, "nodes": len(graph.nodes),
            "planned_nodes": len(planned.nodes), "lower_s": total, "candidates_s": t1 - t0, "search_s": t2 - t1,
            "rest_s": total - (t2 - t0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small", "llama3_8b", "llama3_70b"], default="tiny")
    parser.add_argument("--layers", type=int, nargs="*", default=[2, 8, 32, 80])
    parser.add_argument("--depth-mesh", default="1,2,2,2", help="dp_replicate,dp_shard,cp,tp of the depth rows")
    parser.add_argument("--meshes", nargs="*", default=MESHES, help="dp_replicate,dp_shard,cp,tp per mesh row")
    parser.add_argument("--mesh-layers", type=int, default=2)
    parser.add_argument("--hf", action="store_true",
                        help="lower transformers' LlamaForCausalLM of the config's dims, called as it is")
    parser.add_argument("--repeat", type=int, default=1,
                        help="lower each row this many times, from cold caches, and keep the fastest (a noisy machine)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--whole", action="store_true",
                        help="plan every layer, not a chain of alike layers through three of them (to compare)")
    parser.add_argument("--slope", nargs="*", default=[], help="meshes whose per-layer and fixed lower time to print")
    parser.add_argument("--slope-layers", type=int, nargs=2, default=[8, 32], metavar=("FEW", "MANY"))
    args = parser.parse_args()
    if args.whole:
        repeats.MIN_CALLS = 2**62
    base = getattr(llama.LlamaConfig, args.config)()
    sizes_of = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    jobs = [(layers, sizes_of(args.depth_mesh)) for layers in args.layers]
    jobs += [(args.mesh_layers, sizes_of(m)) for m in args.meshes]
    lower_row = hf_row if args.hf else row
    slopes = [(layers, sizes_of(m)) for m in args.slope for layers in args.slope_layers]
    if slopes and not jobs:  # a process's first lowering also pays torch's warm-up: not a layer's cost
        lower_row(dataclasses.replace(base, n_layers=2), slopes[0][1])
    jobs += slopes
    rows = []
    print(f"{'layers':>6} {'mesh':>12} {'ranks':>5} {'nodes':>6} {'planned':>7} {'lower s':>8} {'cands s':>8} "
          f"{'search s':>8} {'rest s':>7}")
    for layers, sizes in jobs:
        r = min((lower_row(dataclasses.replace(base, n_layers=layers), sizes)
                 for _ in range(args.repeat)), key=lambda r: r["lower_s"])
        rows.append(r)
        print(f"{layers:6d} {'x'.join(map(str, sizes)):>12} {r['ranks']:5d} {r['nodes']:6d} {r['planned_nodes']:7d} "
              f"{r['lower_s']:8.2f} {r['candidates_s']:8.2f} {r['search_s']:8.2f} {r['rest_s']:7.2f}", flush=True)
    if args.slope:
        print_slopes(rows[len(rows) - 2 * len(args.slope):], args.slope_layers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def print_slopes(rows: list[dict], depths: list[int]) -> None:
    """Per mesh (rows in pairs: the two depths), the lower time as fixed + per layer x layers."""
    few, many = depths
    print(f"\nlower s = fixed + per layer x layers, through {few} and {many} layers")
    print(f"{'mesh':>12} {'axes':>4} {'fixed s':>8} {'per layer ms':>12} {'per layer / first':>17}")
    first = None
    for a, b in zip(rows[::2], rows[1::2]):
        per_layer = (b["lower_s"] - a["lower_s"]) / (many - few)
        first = per_layer if first is None else first
        print(f"{'x'.join(map(str, a['mesh'])):>12} {sum(n > 1 for n in a['mesh']):4d} "
              f"{a['lower_s'] - per_layer * few:8.2f} {1e3 * per_layer:12.1f} {per_layer / first:17.2f}")


if __name__ == "__main__":
    main()
