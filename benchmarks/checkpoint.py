"""nf.checkpoint against torch.distributed.checkpoint itself, on real ranks.

    python benchmarks/checkpoint.py [--ranks 4] [--config small] [--dir DIR]

Starts the ranks itself (torchrun, gloo on CPU). Each rank holds its FSDP blocks of the llama's
parameters and AdamW state (dp_shard = ranks). Per rank, the median over the ranks of:
- a blocking save: `nf.checkpoint.save` (atomic: written aside, committed) and `dcp.save` of the
  same state dict;
- an asynchronous save: how long until training may go on, how long until the checkpoint is
  written, and the extra resident memory meanwhile (`Manager.save(blocking=False)`, which copies
  the rank's blocks to host memory first; `dcp.async_save` the same way);
- a load into the same layout: `nf.checkpoint.load` and `dcp.load`.
Prints the times and the ratios nf / dcp.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ndfunc as nf
from models import llama
from ndfunc.sharding import NamedSharding, P


def rss_mib() -> float:
    """This process's resident memory now (Linux's /proc), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(config_name: str, root: pathlib.Path) -> None:
    nf.init()
    rank, n = nf.rank(), nf.world_size()
    config = nf.ParallelConfig(dp_shard_size=n)
    cfg = getattr(llama.LlamaConfig, config_name)()
    mesh = config.build_mesh()
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    named = lambda specs: optree.tree_map(lambda s: NamedSharding(mesh, s), specs,  # noqa: E731
                                          is_leaf=lambda s: isinstance(s, P))
    params = nf.device_put(llama.init(cfg, nf.random.key(0)), named(pspec))  # each rank keeps its blocks
    opt = nf.optim.adamw(1e-3)
    state = opt.init(params)
    tree = {"params": params, "opt": state, "step": 1}
    flat = dict(nf.tree.tree_flatten_with_path(tree)[0])  # the state dict nf.checkpoint hands DCP
    local = [x.to_local() if hasattr(x, "to_local") else x for x in optree.tree_leaves(tree)]
    local_mib = sum(x.numel() * x.element_size() for x in local if isinstance(x, torch.Tensor)) / 2**20
    out = {"local_MiB": local_mib}

    def timed(name, f):
        dist.barrier()
        t = time.perf_counter()
        f()
        dist.barrier()
        out[name] = time.perf_counter() - t

    timed("nf_save", lambda: nf.checkpoint.save(root / "nf", tree))
    timed("dcp_save", lambda: dcp.save(flat, checkpoint_id=str(root / "dcp")))
    # asynchronous: until training may go on, until written, extra memory meanwhile
    with nf.checkpoint.Manager(root / "nf_async") as manager:
        dist.barrier()
        before, t = rss_mib(), time.perf_counter()
        manager.save(1, tree, blocking=False)
        out["nf_async_return"], out["nf_async_extra_MiB"] = time.perf_counter() - t, rss_mib() - before
        manager.wait()
        dist.barrier()
        out["nf_async_total"] = time.perf_counter() - t
    group = dist.new_group(backend="gloo")
    dist.barrier()
    before, t = rss_mib(), time.perf_counter()
    pending = dcp.async_save(flat, checkpoint_id=str(root / "dcp_async"), process_group=group)
    out["dcp_async_return"], out["dcp_async_extra_MiB"] = time.perf_counter() - t, rss_mib() - before
    pending.result()
    dist.barrier()
    out["dcp_async_total"] = time.perf_counter() - t
    timed("nf_load", lambda: nf.checkpoint.load(root / "nf", tree))
    target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    timed("dcp_load", lambda: dcp.load(target, checkpoint_id=str(root / "dcp")))
    (root / f"result_{rank}.json").write_text(json.dumps({"rank": rank, **out}))  # (ranks share stdout)
    nf.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--config", choices=["tiny", "small"], default="small")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="nf-checkpoint-"))
    if args.worker:
        return worker(args.config, root)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(args.ranks), __file__, "--worker", "--config", args.config, "--dir", str(root)],
                          capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    rows = [json.loads((root / f"result_{r}.json").read_text()) for r in range(args.ranks)]
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "rank"}
    size = sum(f.stat().st_size for f in (root / "nf").iterdir()) / 2**20
    print(f"llama {args.config} parameters + AdamW state on {args.ranks} gloo ranks (FSDP): "
          f"{median['local_MiB']:.0f} MiB per rank, checkpoint {size:.0f} MiB; medians over the ranks")
    print(f"blocking save: nf {median['nf_save']:.2f} s, dcp {median['dcp_save']:.2f} s "
          f"(ratio {median['nf_save'] / median['dcp_save']:.2f})")
    print(f"async save: back to training after nf {median['nf_async_return']:.2f} s / dcp "
          f"{median['dcp_async_return']:.2f} s; written after nf {median['nf_async_total']:.2f} s / dcp "
          f"{median['dcp_async_total']:.2f} s; extra resident memory nf {median['nf_async_extra_MiB']:.0f} MiB / "
          f"dcp {median['dcp_async_extra_MiB']:.0f} MiB")
    print(f"load: nf {median['nf_load']:.2f} s, dcp {median['dcp_load']:.2f} s "
          f"(ratio {median['nf_load'] / median['dcp_load']:.2f})")
    if not args.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
