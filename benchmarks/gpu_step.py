"""One GPU: a 0.9B llama's train step (bf16 compute, fp32 master weights, AdamW) as nf.jit, as eager
PyTorch and as torch.compile of the eager step, in one run: tokens/s and MFU.

    python benchmarks/gpu_step.py                        # CUDA: the 0.89B config, batch 4 x 2048 tokens
    python benchmarks/gpu_step.py --device cpu --tiny    # the tiny llama on CPU: a check that it runs
    python benchmarks/gpu_step.py --only jit eager --steps 20 --json out.json

The four take the same parameters, batch and hyperparameters:
- eager: fp32 parameters that require grad, each cast to bf16 inside the step (as nf.mixed_precision
  casts them; `--eager-precision autocast` uses torch.autocast instead), `loss.backward()`, and
  `torch.optim.AdamW(fused=True)` (on CUDA);
- compile: the same step with its loss under `torch.compile` (the forward, and the backward
  AOTAutograd derives from it); the fused AdamW is one kernel already, and stays as it is;
- nf.jit: `models.train.make_step` with `nf.optim.adamw` and `nf.mixed_precision(bf16, fp32)` on a
  mesh of one rank under `nf.init()` (NCCL on CUDA, gloo on CPU), parameters and state donated;
- jit_compile: the same with `nf.jit(..., compile=True)`: its local program through torch.compile.

Model flops per token: 6 x (parameters less the input embedding) + 12 x layers x dim x sequence
(torchtitan's count: each matmul's forward and backward, causal attention counted whole). MFU is
model flops per second over the peak: measured here (the best of a few 8192^3 bf16 matmuls) and the
datasheet's (H100/H200 SXM: 989 TFLOP/s dense bf16). The issue's goal: MFU >= 55% of the measured
peak and nf.jit at least as fast as eager. Warm-up steps (the first compiles) are not timed; the
timed steps run back to back between two synchronizations. A contender that fails is reported
as failed and the others still run. The last line printed is the whole result as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import time
import traceback

import optree
import torch

import ndfunc as nf
from models import llama, train
from ndfunc.sharding import NamedSharding, P

# dim, heads and ffn of the 1B class (TinyLlama's dim and ffn; GQA 16/8, head dim 128), 16 layers:
# 0.89e9 parameters, 0.82e9 of them in matmuls (the output projection counted, the embedding not)
CONFIG_1B = llama.LlamaConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=5632,
                              max_seq_len=2048)
LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1
CONTENDERS = ("jit", "jit_compile", "eager", "compile")
GOAL_MFU = 0.55
BF16 = torch.bfloat16


def flops_per_token(cfg: llama.LlamaConfig, seq: int) -> int:
    """torchtitan's model flops per token (`get_num_flop_per_token`): 6 N + 12 l d s."""
    return 6 * (cfg.num_params() - cfg.vocab_size * cfg.dim) + 12 * cfg.n_layers * cfg.dim * seq


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_peak(device: torch.device, size: int, repeats: int = 20, trials: int = 3) -> float:
    """bf16 flops per second of this device's best square matmul of `size` (the best of `trials`)."""
    g = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(size, size, device=device, dtype=BF16, generator=g) for _ in range(2))
    out = torch.empty(size, size, device=device, dtype=BF16)
    for _ in range(3):
        torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(trials):
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b, out=out)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 * repeats / best


def datasheet_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in train.PEAK_BF16_FLOPS.items() if k in name), None)


def cast(tree, dtype: torch.dtype):
    """Every tensor of a tree of dicts and lists cast to `dtype` (plain Python: torch.compile traces it whole)."""
    if isinstance(tree, dict):
        return {k: cast(v, dtype) for k, v in tree.items()}
    if isinstance(tree, list):
        return [cast(v, dtype) for v in tree]
    return tree.to(dtype)


