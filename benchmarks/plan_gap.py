"""How far the partitioner's search ends from the optimum its cost model admits.

    python benchmarks/plan_gap.py [--layers 1] [--seconds 120] [--layouts dp,fsdp,cp]
                                  [--config tiny|small] [--seq-len 64]

For the llama train step of `models.train` (the tiny config, or `small`'s dims with an 8,192-token
vocabulary; `--layers` layers, 8 simulated ranks, shape-only as `models.train.lower_abstract` lowers it) on each layout: the search's plan cost (`Problem.solve`, no exact step), HiGHS's plan and
the lower bound it proved (`planning/exact.py`, started from the search's plan, stopped after
`--seconds`), the search's gap to that bound, the integer program's size, and both times. The
exact plans are those that at no point of the program hold more bytes per rank than the search's
plan (`planning/memory.py`): a gap of 0.0% with "proven" is a certificate that no such plan is
cheaper by the cost model. Then the search's plan refined one mesh axis at a time
(`planning/refine.py`, what `NDFUNC_REFINE_VARIABLES` turns on): its gap to the same bound and
its time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import ndfunc as nf
from models import llama, train
from ndfunc._src.partition.planning import exact, refine, solve

# name: (dp_replicate, dp_shard, cp, tp)
LAYOUTS = {
    "dp": (8, 1, 1, 1),
    "fsdp": (1, 8, 1, 1),
    "cp": (1, 1, 8, 1),
    "tp": (2, 1, 1, 4),
    "fsdp+cp": (1, 4, 2, 1),
    "fsdp+tp": (1, 4, 1, 2),
    "hsdp+tp": (2, 2, 1, 2),
    "4d": (1, 2, 2, 2),
}


def program(sizes: tuple[int, ...], layers: int, config: str = "tiny", seq_len: int = 64):
    if config == "tiny":
        cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=layers)
    else:  # a model's dims where work outweighs what a toy's layout changes move (docs/planning.md)
        cfg = dataclasses.replace(llama.LlamaConfig.small(), n_layers=layers, vocab_size=8192)
    opt = nf.optim.adamw(1e-3, weight_decay=0.1)
    return train.lower_abstract(cfg, nf.ParallelConfig(*sizes), seq_len=seq_len, batch_per_rank=2, opt=opt).program


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--config", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--max-variables", type=int, default=1_500_000,
                        help="leave out a layout whose integer program is larger (its model alone takes minutes)")
    args = parser.parse_args()
    print(f"llama {args.config}, {args.layers} layer(s), {args.seq_len} tokens a sequence, 8 simulated ranks; "
          f"HiGHS stopped after {args.seconds:.0f} s")
    print(f"{'layout':<9} {'search':>12} {'exact':>12} {'bound':>12} {'gap':>8} {'proven':>7} "
          f"{'variables':>10} {'search s':>9} {'exact s':>8} {'refined':>8} {'refine s':>8}")
    for name in args.layouts.split(","):
        p = program(LAYOUTS[name], args.layers, args.config, args.seq_len)
        problem = solve.Problem(p.traced.graph, p.sizes, p.in_layouts, p.out_layouts)
        began = time.perf_counter()
        searched = problem.solve()
        search_s = time.perf_counter() - began
        if exact.size(problem) > args.max_variables:
            began = time.perf_counter()
            refined = problem.total(exact._chosen(problem, refine.refine(problem, searched.choice, 1_000_000,
                                                                          args.seconds)))
            print(f"{name:<9} {searched.cost:>12.1f} {'':>12} {'':>12} {'':>8} {'':>7} "
                  f"{'~' + str(exact.size(problem)):>10} {search_s:>9.2f} {'':>8} "
                  f"refined {refined:.1f} ({100 * (1 - refined / searched.cost):.2f}% below the search) in "
                  f"{time.perf_counter() - began:.2f} s (over --max-variables)", flush=True)
            continue
        began = time.perf_counter()
        refined = problem.total(exact._chosen(problem, refine.refine(problem, searched.choice, 1_000_000,
                                                                      args.seconds)))
        refine_s = time.perf_counter() - began
        # the least-cost plan that nowhere holds more than the search's (`planning/memory.py`)
        found = exact.solve(problem, time_limit=args.seconds, start=searched.choice,
                            memory=refine.bound(problem, searched.choice))
        print(f"{name:<9} {searched.cost:>12.1f} {found.cost:>12.1f} {found.bound:>12.1f} "
              f"{100 * found.gap(searched.cost):>7.2f}% {'yes' if found.optimal else 'no':>7} "
              f"{found.variables:>10} {search_s:>9.2f} {found.seconds:>8.1f} {100 * found.gap(refined):>7.2f}% "
              f"{refine_s:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
