"""nf.device_put / nf.device_get against torch's native distribute_tensor / full_tensor.

    python benchmarks/device_put.py                                   # 8 simulated ranks
    torchrun --standalone --nproc-per-node 4 benchmarks/device_put.py # 4 real processes (gloo/NCCL)

For each layout, the median wall time of ndfunc's call and of the PyTorch-native one on the same
tensor in the same run, and their ratio (ndfunc / native; below 1 is faster). torch's
`distribute_tensor` by default scatters rank 0's copy (src_data_rank=0); with src_data_rank=None
it slices locally like nf.device_put, so both are shown.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

import ndfunc as nf
from ndfunc.sharding import NamedSharding, P


def median_seconds(*fns, repeats: int) -> list[float]:
    """Median wall time of each function, calls interleaved so that drift and warm-up hit all alike."""
    for fn in fns:
        fn()  # warm up: the first collective on a subgroup connects it
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, record in zip(fns, times):
            if dist.is_initialized() and not nf.is_simulated():
                dist.barrier()
            start = time.perf_counter()
            fn()
            record.append(time.perf_counter() - start)
    return [statistics.median(record) for record in times]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--size", type=int, default=2048, help="square tensor side")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    real = "RANK" in os.environ
    with contextlib.nullcontext() if real else nf.simulate(args.ranks):
        nf.init()
        world = nf.world_size()
        mesh = nf.make_mesh(dp=world // 2, tp=2) if world % 2 == 0 and world > 2 else nf.make_mesh(dp=world)
        full = torch.randn(args.size, args.size)
        say = print if nf.rank() == 0 else (lambda *a: None)
        say(f"{world} ranks ({'simulated' if nf.is_simulated() else dist.get_backend()}), "
            f"tensor {tuple(full.shape)} fp32 ({full.numel() * 4 / 2**20:.0f} MiB), mesh {mesh.shape}")
        say(f"{'layout':<24}{'put':>10}{'native':>10}{'ratio':>8}{'native(local)':>15}{'ratio':>8}"
            f"{'get':>10}{'native':>10}{'ratio':>8}")
        specs = [P(), P("dp"), P("dp", "tp") if "tp" in mesh.axis_names else P(None, "dp")]
        if "tp" in mesh.axis_names:
            specs.append(P(("tp", "dp")))  # needs _StridedShard in DTensor
        for spec in specs:
            sharding = NamedSharding(mesh, spec)
            placements = sharding.placements
            put, native, native_local = median_seconds(
                lambda: nf.device_put(full, sharding),
                lambda: distribute_tensor(full, mesh.device_mesh, placements),
                lambda: distribute_tensor(full, mesh.device_mesh, placements, src_data_rank=None),
                repeats=args.repeats,
            )
            x = nf.device_put(full, sharding)
            get, native_get = median_seconds(lambda: nf.device_get(x), x.full_tensor, repeats=args.repeats)
            say(f"{repr(spec):<24}{put * 1e3:>8.1f}ms{native * 1e3:>8.1f}ms{put / native:>8.2f}"
                f"{native_local * 1e3:>13.1f}ms{put / native_local:>8.2f}"
                f"{get * 1e3:>8.1f}ms{native_get * 1e3:>8.1f}ms{get / native_get:>8.2f}")
        if real:
            nf.shutdown()


if __name__ == "__main__":
    main()
