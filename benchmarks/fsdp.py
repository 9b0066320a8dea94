"""FSDP and FSDP+TP on 4 gloo processes: nf.jit against PyTorch's own composition.

    python benchmarks/fsdp.py [--model mid] [--steps 5]          # runs both, both strategies; prints ratios
    python benchmarks/fsdp.py --rounds 5                       # each side 5 times, alternating; medians
    python benchmarks/fsdp.py --gather-copies-max 1048576      # nf.jit's bigger gathers as gloo's own
    python benchmarks/fsdp.py --aten-matmul                    # nf.jit's matmuls as PyTorch's (MKL)

PyTorch's way, as torchtitan does it: the Hugging Face `LlamaForCausalLM` with the same weights
(written by `models.hf.save_llama`); FSDP by `fully_shard` on each decoder layer and on the root
over `dp_shard` (FSDP2, resharding after forward); for FSDP+TP, `parallelize_module` over `tp`
first (q/k/v and the MLP's up projections column-wise, o and down row-wise); `torch.optim.AdamW`.
nf.jit: the same model as pure functions, `ParallelConfig` rules (parameters sharded over
`dp_shard`, heads and MLP over `tp`), `nf.fsdp('dp_shard')` for the gather schedule. On an AMD
CPU nf.jit runs its fp32 matmuls as oneDNN's, where PyTorch's `mm` runs MKL's AVX2 path
(ndfunc._src.partition.backends.cpu_kernels); `--aten-matmul` (NDFUNC_ATEN_MATMUL=1) gives both sides the same
matmul kernel, so the ratio is the partitioner's and the FSDP schedule's alone.

Each implementation runs in its own 4 processes (so their memory peaks do not mix), over the same
batches. Per rank: median step time, and the resident set's high-water mark during a step (reset
before it through /proc/self/clear_refs; Linux), absolute and above the memory held before the
step. Both sides join their processes by `nf.init()`, so both keep the host memory a step frees
mapped for the next (`ndfunc._src.host_memory`), and what a step adds above what was held before it is
small. Reported: the ratios nf.jit / PyTorch and both loss curves; and the CPU time each process
spends per step (with more ranks than cores, the step time follows the work the ranks do, not
their waits). The slowest rank's figures count. A shared machine's speed drifts from minute to
minute, so one round's ratio can be a few hundredths off; `--rounds N` runs each side N times,
alternating which goes first, prints each round's step ratio and reports medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _llama import CONFIGS, setup

import ndfunc as nf
from models import hf, llama, train
from ndfunc.sharding import NamedSharding, P

LAYOUTS = {"fsdp": (1, 4, 1, 1), "fsdp_tp": (1, 2, 1, 2)}


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def measure(step, batches) -> tuple[list, list, list, int, int]:
    """(losses, step seconds, CPU seconds of this process per step, high-water mark during the
    last step, memory before it), bytes."""
    losses, times, cpu = [float(step(batches[0]))], [], []
    for b in batches[1:]:
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from here
        before = _kib("VmRSS:")
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(float(step(b)))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return losses, times, cpu, _kib("VmHWM:") * 1024, before * 1024


def torch_step(path, config: nf.ParallelConfig, mesh, lr, wd):
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # (the Llama `models.hf.save_llama` wrote; `moe.py`'s Mixtral)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
    if config.tp_size > 1:
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh.device_mesh["tp"], plan)
    dp_mesh = mesh.device_mesh["dp_shard"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, eps=1e-8)
    group = mesh.device_mesh.get_group("dp_shard")

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["tokens"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
        loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total / config.dp_shard_size

    return step


def _jitted(cfg, config: nf.ParallelConfig, mesh, params, lr, wd):
    """nf.jit's step, its optimizer state for `params` (tensors or stand-ins) and the specs of both."""
    opt = nf.optim.adamw(lr, weight_decay=wd)
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    state = opt.init(params)
    # (over stand-ins, state_shardings gives stand-ins: their shardings are the specs)
    sspec = optree.tree_map(lambda x: getattr(x, "sharding", x), nf.optim.state_shardings(state, pspec),
                            is_leaf=lambda x: isinstance(x, (P, nf.ShapeDtypeStruct)))
    bspec = {"tokens": config.batch_spec, "targets": config.batch_spec}
    jitted = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh, in_shardings=(pspec, sspec, bspec),
                    out_shardings=(pspec, sspec, P()), donate_argnums=(0, 1), transforms=[nf.fsdp("dp_shard")])
    return jitted, state, pspec, sspec


