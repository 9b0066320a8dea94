"""The planner's predicted step time against benchmarks/fsdp.py's measured one, on this CPU box.

    python benchmarks/plan_cpu.py [--model mid] [--batch 8] [--seq 128] [--steps 5] [--rounds 3]

Issue 20, item 5: does `ndfunc.plan.estimate`, given a cluster entry that describes this machine,
rank the layouts of benchmarks/fsdp.py (`fsdp` = dp_shard 4, `fsdp_tp` = dp_shard 2 x tp 2, on 4
gloo processes) in the order their measured step times put them?

1. The machine, measured in this run (nothing hard-coded), by 4 processes under torchrun with one
   thread each (`OMP_NUM_THREADS=1`), as benchmarks/fsdp.py's ranks run, all 4 at once, so each
   gets its share of the machine's cores (4 ranks on 2 cores here):
   - matmul rate: each rank runs the fp32 `torch.mm`s of one training step of the model at each
     layout's local shapes (forward `x @ W`, backward `dy @ W.T` and `x.T @ dy`; tp-sharded
     weights split as `ParallelConfig`'s rules split them), in a loop for a few seconds; flops
     done / seconds, the median over ranks, over both layouts' shapes. The planner only knows bf16
     peaks, so this measured **fp32** rate is passed as the device's peak
     (`Device.cpu(peak_flops=...)`), and `Efficiency.matmul` is 1.0: the rate was measured at the
     model's own matmul sizes. (On this AMD CPU without AVX-512 nf.jit runs its matmuls as aten's,
     `torch.mm`, ndfunc._src.partition.backends.cpu_kernels; elsewhere it may run oneDNN's.)
   - attention: `F.scaled_dot_product_attention` (causal, grouped KV heads), forward and backward,
     at each layout's local shapes; `Efficiency.attention` = the planner's executed attention flops
     per second so measured / the matmul rate (at most 1).
   - memory bandwidth (the planner prices the optimizer step with it): `torch.add(a, b, out=c)` on
     64 MiB arrays, 12 bytes an element, per rank, all 4 at once.
   - the link: the collectives as nf.jit runs them on gloo (ndfunc._src.partition.backends.gloo:
     all-gather and reduce-scatter as one all-to-all), 4 KiB to 4 MiB, over the 4 ranks and over
     two pairs at once (tp's groups); `latency` and `bandwidth` fitted to the planner's alpha-beta
     cost `(n - 1) * latency + size * (n - 1) / n / bandwidth` by least squares on relative error.
   - memory: MemTotal from /proc/meminfo, a quarter to each rank (the 4 share it).
   All 4 ranks are on one node (`gpus_per_node = 4`, the inter-node link set to the same figures).
2. Each layout predicted by `estimate` for the benchmark's model (`TransformerShape.from_config`
   of `_llama.CONFIGS[model]`), global batch and sequence length, with the options the benchmark
   runs: no remat, micro-batch = the per-rank batch (no accumulation), FSDP resharding after
   forward and prefetching one layer (nf.fsdp's defaults). The ranks compute and move fp32, where
   the planner prices gathered weights and activations at 2 bytes (bf16) by default; the prediction
   the verdict uses prices them at 4 (`Options(compute_bytes=4)`); the 2-byte prediction is
   printed too.
3. Each layout measured by benchmarks/fsdp.py's own runner (`fsdp._run(args, layout, "jit")`: 4
   processes under torchrun, nf.jit, `--steps` steps after the compiling one): the slowest rank's
   median step time, as fsdp.py reports it; `--rounds` runs alternate the layouts' order, and the
   median over rounds counts.
4. Each layout's step as a program (`ndfunc.plan.plan_step`): benchmarks/fsdp.py's nf.jit step
   lowered over stand-ins on an abstract 4-rank mesh, replayed op by op on the same figures (each
   op's roofline time, each collective on the fitted link, waits where the program waits). It
   reads what the closed forms leave out (norms, rotary, softmax, casts: their bytes at the
   measured bandwidth) and the program's own schedule.

Prints the machine's figures, then per layout: predicted s/step (compute, TP, FSDP, optimizer
parts), measured s/step, predicted / measured, and whether the predicted order of the layouts is
the measured one, for the closed forms and for the replayed programs. Exits 0 either way.

Timings need a quiet machine: the ranks share the cores with anything else running, and so do the
probes that describe the machine. The 1-minute load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp as bench  # benchmarks/fsdp.py (this directory is on sys.path when run as a script)
from _llama import CONFIGS
import ndfunc as nf
from ndfunc.plan import Cluster, Device, Efficiency, Layout, Options, TransformerShape, estimate, plan_step

LAYOUTS = bench.LAYOUTS  # (dp_replicate, dp_shard, cp, tp)
SIZES = (2**12, 2**14, 2**16, 2**18, 2**20, 2**22)  # bytes: a collective's whole (gathered) buffer
RANKS = 4


# ---------------------------------------------------------------------------------------------
# probes: run under torchrun, one thread per rank, all ranks at once


def _matmuls(cfg, layout: tuple, batch: int, seq: int) -> list[tuple[int, int, int, int]]:
    """(tokens, in, out, count) of one step's projections on one rank: column-parallel weights
    (q, k, v, w1, w3, the output head over the vocabulary) split their output over tp, row-parallel
    ones (o, w2) their input."""
    _, dp_shard, _, tp = layout
    tokens = batch // dp_shard * seq
    d, hd, f, v = cfg.dim, cfg.dim // cfg.n_heads, cfg.ffn_dim, cfg.vocab_size
    col = [(d, cfg.n_heads * hd), (d, cfg.n_kv_heads * hd), (d, cfg.n_kv_heads * hd), (d, f), (d, f)]
    row = [(cfg.n_heads * hd, d), (f, d)]
    shapes = [(tokens, i, o // tp, cfg.n_layers) for i, o in col] + [(tokens, i // tp, o, cfg.n_layers) for i, o in row]
    return shapes + [(tokens, d, v // tp, 1)]


def _window(work, seconds: float) -> float:
    """Units of work per second while every rank runs `work` (a list of (callable, units)) in a loop."""
    for f, _ in work:
        f()
    dist.barrier()
    start, done = time.perf_counter(), 0.0
    while time.perf_counter() - start < seconds:
        for f, units in work:
            f()
            done += units
    rate = done / (time.perf_counter() - start)
    dist.barrier()
    return rate


def _matmul_work(cfg, layout, batch, seq) -> list:
    g = torch.Generator().manual_seed(dist.get_rank())
    work = []
    for t, i, o, count in _matmuls(cfg, layout, batch, seq):
        x, w, dy = (torch.randn(t, i, generator=g), torch.randn(i, o, generator=g), torch.randn(t, o, generator=g))
        flops = 2 * t * i * o
        for f in (lambda x=x, w=w: torch.mm(x, w), lambda dy=dy, w=w: torch.mm(dy, w.t()),
                  lambda x=x, dy=dy: torch.mm(x.t(), dy)):
            work += [(f, flops)] * count
    return work


def _attention_work(cfg, layout, batch, seq) -> list:
    """One layer's SDPA forward and backward on one rank, counted in the planner's executed flops
    (`TransformerShape.executed_flops_per_token`: 2 * dim * seq per token forward, x3 with backward)."""
    _, dp_shard, _, tp = layout
    b, hd = batch // dp_shard, cfg.dim // cfg.n_heads
    g = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(b, cfg.n_heads // tp, seq, hd, generator=g, requires_grad=True)
    k = torch.randn(b, cfg.n_kv_heads // tp, seq, hd, generator=g, requires_grad=True)
    v = torch.randn(b, cfg.n_kv_heads // tp, seq, hd, generator=g, requires_grad=True)
    dout = torch.randn(q.shape, generator=g)

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=cfg.n_heads != cfg.n_kv_heads)
        torch.autograd.grad(out, (q, k, v), dout)

    return [(run, b * seq / tp * 2 * cfg.dim * seq * 3)]


def _collective(kind: str, nbytes: int, group) -> callable:
    """The form nf.jit runs on gloo (backends/gloo.py): one all-to-all of the same bytes."""
    n = dist.get_world_size(group)
    numel = nbytes // 4
    whole, block = torch.randn(numel), torch.randn(numel // n)
    swapped = torch.empty(numel)
    if kind == "all-gather":
        return lambda: dist.all_to_all_single(swapped, block.repeat(n), group=group)
    return lambda: (dist.all_to_all_single(swapped, whole, group=group), swapped.view(n, -1).sum(0))


def _time_call(f, group, min_s: float = 0.1, min_reps: int = 5) -> float:
    """Seconds per call of a collective, timed on every rank of `group` with the same repetitions."""
    for _ in range(2):
        f()
    dist.barrier()
    start = time.perf_counter()
    f()
    once = time.perf_counter() - start
    reps = torch.tensor([max(min_reps, int(min_s / max(once, 1e-6)))])
    dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # every rank the same count: ranks leave together
    dist.barrier()
    start = time.perf_counter()
    for _ in range(int(reps)):
        f()
    return (time.perf_counter() - start) / int(reps)


def probe(args) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = CONFIGS[args.model]
    out: dict = {"matmul": {}, "attention": {}}
    for name, layout in LAYOUTS.items():
        out["matmul"][name] = _window(_matmul_work(cfg, layout, args.batch, args.seq), args.probe_seconds)
        out["attention"][name] = _window(_attention_work(cfg, layout, args.batch, args.seq), args.probe_seconds / 2)
    numel = 2**24
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    out["memory_bandwidth"] = _window([(lambda: torch.add(a, b, out=c), 12 * numel)], args.probe_seconds / 2)
    del a, b, c
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    comm = []
    for size in SIZES:
        for kind in ("all-gather", "reduce-scatter"):
            comm.append({"kind": kind, "n": n, "bytes": size, "s": _time_call(_collective(kind, size, None), None)})
            group = pairs[rank // 2]
            comm.append({"kind": kind, "n": 2, "bytes": size, "s": _time_call(_collective(kind, size, group), group)})
    out["comm"] = comm
    gathered = [None] * n
    dist.all_gather_object(gathered, out)
    if rank == 0:
        print("PROBE " + json.dumps(gathered), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the driver


def _meminfo_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def _fit(comm: list[dict]) -> tuple[float, float]:
    """(latency s, bandwidth B/s) of `(n-1) * latency + size * (n-1)/n / bandwidth`, least squares
    on the relative error; a negative latency is set to 0 and the bandwidth fitted again."""
    rows = torch.tensor([[(m["n"] - 1) / m["s"], m["bytes"] * (m["n"] - 1) / m["n"] / m["s"]] for m in comm],
                        dtype=torch.float64)
    ones = torch.ones(len(comm), 1, dtype=torch.float64)
    alpha, inv_bw = torch.linalg.lstsq(rows, ones).solution.flatten().tolist()
    if alpha < 0 or inv_bw <= 0:
        alpha = 0.0
        inv_bw = torch.linalg.lstsq(rows[:, 1:], ones).solution.item()
    return alpha, 1 / inv_bw


def _probe_machine(args) -> dict:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(RANKS), __file__, "--probe", f"--model={args.model}", f"--batch={args.batch}",
                          f"--seq={args.seq}", f"--probe-seconds={args.probe_seconds}"],
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    ranks = json.loads(re.search(r"^PROBE (.*)$", out.stdout, re.M).group(1))
    med = statistics.median
    matmul = {k: med(r["matmul"][k] for r in ranks) for k in LAYOUTS}
    attention = {k: med(r["attention"][k] for r in ranks) for k in LAYOUTS}
    comm = [dict(m, s=max(r["comm"][i]["s"] for r in ranks)) for i, m in enumerate(ranks[0]["comm"])]
    return {"matmul": matmul, "attention": attention, "comm": comm,
            "memory_bandwidth": med(r["memory_bandwidth"] for r in ranks)}


def cpu_cluster(figures: dict) -> tuple[Cluster, Efficiency, dict]:
    """This box as a planner cluster: 4 ranks on one node, the figures measured by `probe`."""
    peak = statistics.fmean(figures["matmul"].values())  # both layouts' shapes, equally weighted
    attn = min(1.0, statistics.fmean(figures["attention"].values()) / peak)
    latency, bandwidth = _fit(figures["comm"])
    device = Device.cpu(memory_bytes=_meminfo_bytes() / RANKS, peak_flops=peak,
                        memory_bandwidth=figures["memory_bandwidth"])
    cluster = Cluster(RANKS, RANKS, device, bandwidth, latency, bandwidth, latency)
    return cluster, Efficiency(matmul=1.0, attention=attn), {"latency": latency, "bandwidth": bandwidth}


def predict(args, cluster: Cluster, efficiency: Efficiency, nbytes: int) -> dict:
    shape = TransformerShape.from_config(CONFIGS[args.model], name=args.model)
    out = {}
    for name, (r, s, c, t) in LAYOUTS.items():
        layout = Layout(r, s, c, t)
        options = Options("none", micro_batch=args.batch // layout.dp_size, reshard_after_forward=True, prefetch=True,
                          compute_bytes=nbytes)
        out[name] = estimate(shape, layout, options, cluster=cluster, global_batch=args.batch, seq_len=args.seq,
                             efficiency=efficiency)
    return out


def replay(args, cluster: Cluster, efficiency: Efficiency) -> dict:
    """Each layout's nf.jit step (fsdp.py's, lowered over stand-ins, no ranks) replayed op by op
    on this box's figures (`plan_step`): the program's own flops, bytes and schedule."""
    layouts = {name: Layout(*sizes) for name, sizes in LAYOUTS.items()}
    by_layout = {lay: name for name, lay in layouts.items()}

    def lower(layout):
        return bench.lowered_abstract(args.model, nf.ParallelConfig(*layout.axis_sizes), args.batch, args.seq)
    planned = plan_step(lower, layouts.values(), cluster=cluster, tokens_per_step=args.batch * args.seq,
                        efficiency=efficiency)
    if planned.failed:
        raise SystemExit(f"not lowered: {planned.failed}")
    return {by_layout[e.layout]: e for e in (*planned.rows, *planned.too_big)}


def measure(args) -> dict:
    """The slowest rank's median step time per layout (fsdp.py's `_run` and `_figures`), median over rounds."""
    ns = argparse.Namespace(model=args.model, batch=args.batch, seq=args.seq, steps=args.steps,
                            gather_copies_max=None, aten_matmul=False)
    names, runs = list(LAYOUTS), {k: [] for k in LAYOUTS}
    for k in range(args.rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            step = bench._figures(bench._run(ns, name, "jit"))["step"]
            runs[name].append(step)
            print(f"  round {k + 1}: {name} {step * 1e3:.1f} ms/step", flush=True)
    return {k: (statistics.median(v), v) for k, v in runs.items()}


def _order(times: dict) -> list[str]:
    return sorted(times, key=times.get)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mid", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=8, help="global batch (benchmarks/fsdp.py's)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after the compiling one)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each layout, alternating their order")
    parser.add_argument("--probe-seconds", type=float, default=3.0, help="seconds per matmul probe window")
    parser.add_argument("--probe", action="store_true", help="(internal) one rank of the probes, under torchrun")
    args = parser.parse_args()
    if args.probe:
        probe(args)
        return 0
    load0 = os.getloadavg()[0]
    print(f"load average (1 min) at start: {load0:.2f}; {os.cpu_count()} cores, {RANKS} gloo ranks, "
          f"one thread each", flush=True)

    figures = _probe_machine(args)
    cluster, efficiency, link = cpu_cluster(figures)
    dev = cluster.device
    print("\nThis box as a planner cluster (measured now, 4 ranks at once):")
    print(f"  fp32 matmul rate per rank: {dev.peak_bf16_flops / 1e9:.2f} GFLOP/s (fsdp shapes "
          f"{figures['matmul']['fsdp'] / 1e9:.2f}, fsdp_tp shapes {figures['matmul']['fsdp_tp'] / 1e9:.2f}); "
          f"passed as the device peak, Efficiency.matmul 1.0")
    print(f"  attention (SDPA fwd+bwd, planner's flops): fsdp {figures['attention']['fsdp'] / 1e9:.2f}, fsdp_tp "
          f"{figures['attention']['fsdp_tp'] / 1e9:.2f} GFLOP/s -> Efficiency.attention {efficiency.attention:.3f}")
    print(f"  memory bandwidth per rank: {dev.memory_bandwidth / 1e9:.2f} GB/s; memory per rank "
          f"{dev.memory_bytes / 2**30:.2f} GiB (MemTotal / {RANKS})")
    print(f"  gloo link (nf.jit's all-to-all forms), fitted: latency {link['latency'] * 1e6:.1f} us, "
          f"bandwidth {link['bandwidth'] / 1e9:.3f} GB/s")
    print(f"    {'collective':>14} {'n':>2} {'bytes':>8} {'measured ms':>11} {'fit ms':>8}")
    for m in figures["comm"]:
        fit = (m["n"] - 1) * link["latency"] + m["bytes"] * (m["n"] - 1) / m["n"] / link["bandwidth"]
        print(f"    {m['kind']:>14} {m['n']:>2} {m['bytes']:>8} {m['s'] * 1e3:11.3f} {fit * 1e3:8.3f}")

    fp32 = predict(args, cluster, efficiency, 4)
    bf16 = predict(args, cluster, efficiency, 2)
    replayed = replay(args, cluster, efficiency)
    print(f"\nMeasuring benchmarks/fsdp.py's nf.jit step ({args.model}, batch {args.batch} x {args.seq}, "
          f"{args.steps} steps, {args.rounds} round(s)):", flush=True)
    measured = measure(args)

    print(f"\n{'layout':>8} {'mesh':>18} {'predicted':>9} {'compute':>8} {'tp':>7} {'fsdp':>7} {'optim':>7} "
          f"{'measured':>9} {'pred/meas':>9} {'planner bf16':>12}")
    for name in LAYOUTS:
        e, step = fp32[name], measured[name][0]
        t = e.time
        print(f"{name:>8} {str(e.layout):>18} {t.total:9.4f} {t.compute:8.4f} {t.tp:7.4f} {t.fsdp:7.4f} "
              f"{t.optimizer:7.4f} {step:9.4f} {t.total / step:9.2f} {bf16[name].time.total:12.4f}")
    print("  (seconds per step; predicted with activations and gathered weights at 4 bytes, as the ranks move "
          "them; 'planner bf16' is the planner's own 2-byte pricing)")
    for name in LAYOUTS:
        print(f"  measured {name}: median of {', '.join(f'{s * 1e3:.1f}' for s in measured[name][1])} ms")
    print(f"\nThe programs replayed (`plan_step`: each op's roofline time on the figures above, each collective "
          f"on the fitted link, in the program's order):")
    print(f"{'layout':>8} {'replayed':>9} {'compute':>8} {'exposed':>8} {'measured':>9} {'replay/meas':>11}")
    for name in LAYOUTS:
        t, step = replayed[name].time, measured[name][0]
        print(f"{name:>8} {t.total:9.4f} {t.compute:8.4f} {t.exposed:8.4f} {step:9.4f} {t.total / step:11.2f}")
    want = _order({k: v[0] for k, v in measured.items()})
    got = _order({k: v.time.total for k, v in fp32.items()})
    got_bf16 = _order({k: v.time.total for k, v in bf16.items()})
    print(f"\nmeasured order (fastest first): {' < '.join(want)}")
    print(f"predicted order:                {' < '.join(got)}  -> "
          f"{'MATCHES' if got == want else 'DOES NOT MATCH'} the measured order")
    print(f"planner's bf16-byte order:      {' < '.join(got_bf16)}  -> "
          f"{'matches' if got_bf16 == want else 'does not match'}")
    got_replay = _order({k: v.time.total for k, v in replayed.items()})
    print(f"replayed programs' order:       {' < '.join(got_replay)}  -> "
          f"{'MATCHES' if got_replay == want else 'DOES NOT MATCH'} the measured order")
    print(f"load average (1 min): {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
