"""Plan a Llama 3 train step on a cluster this machine does not have: shape-only lowering.

    python benchmarks/shape_only.py [--model 70b] [--layers N] [--mesh 1,128,1,8] [--seq-len 8192]
                                    [--batch-per-rank 1] [--fsdp] [--remat full] [--bf16]
                                    [--ring-attention] [--whole]

The step (loss, gradients, AdamW) is lowered over `nf.ShapeDtypeStruct` stand-ins on an
`AbstractMesh` of dp_replicate x dp_shard x cp x tp ranks: no process group, no simulated ranks,
nothing of the model's size allocated. It prints how long lowering took, this process's peak
resident memory, and per rank what the program holds (`memory_analysis`) and moves and computes
(`cost_analysis`).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import ndfunc as nf
from models import llama, train
from ndfunc._src.partition.planning import repeats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("8b", "70b"), default="70b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the model's (default: all)")
    parser.add_argument("--mesh", default="1,128,1,8", help="dp_replicate,dp_shard,cp,tp")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-per-rank", type=int, default=1, help="sequences per data-parallel rank")
    parser.add_argument("--fsdp", action="store_true", help="nf.fsdp over dp_shard (gather per layer, reshard)")
    parser.add_argument("--remat", choices=("full", "save_dots"), default=None)
    parser.add_argument("--bf16", action="store_true", help="nf.mixed_precision(bf16 compute, fp32 reductions)")
    parser.add_argument("--ring-attention", action="store_true",
                        help="attention over the cp-split sequence as a ring (nf.ring_attention), as torchtitan's CP; "
                             "without it the sequence is gathered over cp where attention needs it")
    parser.add_argument("--whole", action="store_true",
                        help="plan every layer, not the layers between the first and last as one (to compare)")
    args = parser.parse_args(argv)
    if args.whole:
        repeats.MIN_CALLS = 2**62

    base = llama.LlamaConfig.llama3_70b if args.model == "70b" else llama.LlamaConfig.llama3_8b
    cfg = base(remat=args.remat, **({} if args.layers is None else {"n_layers": args.layers}))
    config = nf.ParallelConfig(*(int(s) for s in args.mesh.split(",")))
    mesh = config.build_abstract_mesh()
    transforms = [nf.ring_attention("cp", load_balance=None)] if args.ring_attention else []
    transforms += [nf.fsdp("dp_shard")] if args.fsdp else []
    if args.bf16:
        transforms.append(nf.mixed_precision(torch.bfloat16, torch.float32))

    t0 = time.perf_counter()
    lowered = train.lower_abstract(cfg, config, args.seq_len, transforms, args.batch_per_rank,
                                   nf.optim.adamw(3e-4, weight_decay=0.1))
    lowered_s = time.perf_counter() - t0
    memory, cost = lowered.memory_analysis(), lowered.cost_analysis()
    total_s = time.perf_counter() - t0

    print(f"Llama 3 {args.model} ({cfg.n_layers} layers, {cfg.num_params() / 1e9:.1f}e9 parameters) on "
          f"{mesh.size} ranks {mesh.shape}, {args.batch_per_rank} x {args.seq_len} tokens per data-parallel rank, "
          f"transforms {[type(t).__name__ for t in transforms]}, remat {args.remat}")
    print(f"lowered in {lowered_s:.1f} s (with both analyses {total_s:.1f} s); peak resident memory of this "
          f"process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    print(f"memory per rank: {memory}")
    comm = {k: f"{v / 2**30:.2f} GiB" for k, v in cost["comm_bytes"].items()}
    print(f"per rank and step: {cost['flops'] / 1e12:.1f} TFLOP, sent {comm}, collectives {cost['collectives']}")


if __name__ == "__main__":
    main()
