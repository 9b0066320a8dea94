"""Ring attention against the gathered form (every rank gathers all keys and values), at cp = 4.

    python benchmarks/ring_attention.py [--seq 4096] [--heads 8] [--head-dim 64]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/ring_attention.py --variant ring
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/ring_attention.py --variant gathered

One causal sequence laid out in zigzag order, attention forward and backward (the gradients of a
weighted sum) in one nf.jit program. In simulation it prints, per rank, the program's peak memory
(from liveness: the gathered keys and values show, the ring's per-step score block does not) and
bytes sent, for cp = 1, 2, 4. Under torchrun it runs one variant (each in its own processes, so
their peaks do not mix) and prints, per rank, how much the resident set's high-water mark grew
during the first step after compiling, and that step's time.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F

import ndfunc as nf
from ndfunc._src.transforms.ring import zigzag_order
from ndfunc.sharding import P

SEQ = P(None, None, "cp")


def step(q, k, v, positions, w):
    def f(q, k, v):
        mask = positions[:, None, :, None] >= positions[:, None, None, :]
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * w).sum()

    return nf.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)


def inputs(seq: int, heads: int, head_dim: int, cp: int):
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(1, heads, seq, head_dim, generator=g) for _ in range(4))
    order = zigzag_order(seq, cp)
    return [x.index_select(2, order) for x in (q, k, v, w)], order[None]


def jitted(mesh, variant: str):
    transforms = [nf.ring_attention("cp")] if variant == "ring" else []
    return nf.jit(step, mesh=mesh, in_shardings=(SEQ, SEQ, SEQ, P(None, "cp"), SEQ),
                  out_shardings=(P(), (SEQ, SEQ, SEQ)), transforms=transforms)


def estimates(args) -> None:
    print(f"one sequence of {args.seq}, {args.heads} heads of {args.head_dim}, fp32; per rank, from the program")
    for cp in (1, 2, 4):
        (q, k, v, w), positions = inputs(args.seq, args.heads, args.head_dim, max(cp, 1))
        with nf.simulate(cp):
            mesh = nf.make_mesh(cp=cp)
            row = {}
            for variant in ("gathered", "ring"):
                c = jitted(mesh, variant).lower(q, k, v, positions, w).cost_analysis()
                row[variant] = c
            g, r = row["gathered"], row["ring"]
            print(f"  cp={cp}: peak gathered {g['peak_memory_bytes'] / 2**20:7.1f} MiB, ring {r['peak_memory_bytes'] / 2**20:7.1f} "
                  f"MiB (ring / gathered {r['peak_memory_bytes'] / g['peak_memory_bytes']:.2f}); sent gathered "
                  f"{g['comm_bytes']['total'] / 2**20:.1f} MiB, ring {r['comm_bytes']['total'] / 2**20:.1f} MiB")


def measured(args) -> None:
    nf.init()
    cp = nf.world_size()
    (q, k, v, w), positions = inputs(args.seq, args.heads, args.head_dim, cp)
    f = jitted(nf.make_mesh(cp=cp), args.variant)
    f.lower(q, k, v, positions, w).compile()  # tracing's own memory, before the mark
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    f(q, k, v, positions, w)
    elapsed = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    print(f"rank {nf.rank()} {args.variant}: step {elapsed * 1e3:.0f} ms, peak resident set grew {grown / 1024:.1f} MiB "
          f"during it", flush=True)
    nf.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--variant", choices=["ring", "gathered"], help="under torchrun: the one to measure")
    args = parser.parse_args()
    if args.variant:
        measured(args)
    else:
        estimates(args)


if __name__ == "__main__":
    main()
