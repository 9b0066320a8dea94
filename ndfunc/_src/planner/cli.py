"""`python -m ndfunc.plan`: rank the layouts of a built-in model (or one a Hugging Face config.json
describes) on a built-in cluster, print a table.

Bad input is an argparse error (exit code 2) that says what was expected, what came and what to do;
a model that fits no layout prints why and exits with 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ndfunc._src.planner.cluster import Cluster, gpu_names
from ndfunc._src.planner.estimate import Efficiency
from ndfunc._src.planner.model import TransformerShape, model_names
from ndfunc._src.planner.search import plan


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ndfunc.plan",
        description="Rank ND-parallel layouts (dp_replicate x dp_shard x cp x tp) of a Llama-shaped model (dense, "
                    "or a mixture of experts) by predicted step time; layouts that do not fit memory are dropped.",
    )
    p.add_argument("--model", default="llama3-8b",
                   help=f"one of: {', '.join(model_names())}; or a Hugging Face config.json (or the directory "
                        f"holding one) of a Llama-shaped model: dense, or a mixture of experts (Mixtral, Qwen2-MoE, "
                        f"Qwen3-MoE, OLMoE)")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs a node holds, joined by NVLink; nodes by the fabric (default %(default)s)")
    p.add_argument("--gpu", default="h100", help=f"one of: {', '.join(gpu_names())}")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--efficiency", type=float, default=Efficiency().matmul,
                   help="fraction of peak matmul flops reached (default %(default)s)")
    p.add_argument("--attention-efficiency", type=float, default=Efficiency().attention,
                   help="fraction of bf16 peak reached by attention kernels (default %(default)s)")
    p.add_argument("--float8", action="store_true", help="layer linears in fp8 (H100 and later)")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    return p


def _from_hf_config(p: argparse.ArgumentParser, path: str) -> TransformerShape:
    """The shape in a Hugging Face config.json (or the directory holding one)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    stem = os.path.splitext(os.path.basename(file))[0]  # a config.json is named by its folder
    try:
        with open(file) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            raise ValueError(f"a JSON object of a model's configuration was expected, not a {type(cfg).__name__}")
        return TransformerShape.from_config(cfg, name=cfg.get("_name_or_path") or (
            stem if stem != "config" else os.path.basename(os.path.dirname(os.path.abspath(file)))))
    except (OSError, ValueError, TypeError) as err:
        p.error(f"--model {path!r}: cannot read a model shape from {file} ({err}).")


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` (default `sys.argv[1:]`), plan, print the table."""
    p = parser()
    args = p.parse_args(argv)
    if args.model.lower() in model_names():
        model = TransformerShape.named(args.model)
    elif os.path.exists(args.model):
        model = _from_hf_config(p, args.model)
    else:
        p.error(f"--model {args.model!r} is neither a built-in model ({', '.join(model_names())}) nor a file; pass "
                f"one of those names or the path of a Hugging Face config.json.")
    if args.gpu.lower() not in gpu_names():
        p.error(f"--gpu {args.gpu!r} is not a built-in GPU; expected one of {', '.join(gpu_names())} "
                f"(for other hardware call ndfunc.plan.plan with your own Cluster(...)).")
    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node),
                        ("--global-batch", args.global_batch), ("--seq-len", args.seq_len), ("--top", args.top)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}.")
    for flag, value in (("--efficiency", args.efficiency), ("--attention-efficiency", args.attention_efficiency)):
        if not 0 < value <= 1:
            p.error(f"{flag} is a fraction of the device's peak, in (0, 1]; got {value}.")
    if args.float8 and Cluster.of(args.gpu, 1).device.peak_fp8_flops is None:
        p.error(f"--float8: the {Cluster.of(args.gpu, 1).device.name} has no fp8 tensor cores; drop --float8.")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        p.error(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node {args.gpus_per_node}; "
                f"use a multiple of {args.gpus_per_node} or change --gpus-per-node.")
    try:
        efficiency = Efficiency(args.efficiency, args.attention_efficiency)
        cluster = Cluster.of(args.gpu, args.gpus, args.gpus_per_node)
        result = plan(model, cluster=cluster, global_batch=args.global_batch,
                      seq_len=args.seq_len, float8=args.float8, efficiency=efficiency)
    except ValueError as err:
        p.error(str(err))
    import rich.console

    console = rich.console.Console(file=sys.stdout)
    if not console.is_terminal:  # a pipe or a file: wide enough that no column is cut
        console = rich.console.Console(file=sys.stdout, width=200)
    if not result.rows:
        console.print(f"{result.title()}\nNo layout fits in memory. {result.advice()}")
        sys.exit(1)
    console.print(result.table(args.top))
