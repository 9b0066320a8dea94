"""Run by tests/test_agreement.py under torchrun: 4 real processes over gloo.

`disagree`: rank 2 bakes another learning rate into its step, rank 3 lays an argument out
otherwise; every rank must raise RanksDisagreeError naming them, at once. `stopped`: rank 1 stops
answering; the others' collective must fail within nf.init's timeout, not hang.
"""

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


def stopped() -> None:
    nf.init(timeout=4)
    rank = nf.rank()
    if rank == 1:
        # a hung rank: alive but silent past the others' 4 s timeout (a dead one would close its
        # connections, and they would fail at once, not by the timeout under test)
        time.sleep(12)
        return
    start = time.perf_counter()
    try:
        torch.distributed.all_reduce(torch.ones(1))
    except RuntimeError as e:
        print(f"rank {rank}: failed after {time.perf_counter() - start:.1f} s: {type(e).__name__}", flush=True)
    else:
        raise AssertionError("a collective with a missing rank completed")


if __name__ == "__main__":
    {"disagree": disagree, "stopped": stopped}[sys.argv[1]]()
