"""gloo's own collectives against the all-to-all forms ndfunc runs on gloo (ndfunc._src.partition.backends.gloo).

    python benchmarks/gloo_collectives.py [--ranks 4] [--repeats 20]

Starts the ranks itself (torchrun). For each collective and size, on every rank: wall time and
CPU time of the process (its gloo threads included) per call, the median over the ranks; the
results are checked equal. Reported as ratios all-to-all / gloo: below 1 the all-to-all is faster.
- reduce-scatter (sum): gloo's, against an all-to-all of the n row blocks and a local sum;
- all-gather: gloo's, against an all-to-all of n copies of the block;
- all-reduce (sum): gloo's, against an all-to-all of n copies of the whole and a local sum.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

SIZES = (2**4, 2**8, 2**10, 2**14, 2**18, 2**20, 2**22)  # bytes: each rank's block (gathers) or the whole tensor


def timed(f, repeats: int) -> tuple[float, float]:
    for _ in range(3):
        f()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats


def cases(n: int, nbytes: int):
    """(name, gloo's way, the all-to-all way), each returning its result."""
    numel = nbytes // 4
    whole = torch.randn(numel) + dist.get_rank()
    block = torch.randn(numel) + dist.get_rank()
    gathered, swapped = torch.empty(numel * n), torch.empty(numel * n)
    out = torch.empty(max(numel // n, 1))
    splits = [numel // n] * n

    def rs_gloo():
        dist.reduce_scatter_tensor(out, whole)
        return out

    def rs_a2a():
        dist.all_to_all_single(swapped[:numel], whole, splits, splits)
        return swapped[:numel].view(n, -1).sum(0)

    def ag_gloo():
        dist.all_gather_into_tensor(gathered, block)
        return gathered

    def ag_a2a():
        dist.all_to_all_single(swapped, block.repeat(n))
        return swapped

    def ar_gloo():
        total = whole.clone()
        dist.all_reduce(total)
        return total

    def ar_a2a():
        dist.all_to_all_single(swapped, whole.repeat(n))
        return swapped.view(n, -1).sum(0)

    return [("reduce-scatter", rs_gloo, rs_a2a), ("all-gather", ag_gloo, ag_a2a), ("all-reduce", ar_gloo, ar_a2a)]


def worker(repeats: int) -> None:
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    rows = []
    for nbytes in SIZES:
        for name, gloo, a2a in cases(n, nbytes):
            same = torch.allclose(gloo().clone(), a2a().clone(), rtol=1e-5, atol=1e-4)
            (gw, gc), (aw, ac) = timed(gloo, repeats), timed(a2a, repeats)
            rows.append({"op": name, "bytes": nbytes, "gloo": [gw, gc], "a2a": [aw, ac], "same": same})
    print(json.dumps({"rank": dist.get_rank(), "rows": rows}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help="(internal) one rank, under torchrun")
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(args.ranks), __file__, "--worker", f"--repeats={args.repeats}"],
                         capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    # one JSON object per rank (lines of several ranks may run together)
    decoder = json.JSONDecoder()
    ranks = [decoder.raw_decode(out.stdout, m.start())[0] for m in re.finditer(r'\{"rank"', out.stdout)]
    print(f"{args.ranks} gloo processes on {os.cpu_count()} cores; ms per call (wall / CPU), median over ranks")
    print(f"{'collective':>15} {'bytes':>9} {'gloo':>15} {'all-to-all':>15} {'wall ratio':>10} {'CPU ratio':>9}")
    for i, row in enumerate(ranks[0]["rows"]):
        assert all(r["rows"][i]["same"] for r in ranks), row

        def med(way: str, j: int, i: int = i) -> float:
            return statistics.median(r["rows"][i][way][j] for r in ranks) * 1e3

        print(f"{row['op']:>15} {row['bytes']:>9} {med('gloo', 0):7.2f} / {med('gloo', 1):5.2f} "
              f"{med('a2a', 0):7.2f} / {med('a2a', 1):5.2f} {med('a2a', 0) / med('gloo', 0):10.2f} "
              f"{med('a2a', 1) / med('gloo', 1):9.2f}")


if __name__ == "__main__":
    main()
