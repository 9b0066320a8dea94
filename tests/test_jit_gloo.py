"""nf.jit in 4 real processes over gloo (torchrun): the same results as one device, and the
collectives that run are the lowered program's."""

import pathlib
import re

import pytest
from helpers import torchrun

WORKER = pathlib.Path(__file__).with_name("jit_worker.py")


@pytest.mark.gloo
def test_jit_in_four_gloo_processes():
    proc = torchrun(WORKER)
    ranks = ["0", "1", "2", "3"]
    assert sorted(re.findall(r"rank (\d+): mlp dp x tp ok", proc.stdout)) == ranks, proc.stdout
    assert sorted(re.findall(r"rank (\d+): llama fsdp ok", proc.stdout)) == ranks, proc.stdout
    assert sorted(re.findall(r"rank (\d+): llama dp_tp ok", proc.stdout)) == ranks, proc.stdout
    assert sorted(re.findall(r"rank (\d+): mlp dp x tp compiled ok", proc.stdout)) == ranks, proc.stdout
    assert sorted(re.findall(r"rank (\d+): ring compiled ok", proc.stdout)) == ranks, proc.stdout
