"""A mixture of experts under FSDP on 4 gloo processes: nf.jit against PyTorch's FSDP2.

    python benchmarks/moe.py [--steps 5] [--batch 8] [--seq 128]
    python benchmarks/moe.py --experts-whole      # also nf.jit with the experts traced op by op

Both sides train transformers' `MixtralForCausalLM` as it is (its experts' grouped matmuls, the
default `experts_implementation`), from the same weights, over the same batches, with AdamW.
PyTorch's way: `fully_shard` on each decoder layer and on the root over 4 ranks (FSDP2), each rank
its own quarter of the batch. nf.jit: the model through `nf.nn.functional`, every parameter split
over `dp_shard` as FSDP2 splits it, `nf.fsdp('dp_shard')` for the gather schedule; the experts call
is one `ndfunc::experts`, each rank running its own tokens through the experts.
`--experts-whole` adds nf.jit with the experts traced op by op, as before that op: the sort of
every token by expert and the offsets counted from it are values no layout splits, so every rank
ran every token's experts.

Per rank (the slowest's figures, as in `fsdp.py`): median step time, CPU time, and the resident
set's high-water mark during a step. Reported as ratios to PyTorch's, with both loss curves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp import _figures, named, own_rows, report, torch_step

import ndfunc as nf
from ndfunc.sharding import P

VOCAB = 256


def config():
    import transformers

    return transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                                      num_experts_per_tok=2, max_position_embeddings=512, attn_implementation="sdpa")


def batches(batch: int, seq: int, steps: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        out.append({"tokens": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def jit_step(path: str, mesh, lr: float, wd: float):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params, buffers, apply = nf.nn.functional(model)
    opt = nf.optim.adamw(lr, weight_decay=wd)

    def train_step(params, state, batch):
        def loss_of(p):
            logits = apply(p, buffers, batch["tokens"]).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())

        loss, grads = nf.value_and_grad(loss_of)(params)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss

    pspec = nf.nn.partition_specs(model, mesh, fsdp="dp_shard")
    state = opt.init(params)
    sspec = nf.optim.state_shardings(state, pspec)
    batch_spec = {"tokens": P("dp_shard"), "targets": P("dp_shard")}
    jitted = nf.jit(train_step, mesh=mesh, in_shardings=(pspec, sspec, batch_spec), out_shardings=(pspec, sspec, P()),
                    donate_argnums=(0, 1), transforms=[nf.fsdp("dp_shard")])
    carry = [nf.device_put(params, named(mesh, pspec)), nf.device_put(state, named(mesh, sspec))]

    def step(batch):
        placed = nf.device_put(batch, {k: nf.sharding.NamedSharding(mesh, batch_spec[k]) for k in batch})
        carry[0], carry[1], loss = jitted(carry[0], carry[1], placed)
        return nf.device_get(loss)

    return step


def worker(args) -> None:
    nf.init()
    rank = nf.rank()
    layout = nf.ParallelConfig(dp_shard_size=4)
    mesh = layout.build_mesh()
    path = os.path.join(tempfile.gettempdir(), "ndfunc-bench-moe")
    if rank == 0:
        import transformers

        torch.manual_seed(0)
        transformers.MixtralForCausalLM(config()).save_pretrained(path)
    dist.barrier()
    data = batches(args.batch, args.seq, args.steps)
    lr, wd = 1e-3, 0.1
    if args.impl == "torch":
        run = own_rows(torch_step(path, layout, mesh, lr, wd), args.batch, layout, mesh, rank)  # fsdp.py's FSDP2
    else:
        if args.impl == "jit-whole":  # the experts op by op, as before ndfunc::experts
            from ndfunc._src import trace

            trace.experts.traced = contextlib.nullcontext
        run = jit_step(path, mesh, lr, wd)
    report(rank, run, data)
    nf.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over the 4 ranks)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--experts-whole", action="store_true",
                        help="also nf.jit with the experts traced op by op (every rank runs every token's experts)")
    parser.add_argument("--impl", choices=["torch", "jit", "jit-whole"], help="(internal) run one, under torchrun")
    args = parser.parse_args()
    if args.impl:
        worker(args)
        return
    impls = ["torch", "jit", *(["jit-whole"] if args.experts_whole else [])]
    rows = {impl: _run(args, impl) for impl in impls}
    f = {impl: _figures(r) for impl, r in rows.items()}
    print(f"Mixtral-shaped MoE (hidden 256, 8 experts, top-2, 4 layers), batch {args.batch} x {args.seq}, "
          f"FSDP over 4 gloo processes:")
    for impl in impls[1:]:
        name = "nf.jit" if impl == "jit" else "nf.jit, experts op by op"
        print(f"  {name}: step {f[impl]['step'] * 1e3:.1f} ms vs PyTorch {f['torch']['step'] * 1e3:.1f} ms, "
              f"ratio {f[impl]['step'] / f['torch']['step']:.2f}; CPU per rank and step ratio "
              f"{f[impl]['cpu'] / f['torch']['cpu']:.2f}; peak resident set {f[impl]['peak'] / 2**20:.1f} MiB vs "
              f"{f['torch']['peak'] / 2**20:.1f} MiB, ratio {f[impl]['peak'] / f['torch']['peak']:.2f}")
    for impl in impls:
        print(f"  losses {impl:>9}: {' '.join(f'{x:.4f}' for x in rows[impl][0]['losses'])}")


def _run(args, impl: str) -> list[dict]:
    """One side's 4 processes under torchrun (as `fsdp.py` runs them): a dict per rank."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          __file__, f"--batch={args.batch}", f"--seq={args.seq}", f"--steps={args.steps}",
                          f"--impl={impl}"], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    return [json.loads(m) for m in re.findall(r"\{[^{}]*\}", out.stdout)]


if __name__ == "__main__":
    main()
