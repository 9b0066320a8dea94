"""Run by tests/test_agreement.py under torchrun: 4 real processes over gloo.

`disagree`: rank 2 bakes another learning rate into its step, rank 3 lays an argument out
otherwise; every rank must raise RanksDisagreeError naming them, at once. `stopped DIR`: rank 1 stops
answering (until the others have reported in DIR); the others' collective must fail within nf.init's timeout, not hang.
"""

import os
import pathlib
import sys
import time

import torch

import ndfunc as nf
from ndfunc.sharding import NamedSharding, P


def disagree() -> None:
    nf.init(timeout=120)  # (a rank slow to arrive under load is no disagreement)
    rank = nf.rank()
    mesh = nf.make_mesh(dp=4)
    lr = 0.2 if rank == 2 else 0.1  # a flag this rank was started with differently

    def step(w, x):
        return ((x @ w).sum() * lr).reshape(1)

    spec = P(None) if rank == 3 else P("dp")
    jitted = nf.jit(step, mesh=mesh, in_shardings=(P(), spec), out_shardings=P())
    w, x = torch.ones(3, 2), torch.ones(8, 3)
    start = time.perf_counter()
    try:
        jitted(w, x)
    except nf.RanksDisagreeError as e:
        print(f"rank {rank}: refused after {time.perf_counter() - start:.1f} s: {e}", flush=True)
    else:
        raise AssertionError("the ranks ran different programs")
    nf.shutdown()


def stopped(directory: str) -> None:
    nf.init(timeout=4)
    rank = nf.rank()
    reported = pathlib.Path(directory)
    if rank == 1:
        # a hung rank: alive but silent until every other rank has reported its collective failed
        # (a dead one would close its connections, and they would fail at once, not by the
        # timeout under test); waiting on their reports, not for a guessed time
        deadline = time.monotonic() + 120
        while len(list(reported.glob("failed_*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    start = time.perf_counter()
    try:
        torch.distributed.all_reduce(torch.ones(1))
    except RuntimeError as e:
        print(f"rank {rank}: failed after {time.perf_counter() - start:.1f} s: {type(e).__name__}", flush=True)
        (reported / f"failed_{rank}").touch()
        # reported: leave without tearing the broken group down (its destructor can meet a gloo
        # thread still waiting on the silent rank, and abort the process: seen once under load)
        os._exit(0)
    else:
        raise AssertionError("a collective with a missing rank completed")


if __name__ == "__main__":
    {"disagree": disagree, "stopped": stopped}[sys.argv[1]](*sys.argv[2:])
