"""One rank: the jitted llama train step against the same step in eager PyTorch.

    python benchmarks/jit_step.py [--model tiny small] [--batch 8] [--seq 128] [--repeats 5] [--rounds 2]
                                  [--same-process]

Eager is the usual PyTorch way: parameters that require grad, `loss.backward()`, and
`torch.optim.AdamW` (its default foreach implementation). nf.jit runs its lowered program (aten ops
on plain tensors, no autograd at run time), donating parameters and optimizer state as a training
loop would. Same model code, same data, same hyperparameters; the losses are printed side by side.

Each implementation runs in a process of its own, as a training job would, alternating
(eager, jit, eager, jit, ... for `--rounds` rounds, so drift on the machine hits both alike).
`--same-process` instead holds both models in one process and interleaves their steps: there the
allocator's state after one model's step (which freed buffers the next step finds, and which it
must fault in afresh) also weighs on the other's.
Reported: median seconds per step and the ratio jit / eager (below 1: jit is faster).
On an AMD CPU nf.jit runs its fp32 matmuls as oneDNN's where PyTorch's `mm` runs MKL's AVX2 path
(ndfunc._src.partition.backends.cpu_kernels); run with NDFUNC_ATEN_MATMUL=1 to give both sides the same kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import ndfunc as nf
from models import llama


def config(name: str) -> llama.LlamaConfig:
    return {"tiny": llama.LlamaConfig.tiny(), "small": llama.LlamaConfig.small()}[name]


def setup(name: str, batch_size: int, seq: int):
    import dataclasses

    cfg = dataclasses.replace(config(name), max_seq_len=max(seq, config(name).max_seq_len))
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (batch_size, seq), generator=g),
             "targets": torch.randint(0, cfg.vocab_size, (batch_size, seq), generator=g)}
    return cfg, batch


LR, WD = 1e-3, 0.1


def eager_step_fn(cfg, batch):
    """The eager step, and the number of parameters."""
    import optree

    params = nf.tree.tree_map_with_path(lambda _, t: t.clone().requires_grad_(), llama.init(cfg, nf.random.key(0)))
    leaves = optree.tree_leaves(params)
    optimizer = torch.optim.AdamW(leaves, lr=LR, weight_decay=WD, eps=1e-8)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = llama.loss(params, batch, cfg)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step, sum(t.numel() for t in leaves)


def jit_step_fn(cfg, batch):
    opt = nf.optim.adamw(LR, weight_decay=WD)

    def step(params, state, batch):
        loss, grads = nf.value_and_grad(llama.loss)(params, batch, cfg)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss

    jitted = nf.jit(step, donate_argnums=(0, 1))
    params = llama.init(cfg, nf.random.key(0))
    carry = [params, opt.init(params)]

    def run():
        carry[0], carry[1], loss = jitted(carry[0], carry[1], batch)
        return loss

    return run


def timed(fn, repeats: int) -> tuple[list[float], list[float], float]:
    """(losses, seconds per step, seconds of the first call) over 1 + `repeats` steps."""
    t0 = time.perf_counter()
    losses = [float(fn())]
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        losses.append(float(fn()))
        times.append(time.perf_counter() - start)
    return losses, times, first


def one(impl: str, name: str, batch_size: int, seq: int, repeats: int) -> dict:
    """One implementation alone in this process."""
    cfg, batch = setup(name, batch_size, seq)
    if impl == "eager":
        fn, n = eager_step_fn(cfg, batch)
    else:
        fn, n = jit_step_fn(cfg, batch), None
    losses, times, first = timed(fn, repeats)
    return {"impl": impl, "losses": losses, "times": times, "first": first, "params": n}


def separate(name: str, batch_size: int, seq: int, repeats: int, rounds: int) -> dict:
    runs = {"eager": [], "jit": []}
    for _ in range(rounds):
        for impl in ("eager", "jit"):
            out = subprocess.run([sys.executable, __file__, "--one", impl, "--model", name, "--batch", str(batch_size),
                                  "--seq", str(seq), "--repeats", str(repeats)], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
            runs[impl].append(json.loads(out.stdout.strip().splitlines()[-1]))
    eager_s = statistics.median(t for r in runs["eager"] for t in r["times"])
    jit_s = statistics.median(t for r in runs["jit"] for t in r["times"])
    return {"model": name, "params_M": runs["eager"][0]["params"] / 1e6, "eager_s": eager_s, "jit_s": jit_s,
            "ratio": jit_s / eager_s, "compile_s": runs["jit"][0]["first"],
            "loss_eager": runs["eager"][0]["losses"][-1], "loss_jit": runs["jit"][0]["losses"][-1]}


def same_process(name: str, batch_size: int, seq: int, repeats: int) -> dict:
    cfg, batch = setup(name, batch_size, seq)
    eager, n = eager_step_fn(cfg, batch)
    jit = jit_step_fn(cfg, batch)
    t0 = time.perf_counter()
    jit_losses = [float(jit())]
    compile_s = time.perf_counter() - t0
    eager_losses = [float(eager())]
    times = {"eager": [], "jit": []}
    for _ in range(repeats):  # interleaved, so drift hits both alike
        for label, fn, losses in (("eager", eager, eager_losses), ("jit", jit, jit_losses)):
            start = time.perf_counter()
            losses.append(float(fn()))
            times[label].append(time.perf_counter() - start)
    eager_s, jit_s = statistics.median(times["eager"]), statistics.median(times["jit"])
    return {"model": name, "params_M": n / 1e6, "eager_s": eager_s, "jit_s": jit_s, "ratio": jit_s / eager_s,
            "compile_s": compile_s, "loss_eager": eager_losses[-1], "loss_jit": jit_losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per process, after the first")
    parser.add_argument("--rounds", type=int, default=2, help="processes per implementation, alternating")
    parser.add_argument("--same-process", action="store_true", help="both models in one process, steps interleaved")
    parser.add_argument("--one", choices=["eager", "jit"], help="(internal) run one implementation, print JSON")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.model[0], args.batch, args.seq, args.repeats)))
        return
    where = "both in one process, interleaved" if args.same_process else f"{args.rounds} processes each, alternating"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} x {args.seq} tokens, {where}")
    for name in args.model:
        if args.same_process:
            r = same_process(name, args.batch, args.seq, args.repeats)
        else:
            r = separate(name, args.batch, args.seq, args.repeats, args.rounds)
        print(f"{r['model']:5s} {r['params_M']:7.2f}M params: eager {r['eager_s'] * 1e3:8.1f} ms/step, "
              f"nf.jit {r['jit_s'] * 1e3:8.1f} ms/step, ratio {r['ratio']:.2f} (first call {r['compile_s']:.1f} s); "
              f"loss after {args.repeats + 1} steps: eager {r['loss_eager']:.4f}, jit {r['loss_jit']:.4f}")


if __name__ == "__main__":
    main()
