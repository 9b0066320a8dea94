"""Activation memory and step time of the llama train step with and without nf.remat, one rank.

    python benchmarks/remat.py [--layers 8] [--dim 256] [--batch 8] [--seq 256] [--repeats 5]

Activation memory is the program's peak (from liveness, `cost_analysis`) less what every step
holds whatever the policy: parameters, their gradients and Adam's two moments (4 x parameter
bytes; the step donates its parameters and state). Measured: the growth of the process's
resident-set high-water mark during the first step after compiling, each policy in a fresh
process (peaks do not mix). Step time is the median of `--repeats` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time

import optree
import torch

import ndfunc as nf
from models import llama, train

POLICIES = ("none", "full", "save_dots")


def run(args, policy: str) -> dict:
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=args.layers, dim=args.dim, ffn_dim=4 * args.dim,
                              max_seq_len=args.seq, remat=None if policy == "none" else policy)
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g) for k in ("tokens", "targets")}
    opt = nf.optim.adamw(1e-3)
    params = llama.init(cfg, nf.random.key(0))
    state = opt.init(params)
    step = nf.jit(train.make_step(cfg, opt), donate_argnums=(0, 1))
    lowered = step.lower(params, state, batch)
    costs = lowered.cost_analysis()
    lowered.compile()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params, state, loss = step(params, state, batch)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        params, state, loss = step(params, state, batch)
        times.append(time.perf_counter() - start)
    fixed = 4 * sum(p.numel() * p.element_size() for p in optree.tree_leaves(params))
    return {"policy": policy, "peak": costs["peak_memory_bytes"], "activations": costs["peak_memory_bytes"] - fixed,
            "measured": grown, "step_s": statistics.median(times), "flops": costs["flops"], "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policy", choices=POLICIES, help="measure this one only, print JSON (used internally)")
    args = parser.parse_args()
    if args.policy:
        print(json.dumps(run(args, args.policy)))
        return
    flags = [f"--{k}={v}" for k, v in vars(args).items() if k != "policy"]
    rows = {}
    for policy in POLICIES:  # each in its own process: resident-set peaks do not mix
        out = subprocess.run([sys.executable, __file__, *flags, f"--policy={policy}"], capture_output=True, text=True,
                             check=True)
        rows[policy] = json.loads(out.stdout.strip().splitlines()[-1])
    base = rows["none"]
    print(f"llama {args.layers} layers, dim {args.dim}, batch {args.batch} x {args.seq}, one rank, torch {torch.__version__}")
    for policy, r in rows.items():
        print(f"  {policy:>9}: activations {r['activations'] / 2**20:7.1f} MiB (program, "
              f"{r['activations'] / base['activations'] - 1:+.0%}), measured {r['measured'] / 2**20:7.1f} MiB "
              f"({r['measured'] / base['measured'] - 1:+.0%}), step {r['step_s'] * 1e3:6.1f} ms "
              f"({r['step_s'] / base['step_s'] - 1:+.0%} time), flops x{r['flops'] / base['flops']:.2f}, loss {r['loss']:.4f}")


if __name__ == "__main__":
    main()
