"""Lowers a Llama-3-70B-shaped train step over stand-ins on an abstract mesh, in a process of its
own, and prints (as JSON) its peak resident memory, the lowered program's memory and cost
analyses, and each rank's argument bytes worked out from the stand-ins' shardings alone.

    python tests/shape_only_worker.py LAYERS DP_REPLICATE,DP_SHARD,CP,TP [--fsdp]

A process of its own, because peak resident memory is a high-water mark: measured in the test
process, it would hold whatever an earlier test made.
"""

import dataclasses
import json
import resource
import sys

import optree
import torch

import ndfunc as nf
from models import llama, train
from ndfunc.sharding import NamedSharding


def high_water() -> int:
    """This process's peak resident bytes: /proc's VmHWM, which starts afresh at exec, where
    getrusage's ru_maxrss starts from what the forking test process held (where /proc has none,
    ru_maxrss)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    layers, sizes = int(sys.argv[1]), tuple(int(s) for s in sys.argv[2].split(","))
    before = high_water()
    cfg = llama.LlamaConfig.llama3_70b(n_layers=layers)
    config = nf.ParallelConfig(*sizes)
    mesh = config.build_abstract_mesh()
    specs = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), specs))
    opt = nf.optim.adamw(3e-4, weight_decay=0.1)
    state = opt.init(params)
    batch = train.abstract_batch(config, mesh, config.dp_world_size, 8192)
    transforms = [nf.fsdp("dp_shard")] if "--fsdp" in sys.argv else []
    step = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh, transforms=transforms)
    lowered = step.lower(params, state, batch)
    memory, cost = lowered.memory_analysis(), lowered.cost_analysis()
    # each rank's blocks, from the shardings alone (NamedSharding's block math, held to JAX's elsewhere)
    blocks = sum(torch.Size(x.sharding.shard_shape(x.shape)).numel() * x.dtype.itemsize
                 for x in optree.tree_leaves((params, state, batch)))
    print(json.dumps({
        "rss_before": before, "rss_peak": high_water(),
        "whole_parameter_bytes": sum(x.nbytes for x in optree.tree_leaves(params)),
        "argument_bytes_from_shardings": blocks,
        "memory": dataclasses.asdict(memory),
        "flops": cost["flops"], "comm_bytes": cost["comm_bytes"]["total"],
    }))


if __name__ == "__main__":
    main()