def eager_step(cfg, params, batch, compiled: str | None, precision: str):
    """One optimizer step of the usual PyTorch kind, as a function of nothing (its state held)."""
    masters = optree.tree_map(lambda x: x.detach().clone().requires_grad_(), params)  # fp32 master weights
    leaves = optree.tree_leaves(masters)
    optimizer = torch.optim.AdamW(leaves, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                  fused=True if leaves[0].is_cuda else None)
    device_type = leaves[0].device.type

    def loss_of(masters, batch):
        if precision == "cast":  # bf16 copies in the graph: their gradients come back fp32 through the cast
            return llama.loss(cast(masters, BF16), batch, cfg)
        with torch.autocast(device_type, dtype=BF16):
            return llama.loss(masters, batch, cfg)

    if compiled:
        # one graph, forward and backward, or an error: no silent fall-back to eager pieces
        loss_of = torch.compile(loss_of, fullgraph=True, backend=compiled)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(masters, batch)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step, None


def jit_step(cfg, params, batch, compile: bool = False):
    """nf.jit's step on a mesh of one rank, parameters and optimizer state donated to it; with
    `compile`, its local program through torch.compile (Inductor)."""
    mesh = nf.make_mesh(dp=1)
    opt = nf.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    step = nf.jit(train.make_step(cfg, opt), mesh=mesh, donate_argnums=(0, 1),
                  transforms=[nf.mixed_precision(BF16, torch.float32)], compile=compile)
    replicated = lambda tree: optree.tree_map(lambda _: NamedSharding(mesh, P()), tree)  # noqa: E731
    # copies: donation writes the step's results into its arguments' buffers, not into `params`
    p = nf.device_put(optree.tree_map(torch.clone, params), replicated(params))
    carry = [p, opt.init(p)]
    b = nf.device_put(batch, replicated(batch))

    def run():
        carry[0], carry[1], loss = step(carry[0], carry[1], b)
        return loss

    def program_flops() -> float:
        return step.lower(carry[0], carry[1], b).cost_analysis()["flops"]

    return run, program_flops


def timed(run, device: torch.device, warmup: int, steps: int) -> dict:
    """Seconds of the first step (compilation included), then of `steps` steps after `warmup` in all."""
    start = time.perf_counter()
    losses = [run()]
    sync(device)
    first_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        losses.append(run())
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        losses.append(run())
    issued = time.perf_counter()  # the host's time to issue the steps: above step_s, the host limits
    sync(device)
    step_s = (time.perf_counter() - start) / steps
    values = [float(nf.device_get(x)) for x in (losses[0], losses[-1])]
    return {"first_step_s": first_s, "step_s": step_s, "host_s": (issued - start) / steps,
            "first_loss": values[0], "last_loss": values[1]}


KERNEL_KINDS = (  # a CUDA kernel's kind, by the first of these its name contains (attention's name
    # cutlass and sm90 too)
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "sm100_", "cublas")),
    ("copy", ("copy", "memcpy", "memset", "cat")),
    ("reduce", ("reduce", "norm", "softmax", "sum")),
)


