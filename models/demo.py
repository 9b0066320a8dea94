"""ndfunc's main job until training lands: shard a Llama-shaped parameter tree over a 4-axis mesh.

    python -m models.demo                                   # 8 ranks simulated in this process
    python -m models.demo --ranks 16 --dp-replicate 2 --dp-shard 2 --cp 2 --tp 2
    torchrun --nproc-per-node 4 -m models.demo --dp-shard 2 --tp 2    # real processes (gloo/NCCL)

It builds the mesh from a ParallelConfig, derives every parameter's PartitionSpec from logical axis
names and the config's rules, materialises each rank's blocks only (a callback per block), checks
the gathered parameters against a single-device build, and prints what each rank holds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os

import torch

import ndfunc as nf
from ndfunc.sharding import NamedSharding, logical_to_mesh


def llama_param_axes(vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int):
    """Shapes and logical dim names of a Llama decoder's parameters: `{path: (shape, names)}` trees."""
    head_dim = dim // n_heads
    layer = {
        "attn_norm": ((dim,), ("embed",)),
        "attn": {
            "wq": ((dim, n_heads, head_dim), ("embed", "heads", "head_dim")),
            "wk": ((dim, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim")),
            "wv": ((dim, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim")),
            "wo": ((n_heads, head_dim, dim), ("heads", "head_dim", "embed")),
        },
        "mlp_norm": ((dim,), ("embed",)),
        "mlp": {
            "w1": ((dim, ffn_dim), ("embed", "mlp")),
            "w3": ((dim, ffn_dim), ("embed", "mlp")),
            "w2": ((ffn_dim, dim), ("mlp", "embed")),
        },
    }
    return {
        "embed": ((vocab, dim), ("vocab", "embed")),
        "layers": [layer for _ in range(n_layers)],
        "norm": ((dim,), ("embed",)),
        "lm_head": ((dim, vocab), ("embed", "vocab")),
    }


def _is_entry(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], tuple)


def block_values(seed: int, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
    """Values of the block `index` of a tensor, each a function of (seed, global position) only, so a
    rank can make its block without the rest and every mesh gives the same full tensor."""
    positions = torch.zeros((), dtype=torch.int64)
    for size, s in zip(shape, index):
        positions = positions.unsqueeze(-1) * size + torch.arange(s.start, s.stop)
    x = (positions * 2654435761 + seed * 40503) % 1000003  # a cheap integer hash of the position
    return (x.to(torch.float32) / 1000003.0 - 0.5) * 0.04


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
    with contextlib.nullcontext() if real else nf.simulate(args.ranks):
        if real:
            nf.init()
        run(args)
        if real:
            nf.shutdown()


def run(args) -> None:
    say = print if nf.rank() == 0 else (lambda *a, **k: None)
    config = nf.ParallelConfig(
        dp_replicate_size=args.dp_replicate, dp_shard_size=args.dp_shard, cp_size=args.cp, tp_size=args.tp
    ).resolve()
    mesh = config.build_mesh()
    mode = "simulated in this process" if nf.is_simulated() else "real processes"
    say(f"{nf.world_size()} ranks ({mode}); {config}")
    say(f"mesh {mesh.shape}")

    tree = llama_param_axes(vocab=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=192)
    entries, treedef = nf.tree.tree_flatten_with_path(tree, is_leaf=_is_entry)
    specs = logical_to_mesh(treedef.unflatten([names for _, (_, names) in entries]), config.rules)
    specs = [spec for _, spec in nf.tree.tree_flatten_with_path(specs)[0]]
    shapes = [shape for _, (shape, _) in entries]

    # Each parameter's seed is its position in the tree; each rank makes only its own blocks.
    params = treedef.unflatten([
        nf.make_array_from_callback(shape, NamedSharding(mesh, spec), functools.partial(block_values, seed, shape))
        for seed, (shape, spec) in enumerate(zip(shapes, specs))
    ])
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

    # The same values built on one device, whole: the sharded build must gather to exactly these.
    reference = [block_values(seed, shape, tuple(slice(0, n) for n in shape)) for seed, shape in enumerate(shapes)]
    gathered = [x for _, x in nf.tree.tree_flatten_with_path(nf.device_get(params))[0]]
    same = all(torch.equal(a, b) for a, b in zip(gathered, reference))
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
