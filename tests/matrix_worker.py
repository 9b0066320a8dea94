"""Run by tests/test_matrix_gloo.py under torchrun: strategies of the ND-parallel matrix in 4 real
processes over gloo. Each rank runs the three steps and checks the gathered results against the
single-device run it computes itself; any failure raises, so torchrun exits non-zero."""

import optree
import torch
from test_matrix import (  # this folder is on sys.path
    ATOL,
    MATRIX,
    RTOL,
    reference,
    run_in_this_world,
)

import ndfunc as nf

CASES = {  # name: (matrix entry, transforms, batch layout)
    "fsdp_tp": ("fsdp_tp", [], None),
    "fsdp_cp": ("fsdp_cp", [], None),
    "hsdp": ("hsdp", [], None),
    "fsdp_cp ring zigzag": ("fsdp_cp", [nf.ring_attention("cp")], nf.zigzag),
}


def main() -> None:
    nf.init()
    rank = nf.rank()
    assert nf.world_size() == 4
    expected_params, expected_losses = reference()
    for name, (entry, transforms, layout) in CASES.items():
        params, losses, lowered = run_in_this_world(MATRIX[entry], transforms, layout)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
        for got, want in zip(optree.tree_leaves(params), optree.tree_leaves(expected_params)):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        collectives = lowered.cost_analysis()["collectives"] if transforms else ""  # the ring's ppermutes
        print(f"rank {rank}: {name} ok {collectives}", flush=True)
    nf.shutdown()


if __name__ == "__main__":
    main()
