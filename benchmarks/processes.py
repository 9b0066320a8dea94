"""What driving real ranks from one process (`nf.processes`) costs against torchrun running the same
step: a llama train step (loss, gradients, AdamW) on 4 CPU processes over gloo, dp_shard 2 x tp 2.

    python benchmarks/processes.py [--models tiny mid] [--ranks 4] [--steps 30] [--repeats 3]

Both run `run_steps` below, the same code: under torchrun each rank runs it; under `nf.processes`
this process does, as a notebook would, and each call is sent to the workers. Per step: the wall
time of `--steps` steps issued in a row and waited for at the end (after three warm-up steps), the
median of `--repeats` such runs; their ratio (the goal: within 10%), and rank 0's CPU a step. The controller's own time per
call is the time a call takes to return here when its signature is known (it only issues), and the
CPU this process spends per step. `step, loop in one call`: the same loop sent to the workers as
one call, each running it as a torchrun rank would, so the step's cost in a worker process is told
apart from the dispatch's. Also: how long starting the workers takes, and the first call of the
step (each rank lowers it) against torchrun's. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

import ndfunc as nf
from models import llama
from ndfunc.sharding import P

LAYOUTS = {2: nf.ParallelConfig(dp_shard_size=2), 4: nf.ParallelConfig(dp_shard_size=2, tp_size=2),
           8: nf.ParallelConfig(dp_shard_size=2, cp_size=2, tp_size=2)}
CONFIGS = {"tiny": llama.LlamaConfig.tiny(), "mid": llama.LlamaConfig(vocab_size=4096, dim=256, n_layers=4,
                                                                          n_heads=8, n_kv_heads=4, ffn_dim=768)}
SEQ, MICRO = 64, 2


def run_steps(model: str, ranks: int, steps: int, repeats: int, rank_cpu=time.process_time) -> dict:
    """Make the step and time it; the same code under torchrun and under `nf.processes`.
    `rank_cpu()`: rank 0's CPU seconds so far (under nf.processes, asked of the worker)."""
    config = LAYOUTS[ranks]
    cfg, opt = CONFIGS[model], nf.optim.adamw(1e-3)
    mesh = config.build_mesh()
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)

    def step(params, opt_state, batch):
        loss, grads = nf.value_and_grad(llama.loss)(params, batch, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return nf.optim.apply_updates(params, updates), opt_state, loss

    params = nf.jit(lambda key: llama.init(cfg, key), mesh=mesh, out_shardings=pspec)(nf.random.key(0))
    opt_state = opt.init(params)
    sspec = nf.optim.state_shardings(opt_state, pspec)
    bspec = {"tokens": config.batch_spec, "targets": config.batch_spec}
    train_step = nf.jit(nf.sharding.axis_rules(config.rules)(step), mesh=mesh, in_shardings=(pspec, sspec, bspec),
                        out_shardings=(pspec, sspec, P()), donate_argnums=(0, 1))
    g = torch.Generator().manual_seed(0)
    batch = MICRO * config.dp_world_size
    batches = [{"tokens": torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=g),
                "targets": torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=g)} for _ in range(steps)]
    start = time.perf_counter()
    params, opt_state, loss = train_step(params, opt_state, batches[0])
    float(loss)
    first = time.perf_counter() - start
    for b in batches[:3]:
        params, opt_state, loss = train_step(params, opt_state, b)
    float(loss)
    per_step, issue, cpu, rank = [], [], [], []
    for _ in range(repeats):
        rank_start = rank_cpu()
        start, cpu_start, issuing = time.perf_counter(), time.process_time(), 0.0
        for b in batches:
            t = time.perf_counter()
            params, opt_state, loss = train_step(params, opt_state, b)
            issuing += time.perf_counter() - t
        float(loss)
        per_step.append((time.perf_counter() - start) / steps)
        issue.append(issuing / steps)
        cpu.append((time.process_time() - cpu_start) / steps)
        rank.append((rank_cpu() - rank_start) / steps)
    return {"first_call_s": first, "step_s": statistics.median(per_step), "issue_s": statistics.median(issue),
            "cpu_s": statistics.median(cpu), "rank_cpu_s": statistics.median(rank), "loss": float(loss)}


def _torchrun(model: str, ranks: int, steps: int, repeats: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # as torchrun sets it, and as nf.processes gives each rank
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), str(pathlib.Path(__file__).resolve()), "--under-torchrun", "--models", model,
                           "--ranks", str(ranks), "--steps", str(steps), "--repeats", str(repeats)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=["tiny", "mid"])
    parser.add_argument("--ranks", type=int, choices=sorted(LAYOUTS), default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--under-torchrun", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.under_torchrun:
        nf.init()
        result = run_steps(args.models[0], args.ranks, args.steps, args.repeats)
        if nf.rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
        nf.shutdown()
        return

    torchrun = {m: _torchrun(m, args.ranks, args.steps, args.repeats) for m in args.models}
    started = time.perf_counter()
    workers = nf.processes(args.ranks, device="cpu").start()
    start_s = time.perf_counter() - started
    try:
        processes = {m: run_steps(m, args.ranks, args.steps, args.repeats,
                                  rank_cpu=lambda: workers.each(time.process_time)[0]) for m in args.models}
        # the same loop run by each worker itself, in one call: the step in a worker, without dispatch
        inside = {m: workers.each(run_steps, m, args.ranks, args.steps, args.repeats)[0] for m in args.models}
    finally:
        workers.stop()

    print(f"{args.ranks} CPU ranks over gloo ({LAYOUTS[args.ranks].sizes}), {MICRO} sequences of {SEQ} tokens a "
          f"data-parallel rank; {args.steps} steps issued in a row, then waited for; median of {args.repeats}")
    print(f"{'model':<6}{'':<26}{'torchrun':>10}{'nf.processes':>14}{'ratio':>8}")
    for m in args.models:
        t, p = torchrun[m], processes[m]
        for name, key, scale in (("step (ms)", "step_s", 1e3), ("rank 0's CPU a step (ms)", "rank_cpu_s", 1e3),
                                 ("first call: lowering (s)", "first_call_s", 1)):
            a, b = t[key] * scale, p[key] * scale
            print(f"{m:<6}{name:<26}{a:>10.2f}{b:>14.2f}{b / a:>8.3f}")
        a, b = t["step_s"] * 1e3, inside[m]["step_s"] * 1e3
        print(f"{m:<6}{'step, loop in one call':<26}{a:>10.2f}{b:>14.2f}{b / a:>8.3f}  (each worker runs the loop)")
        print(f"{m:<6}controller per call: {p['issue_s'] * 1e3:.2f} ms to return (issued, not waited for), "
              f"{p['cpu_s'] * 1e3:.2f} ms of its CPU a step; same last loss as torchrun: {p['loss'] == t['loss']}")
    print(f"starting {args.ranks} workers (Monarch, then nf.init on each): {start_s:.2f} s")


if __name__ == "__main__":
    main()
