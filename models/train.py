"""Train the reference Llama on the standard library's source bytes.

    python -m models.train                          # tiny model, 200 steps, on this machine
    python -m models.train --config small --steps 20 --batch-size 8 --seq-len 256
    python -m models.train --hf-checkpoint DIR      # start from a Hugging Face Llama directory

One device for now: a pure step (`nf.value_and_grad` of `llama.loss`, then an optax-style AdamW
update with warmup and cosine decay) over plain tensors. Sharded steps come with `nf.jit`.
"""

from __future__ import annotations

import argparse
import time

import torch

import ndfunc as nf
from models import data, hf, llama
from ndfunc import random


def make_step(cfg: llama.LlamaConfig, opt: nf.optim.GradientTransformation):
    def step(params, opt_state, batch):
        loss, grads = nf.value_and_grad(llama.loss)(params, batch, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return nf.optim.apply_updates(params, updates), opt_state, loss

    return step


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--hf-checkpoint", help="a Hugging Face Llama directory to start from")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args(argv)

    if args.hf_checkpoint:
        cfg, params = hf.load_llama(args.hf_checkpoint)
    else:
        cfg = getattr(llama.LlamaConfig, args.config)()
        params = llama.init(cfg, random.key(args.seed))
    if cfg.vocab_size < data.VOCAB_SIZE:
        raise SystemExit(f"the byte corpus needs a vocabulary of at least {data.VOCAB_SIZE}; this model has {cfg.vocab_size}.")
    schedule = nf.optim.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1), args.lr / 10)
    opt = nf.optim.chain(nf.optim.clip_by_global_norm(1.0), nf.optim.adamw(schedule, weight_decay=args.weight_decay))
    opt_state = opt.init(params)
    step = make_step(cfg, opt)

    sequences = data.Sequences(data.stdlib_corpus(), args.seq_len, seed=args.seed)
    print(f"{cfg}\n{cfg.num_params() / 1e6:.2f}M parameters; {sequences.num_sequences} sequences of "
          f"{args.seq_len} bytes; batch {args.batch_size}")
    losses, start = [], time.perf_counter()
    for i, batch in enumerate(data.batches(sequences, args.batch_size, steps=args.steps)):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
        if (i + 1) % args.log_every == 0 or i == 0:
            rate = (i + 1) * args.batch_size * args.seq_len / (time.perf_counter() - start)
            print(f"step {i + 1:>5}  loss {losses[-1]:.3f}  lr {float(schedule(torch.tensor(i))):.2e}  {rate:,.0f} tokens/s")
    print(f"loss {losses[0]:.3f} -> {sum(losses[-10:]) / min(10, len(losses)):.3f} (mean of the last 10 steps)")
    return losses


if __name__ == "__main__":
    main()