def named(mesh, specs):
    return optree.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def lowered_abstract(model: str, config: nf.ParallelConfig, batch: int, seq: int):
    """The nf.jit step `worker` runs, lowered over stand-ins on `config`'s abstract mesh (no ranks)."""
    cfg = CONFIGS[model]
    mesh = config.build_abstract_mesh()
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    params = llama.abstract_params(cfg, named(mesh, pspec))
    jitted, state, _, _ = _jitted(cfg, config, mesh, params, 1e-3, 0.1)
    tokens = nf.ShapeDtypeStruct((batch, seq), torch.long, sharding=NamedSharding(mesh, config.batch_spec))
    return jitted.lower(params, state, {"tokens": tokens, "targets": tokens})


def jit_step(cfg, config: nf.ParallelConfig, mesh, params, lr, wd):
    jitted, state, pspec, sspec = _jitted(cfg, config, mesh, params, lr, wd)
    carry = [nf.device_put(params, named(mesh, pspec)), nf.device_put(state, named(mesh, sspec))]

    def step(batch):
        placed = nf.device_put(batch, {k: NamedSharding(mesh, config.batch_spec) for k in batch})
        carry[0], carry[1], loss = jitted(carry[0], carry[1], placed)
        return nf.device_get(loss)

    return step


def worker(args) -> None:
    nf.init()
    if args.gather_copies_max is not None:
        from ndfunc._src.partition.backends import gloo as algorithms
        algorithms.GATHER_COPIES_MAX = args.gather_copies_max
    rank = nf.rank()
    config = nf.ParallelConfig(*LAYOUTS[args.layout])
    mesh = config.build_mesh()
    cfg, params, batches = setup(args.model, args.batch, args.seq, args.steps)
    lr, wd = 1e-3, 0.1
    if args.impl == "torch":
        path = os.path.join(tempfile.gettempdir(), f"ndfunc-bench-{args.model}")
        if rank == 0:
            hf.save_llama(path, cfg, params)
        dist.barrier()
        run = own_rows(torch_step(path, config, mesh, lr, wd), args.batch, config, mesh, rank)
    else:
        run = jit_step(cfg, config, mesh, params, lr, wd)
    report(rank, run, batches)
    nf.shutdown()


def own_rows(step, batch: int, config: nf.ParallelConfig, mesh, rank: int):
    """`step` given this rank's rows of each global batch (its block along dp_shard), as a
    data loader gives FSDP2's ranks theirs."""
    per = batch // config.dp_shard_size
    me = mesh.coordinate(rank)[1]  # position along dp_shard
    return lambda b: step({k: v[me * per:(me + 1) * per] for k, v in b.items()})


