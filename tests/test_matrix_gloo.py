"""FSDP+TP, FSDP+CP (gathered and as a ring) and HSDP in 4 real processes over gloo (torchrun):
three AdamW steps of llama tiny() equal the single-device run on every rank."""

import pathlib
import re

import pytest
from helpers import torchrun

WORKER = pathlib.Path(__file__).with_name("matrix_worker.py")


@pytest.mark.gloo
def test_matrix_strategies_in_four_gloo_processes():
    proc = torchrun(WORKER)
    for name in ("fsdp_tp", "fsdp_cp", "hsdp", "fsdp_cp ring zigzag"):
        ranks = sorted(re.findall(rf"rank (\d+): {name} ok", proc.stdout))
        assert ranks == ["0", "1", "2", "3"], (name, proc.stdout[-3000:])
    assert re.search(r"fsdp_cp ring zigzag ok .*'ppermute': 4", proc.stdout), proc.stdout[-3000:]
