"""The collectives and bytes of the llama train step's program on the canonical layouts.

    python benchmarks/programs.py [--config tiny] [--json OUT]

Lowers (does not run) the step of `models.train` on DP, FSDP, FSDP with `nf.fsdp`, FSDP+TP,
CP with ring attention, HSDP+TP and 4D, 8 simulated ranks each, and prints per layout what
`Lowered.cost_analysis()` reports: collectives by kind, bytes sent per rank by kind, flops and
peak memory. A compiler change that should not change programs leaves this output unchanged: save
it before (`--json`) and compare after.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

import ndfunc as nf
from models import llama, train
from ndfunc.sharding import P

# name: (ParallelConfig sizes, transforms)
LAYOUTS = {
    "dp": ((8, 1, 1, 1), ()),
    "fsdp": ((1, 8, 1, 1), ()),
    "fsdp+schedule": ((1, 8, 1, 1), ("fsdp",)),
    "fsdp+tp": ((1, 4, 1, 2), ()),
    "cp+ring": ((1, 1, 8, 1), ("ring",)),
    "hsdp+tp": ((2, 2, 1, 2), ()),
    "4d": ((1, 2, 2, 2), ()),
    "4d+ring+schedule": ((1, 2, 2, 2), ("ring", "fsdp")),
}


def program(name: str, cfg: llama.LlamaConfig, micro_batch: int = 2, seq: int = 64, text: str | None = None) -> dict:
    sizes, names = LAYOUTS[name]
    config = nf.ParallelConfig(*sizes)
    with nf.simulate(config.total_size):
        mesh = config.build_mesh()
        opt = nf.optim.adamw(1e-3, weight_decay=0.1)
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        params = llama.init(cfg, nf.random.key(0))
        state = opt.init(params)
        sspec = nf.optim.state_shardings(state, pspec)
        n = micro_batch * config.dp_world_size
        batch = {"tokens": torch.zeros(n, seq, dtype=torch.long), "targets": torch.zeros(n, seq, dtype=torch.long),
                 "positions": torch.arange(seq).expand(n, seq).contiguous()}
        bspec = {k: config.batch_spec for k in batch}
        transforms = [nf.ring_attention("cp", load_balance=None) if t == "ring" else nf.fsdp(("dp_shard", "cp"))
                      for t in names]
        step = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh, in_shardings=(pspec, sspec, bspec),
                      out_shardings=(pspec, sspec, P()), transforms=transforms)
        lowered = step.lower(params, state, batch)
        costs = lowered.cost_analysis()
        if text:
            pathlib.Path(text).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(text) / f"{name}.txt").write_text(lowered.as_text())
    return {"collectives": dict(sorted(costs["collectives"].items())),
            "comm_bytes": dict(sorted(costs["comm_bytes"].items())),
            "flops": costs["flops"], "peak_memory_bytes": costs["peak_memory_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--text", help="also write each program's as_text() to DIR/<layout>.txt")
    args = parser.parse_args()
    cfg = getattr(llama.LlamaConfig, args.config)()
    results = {}
    for name in args.layouts:
        r = results[name] = program(name, cfg, text=args.text)
        print(f"{name:>18}: {r['collectives']}  bytes {r['comm_bytes']}  flops {r['flops']:.4g}  "
              f"peak {r['peak_memory_bytes'] / 2**20:.2f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
