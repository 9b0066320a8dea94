"""One rank: the jitted llama train step against the same step in eager PyTorch.

    python benchmarks/jit_step.py [--model tiny small] [--batch 8] [--seq 128] [--repeats 5]

Eager is the usual PyTorch way: parameters that require grad, `loss.backward()`, and
`torch.optim.AdamW` (its default foreach implementation). nf.jit runs its lowered program (aten ops
on plain tensors, no autograd at run time), donating parameters and optimizer state as a training
loop would. Same model code, same data, same hyperparameters; the losses are printed side by side.
Reported: median seconds per step and the ratio jit / eager (below 1: jit is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import ndfunc as nf
from models import llama


def config(name: str) -> llama.LlamaConfig:
    return {"tiny": llama.LlamaConfig.tiny(), "small": llama.LlamaConfig.small()}[name]


def run(name: str, batch_size: int, seq: int, repeats: int) -> dict:
    cfg = dataclasses.replace(config(name), max_seq_len=max(seq, config(name).max_seq_len))
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (batch_size, seq), generator=g),
             "targets": torch.randint(0, cfg.vocab_size, (batch_size, seq), generator=g)}
    lr, wd = 1e-3, 0.1

    # eager PyTorch
    eager_params = {k: v for k, v in nf.tree.tree_map_with_path(
        lambda _, t: t.clone().requires_grad_(), llama.init(cfg, nf.random.key(0))).items()}
    leaves = [t for t in _leaves(eager_params)]
    optimizer = torch.optim.AdamW(leaves, lr=lr, weight_decay=wd, eps=1e-8)

    def eager_step():
        optimizer.zero_grad(set_to_none=True)
        loss = llama.loss(eager_params, batch, cfg)
        loss.backward()
        optimizer.step()
        return loss.detach()

    # nf.jit
    opt = nf.optim.adamw(lr, weight_decay=wd)

    def step(params, state, batch):
        loss, grads = nf.value_and_grad(llama.loss)(params, batch, cfg)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss

    jitted = nf.jit(step, donate_argnums=(0, 1))
    params = llama.init(cfg, nf.random.key(0))
    carry = [params, opt.init(params)]

    def jit_step():
        carry[0], carry[1], loss = jitted(carry[0], carry[1], batch)
        return loss

    t0 = time.perf_counter()
    jit_losses = [float(jit_step())]
    compile_s = time.perf_counter() - t0
    eager_losses = [float(eager_step())]
    times = {"eager": [], "jit": []}
    for _ in range(repeats):  # interleaved, so drift hits both alike
        for label, fn, losses in (("eager", eager_step, eager_losses), ("jit", jit_step, jit_losses)):
            start = time.perf_counter()
            losses.append(float(fn()))
            times[label].append(time.perf_counter() - start)
    eager_s, jit_s = statistics.median(times["eager"]), statistics.median(times["jit"])
    return {"model": name, "params_M": sum(t.numel() for t in leaves) / 1e6, "eager_s": eager_s, "jit_s": jit_s,
            "ratio": jit_s / eager_s, "compile_s": compile_s, "loss_eager": eager_losses[-1], "loss_jit": jit_losses[-1]}


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} x {args.seq} tokens")
    for name in args.model:
        r = run(name, args.batch, args.seq, args.repeats)
        print(f"{r['model']:5s} {r['params_M']:7.2f}M params: eager {r['eager_s'] * 1e3:8.1f} ms/step, "
              f"nf.jit {r['jit_s'] * 1e3:8.1f} ms/step, ratio {r['ratio']:.2f} (first call {r['compile_s']:.1f} s); "
              f"loss after {args.repeats + 1} steps: eager {r['loss_eager']:.4f}, jit {r['loss_jit']:.4f}")


if __name__ == "__main__":
    main()
