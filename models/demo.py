"""ndfunc's main job until training lands: shard a Llama-shaped parameter tree over a 4-axis mesh.

    python -m models.demo                                   # 8 ranks simulated in this process
    python -m models.demo --ranks 16 --dp-replicate 2 --dp-shard 2 --cp 2 --tp 2
    torchrun --nproc-per-node 4 -m models.demo --dp-shard 2 --tp 2    # real processes (gloo/NCCL)

It builds the mesh from a ParallelConfig, derives every parameter's PartitionSpec from the model's
logical axis names (models/llama.py) and the config's rules, initialises each rank's blocks only (a
callback per block), checks the gathered parameters against `llama.init` on one device, and prints
what each rank holds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os

import torch

import ndfunc as nf
from models import llama
from ndfunc.sharding import NamedSharding, logical_to_mesh

CFG = llama.LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=192)
KEY = nf.random.key(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, help="simulated ranks (ignored under torchrun)")
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=-1, help="-1: what the other axes leave")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=8)
    args = parser.parse_args(argv)

    real = "RANK" in os.environ  # started by torchrun
    # the single-device build to check against, made whole on this process's one device (before
    # the simulated world: inside it every simulated rank would make it again)
    reference = llama.init(CFG, KEY)
    with contextlib.nullcontext() if real else nf.simulate(args.ranks):
        if real:
            nf.init()
        run(args, reference)
        if real:
            nf.shutdown()


def run(args, reference) -> None:
    say = print if nf.rank() == 0 else (lambda *a, **k: None)
    config = nf.ParallelConfig(
        dp_replicate_size=args.dp_replicate, dp_shard_size=args.dp_shard, cp_size=args.cp, tp_size=args.tp
    ).resolve()
    mesh = config.build_mesh()
    mode = "simulated in this process" if nf.is_simulated() else "real processes"
    say(f"{nf.world_size()} ranks ({mode}); {config}")
    say(f"mesh {mesh.shape}")

    cfg, key = CFG, KEY
    specs = logical_to_mesh(llama.param_axes(cfg), config.rules)
    # Each rank makes only its own blocks: a parameter's value at a position depends on the key,
    # the parameter's path and the position, never on the mesh.
    params = nf.tree.tree_map_with_path(
        lambda path, shape, spec: nf.make_array_from_callback(
            shape, NamedSharding(mesh, spec), functools.partial(llama.init_param, cfg, key, path, tuple(shape))),
        llama.param_shapes(cfg), specs)
    say(f"\n{'parameter':<24}{'shape':<16}{'spec':<42}{'per rank'}")
    leaves, _ = nf.tree.tree_flatten_with_path(params)
    full_bytes = rank_bytes = 0
    for path, x in leaves:
        sharding = nf.sharding_of(x)
        block = sharding.shard_shape(x.shape)
        full_bytes += x.numel() * x.element_size()
        rank_bytes += torch.Size(block).numel() * x.element_size()
        say(f"{path:<24}{str(tuple(x.shape)):<16}{repr(sharding.spec):<42}{block}")
    say(f"\nparameters: {full_bytes / 2**20:.2f} MiB in all, {rank_bytes / 2**20:.3f} MiB per rank "
        f"({full_bytes / rank_bytes:.1f}x less than replicated)")

    # The same parameters built on one device, whole: the sharded build must gather to exactly these.
    reference = nf.tree.tree_flatten_with_path(reference)[0]
    gathered = nf.tree.tree_flatten_with_path(nf.device_get(params))[0]
    same = all(torch.equal(a, b) for (_, a), (_, b) in zip(gathered, reference))
    say(f"gathered parameters equal the single-device build: {same}")
    if not same:
        raise SystemExit("sharded build differs from the single-device build")

    if nf.rank() == 0:
        print("\nembed (vocab, embed): which ranks hold which block")
        nf.visualize_sharding(params["embed"])
        print("layers.0.mlp.w1 (embed, mlp)")
        nf.visualize_sharding(params["layers"][0]["mlp"]["w1"])
    effective = config.effective_batch_size(args.micro_batch, args.grad_accum)
    say(f"\nbatch spec {config.batch_spec}; effective batch = micro {args.micro_batch} x accum "
        f"{args.grad_accum} x dp_replicate {config.dp_replicate_size} x dp_shard {config.dp_shard_size} = {effective}")
    say(f"lr 3e-4 tuned at batch 32 -> {config.scale_lr(3e-4, 32, effective, rule='sqrt'):.2e} at batch {effective} (sqrt rule)")


if __name__ == "__main__":
    main()