def profiled(run, device: torch.device, steps: int) -> dict:
    """What the GPU runs in `steps` steps, per step: kernels' time by kind, kernels launched, the
    longest kernels by total time (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        sync(device)
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name.setdefault(e.name, [0.0, 0])
            entry[0] += e.time_range.elapsed_us() / 1e3 / steps
            entry[1] += 1 / steps
    kinds = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for name, (ms, _) in by_name.items():
        kind = next((k for k, words in KERNEL_KINDS if any(w in name.lower() for w in words)), "other")
        kinds[kind] += ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
    return {"kernel_ms": sum(kinds.values()), "kernel_ms_by_kind": kinds,
            "launches": sum(n for _, n in by_name.values()),
            "top_kernels": [(name[:90], round(ms, 3), round(n, 1)) for name, (ms, n) in top]}


@contextlib.contextmanager
def residual_as_identity():
    """`llama._residual` as the identity it is without axis rules: its rules lookup (a ContextVar's
    `get`) is a graph break to torch.compile (torch 2.13), one per layer."""
    residual = llama._residual
    llama._residual = lambda x: x
    try:
        yield
    finally:
        llama._residual = residual


def run_contender(name: str, cfg, params, batch, device, args) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        if name in ("jit", "jit_compile"):
            run, program_flops = jit_step(cfg, params, batch, compile=name == "jit_compile")
        else:
            run, program_flops = eager_step(cfg, params, batch, args.compile_backend if name == "compile" else None,
                                            args.eager_precision)
        with residual_as_identity() if name == "compile" else contextlib.nullcontext():
            out = timed(run, device, args.warmup, args.steps)
            if args.profile and device.type == "cuda":
                out["profile"] = profiled(run, device, args.profile)
        if program_flops is not None:
            out["program_flops_per_step"] = program_flops()  # what the lowered program counts
        if device.type == "cuda":
            out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    except Exception as e:  # noqa: BLE001 - one contender's failure is a result; the others still run
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        run = program_flops = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the tiny llama, batch 2 x 64 (a check, on CPU)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 4; 2 with --tiny)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 2048; 64 with --tiny)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, the compiling one included")
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--eager-precision", choices=["cast", "autocast"], default="cast",
                        help="eager's bf16: parameters cast in the step (nf.mixed_precision's way), or torch.autocast")
    parser.add_argument("--compile-backend", help="torch.compile's backend: inductor, or aot_eager (dynamo and "
                        "AOTAutograd, no code generation: the default with --device cpu --tiny, a check in seconds)")
    parser.add_argument("--peak-size", type=int, help="the square bf16 matmul that measures the peak (8192; 512 on CPU)")
    parser.add_argument("--json", help="also write the JSON result to this file")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then profile this many steps of each (CUDA): kernel time by kind, launches, the top kernels")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps are at least 1")
    if args.compile_backend is None:
        args.compile_backend = "aot_eager" if args.tiny and args.device == "cpu" else "inductor"
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = llama.LlamaConfig.tiny() if args.tiny else CONFIG_1B
    batch_size, seq = args.batch or (2 if args.tiny else 4), args.seq or (64 if args.tiny else 2048)
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq))
    tokens = batch_size * seq
    per_token = flops_per_token(cfg, seq)

    peak = measured_peak(device, args.peak_size or (8192 if device.type == "cuda" else 512))
    sheet = datasheet_peak(device)
    g = torch.Generator().manual_seed(0)
    # no positions: attention is causal by flag, so the flash kernel takes it (a mask would not)
    batch = {k: torch.randint(0, cfg.vocab_size, (batch_size, seq), generator=g).to(device)
             for k in ("tokens", "targets")}
    params = llama.init(cfg, nf.random.key(0).to(device))  # made on the device: the same for all three

    world = any(name.startswith("jit") for name in args.only) and not torch.distributed.is_initialized()
    if world:
        nf.init(backend="nccl" if device.type == "cuda" else "gloo")
    results = {}
    try:
        for name in args.only:
            results[name] = r = run_contender(name, cfg, params, batch, device, args)
            if "error" not in r:
                r["tokens_per_s"] = tokens / r["step_s"]
                r["mfu"] = r["tokens_per_s"] * per_token / peak
                r["mfu_datasheet"] = None if sheet is None else r["tokens_per_s"] * per_token / sheet
            print(f"{name}: {json.dumps(r)}", flush=True)
    finally:
        if world:
            nf.shutdown()

    def ratio(a: str, b: str) -> float | None:
        ok = a in results and b in results and "error" not in results[a] and "error" not in results[b]
        return results[a]["tokens_per_s"] / results[b]["tokens_per_s"] if ok else None

    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "config": dataclasses.asdict(cfg), "params": cfg.num_params(), "batch": batch_size, "seq": seq,
        "tokens_per_step": tokens, "model_flops_per_token": per_token, "peak_flops_measured": peak,
        "peak_flops_datasheet": sheet, "eager_precision": args.eager_precision,
        "compile_backend": args.compile_backend if "compile" in args.only else None, "warmup": args.warmup,
        "steps": args.steps, "results": results, "jit_over_eager": ratio("jit", "eager"),
        "jit_over_compile": ratio("jit", "compile"), "jit_compile_over_eager": ratio("jit_compile", "eager"),
        "jit_compile_over_compile": ratio("jit_compile", "compile"),
    }
    met = [results[name]["mfu"] >= GOAL_MFU and ratio(name, "eager") >= 1.0
           for name in ("jit", "jit_compile") if "mfu" in results.get(name, {}) and ratio(name, "eager")]
    summary["goal_met"] = any(met) if met else None
    report(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def report(s: dict) -> None:
    sheet = "" if s["peak_flops_datasheet"] is None else f", datasheet {s['peak_flops_datasheet'] / 1e12:.0f}"
    print(f"\n{s['device']} (torch {s['torch']}): llama {s['params'] / 1e6:,.1f}M parameters, batch {s['batch']} x "
          f"{s['seq']} = {s['tokens_per_step']} tokens per step, {s['warmup']} warm-up + {s['steps']} timed steps")
    compiled = "" if s["compile_backend"] is None else f"; torch.compile backend {s['compile_backend']}"
    print(f"model flops per token {s['model_flops_per_token']:.3e}; bf16 peak measured "
          f"{s['peak_flops_measured'] / 1e12:.3g} TFLOP/s{sheet}; eager bf16 by {s['eager_precision']}{compiled}")
    print(f"{'':12s}{'first s':>9s}{'step ms':>10s}{'tokens/s':>12s}{'MFU':>8s}{'MFU sheet':>11s}{'peak GiB':>10s}"
          f"   loss first -> last")
    for name, r in s["results"].items():
        if "error" in r:
            print(f"{name:12s}failed: {r['error'].splitlines()[0][:100]}")
            continue
        mfu_sheet = "" if r["mfu_datasheet"] is None else f"{100 * r['mfu_datasheet']:.1f}%"
        memory = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else ""
        print(f"{name:12s}{r['first_step_s']:9.1f}{1e3 * r['step_s']:10.1f}{r['tokens_per_s']:12.0f}"
              f"{100 * r['mfu']:7.1f}%{mfu_sheet:>11s}{memory:>10s}   {r['first_loss']:.4f} -> {r['last_loss']:.4f}")
    ratios = "; ".join(f"{k.replace('_over_', ' / ')} {v:.2f}x tokens/s" for k, v in
                       ((k, s[k]) for k in ("jit_over_eager", "jit_over_compile", "jit_compile_over_eager",
                                            "jit_compile_over_compile")) if v is not None)
    print(ratios or "no ratio: a contender failed or did not run")
    print("host ms a step (issuing it): " + ", ".join(f"{name} {1e3 * r['host_s']:.1f}" for name, r in
                                                      s["results"].items() if "host_s" in r))
    for name, r in s["results"].items():
        if "profile" in r:
            prof = r["profile"]
            kinds = ", ".join(f"{k} {ms:.1f}" for k, ms in prof["kernel_ms_by_kind"].items())
            print(f"{name}: kernels {prof['kernel_ms']:.1f} ms a step ({kinds}), {prof['launches']:.0f} launches")
            for kernel, ms, n in prof["top_kernels"]:
                print(f"    {ms:8.2f} ms {n:6.1f}x  {kernel}")
    goal = {None: "not decided (a contender is missing)", True: "met", False: "not met"}[s["goal_met"]]
    print(f"goal (nf.jit MFU >= {GOAL_MFU:.0%} of the measured peak, and >= eager; compiled or not): {goal}")
    print(json.dumps(s))


if __name__ == "__main__":
    main()