def report(rank: int, run, batches) -> None:
    """`run` over `batches` (`measure`), printed as the JSON line `main` reads from each rank."""
    losses, times, cpu, peak, before = measure(run, batches)
    print(json.dumps({"rank": rank, "losses": losses, "step_s": statistics.median(times),
                      "cpu_s": statistics.median(cpu), "peak": peak, "before": before}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mid", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over dp_shard)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each side this many times, alternating which goes first; report medians")
    parser.add_argument("--strategies", nargs="+", default=list(LAYOUTS), choices=sorted(LAYOUTS))
    parser.add_argument("--gather-copies-max", type=int,
                        help="nf.jit on gloo: gathers up to this many bytes (gathered) run as all-to-alls "
                             "(ndfunc._src.partition.backends.gloo.GATHER_COPIES_MAX), bigger ones as gloo's own")
    parser.add_argument("--aten-matmul", action="store_true",
                        help="nf.jit runs every matmul as aten's, the kernel PyTorch's side runs, even where "
                             "oneDNN's is faster (ndfunc._src.partition.backends.cpu_kernels)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help="(internal) run one, under torchrun")
    parser.add_argument("--impl", choices=["torch", "jit"], help="(internal) run one, under torchrun")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")
    if args.impl:
        worker(args)
        return
    for layout in args.strategies:
        # rounds alternate which side runs first; each side's figures are the median over rounds
        rounds = [{impl: _run(args, layout, impl) for impl in (("torch", "jit") if k % 2 == 0 else ("jit", "torch"))}
                  for k in range(args.rounds)]
        per = [{impl: _figures(rows) for impl, rows in r.items()} for r in rounds]
        f = {i: {key: statistics.median(p[i][key] for p in per) for key in per[0][i]} for i in ("torch", "jit")}
        print(f"{layout} ({args.model}, batch {args.batch} x {args.seq}, 4 gloo processes, layout {LAYOUTS[layout]}):")
        if args.rounds > 1:
            print("  step ratio per round: " + " ".join(f"{p['jit']['step'] / p['torch']['step']:.2f}" for p in per))
        print(f"  step: PyTorch {f['torch']['step'] * 1e3:.1f} ms, nf.jit {f['jit']['step'] * 1e3:.1f} ms, "
              f"ratio {f['jit']['step'] / f['torch']['step']:.2f}")
        print(f"  CPU time per rank and step (the ranks share {os.cpu_count()} cores): PyTorch "
              f"{f['torch']['cpu'] * 1e3:.1f} ms, nf.jit {f['jit']['cpu'] * 1e3:.1f} ms, "
              f"ratio {f['jit']['cpu'] / f['torch']['cpu']:.2f}")
        print(f"  peak resident set per rank: PyTorch {f['torch']['peak'] / 2**20:.1f} MiB, nf.jit "
              f"{f['jit']['peak'] / 2**20:.1f} MiB, ratio {f['jit']['peak'] / f['torch']['peak']:.2f}; during the "
              f"step, above what was held before: PyTorch {f['torch']['grown'] / 2**20:.1f} MiB, nf.jit "
              f"{f['jit']['grown'] / 2**20:.1f} MiB")
        for impl in ("torch", "jit"):
            print(f"  losses {impl:>5}: {' '.join(f'{x:.4f}' for x in rounds[0][impl][0]['losses'])}")
        gap = max(abs(a - b) for a, b in zip(rounds[0]["torch"][0]["losses"], rounds[0]["jit"][0]["losses"]))
        print(f"  largest loss difference: {gap:.1e}")


def _run(args, layout: str, impl: str) -> list[dict]:
    """One side's 4 processes under torchrun: a dict per rank."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          __file__, f"--model={args.model}", f"--batch={args.batch}", f"--seq={args.seq}",
                          f"--steps={args.steps}", f"--layout={layout}", f"--impl={impl}",
                          *([f"--gather-copies-max={args.gather_copies_max}"]
                            if args.gather_copies_max is not None else [])],
                         capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", **_aten_matmul_env(args)))
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    # one JSON object per rank (lines of several ranks may run together)
    return [json.loads(m) for m in re.findall(r"\{[^{}]*\}", out.stdout)]


def _aten_matmul_env(args) -> dict:
    """What the ranks' environment adds for --aten-matmul (ndfunc._src.partition.backends.cpu_kernels reads it)."""
    return {"NDFUNC_ATEN_MATMUL": "1"} if args.aten_matmul else {}


def _figures(rows: list[dict]) -> dict:
    """The slowest rank's figures: it sets the pace (and the memory a machine must have)."""
    return {"step": max(r["step_s"] for r in rows), "cpu": max(r["cpu_s"] for r in rows),
            "peak": max(r["peak"] for r in rows), "grown": max(r["peak"] - r["before"] for r in rows)}


if __name__ == "__main__":
    main()
