"""Run by tests/test_simulation.py under torchrun: 4 real gloo processes.

The BatchNorm step's every output and argument after the call equal what `nf.simulate(4)` gave
(saved by the test, path in argv[1]), to a few ulps (integers exactly); Hugging Face Llama on FSDP
and GPT-2 on DP train equal to their eager runs (each family and each strategy once: the other
pairs run in simulation, `test_hf_models.py`, which equals real ranks). Any failure raises, so
torchrun exits non-zero.
"""

import sys

import optree
import torch
from test_hf_models import LOSS_TOL, PARAM_TOL, eager_run, jitted_run  # this folder is first on sys.path
from test_simulation import batchnorm_case, run_batchnorm

import ndfunc as nf

CASES = [("llama", "fsdp"), ("gpt2", "dp")]


def main() -> None:
    nf.init()
    rank = nf.rank()
    simulated = torch.load(sys.argv[1])
    real = run_batchnorm(nf.world_size(), batchnorm_case())
    paths, leaves, _ = optree.tree_flatten_with_path(real)
    for path, a, b in zip(paths, leaves, optree.tree_leaves(simulated), strict=True):
        # a few ulps: BatchNorm's statistics sum in another order with this process's one thread;
        # integers (the counter) exactly
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=lambda m, path=path: f"{path}: {m}")
    print(f"rank {rank}: batchnorm equals simulation", flush=True)
    for family, strategy in CASES:
        want_losses, want_params = eager_run(family, "sdpa")
        axes = {"dp": dict(dp=4), "fsdp": dict(dp_shard=4)}[strategy]
        losses, params, _, _ = jitted_run(family, "sdpa", strategy, axes=axes)
        torch.testing.assert_close(losses, want_losses, **LOSS_TOL)
        for k in want_params:
            torch.testing.assert_close(params[k], want_params[k], **PARAM_TOL)
        print(f"rank {rank}: {family} {strategy} equals eager", flush=True)
    nf.shutdown()


if __name__ == "__main__":
    main()
