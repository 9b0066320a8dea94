"""The same sharding code in 4 real processes over gloo, launched by torchrun."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import CONFORMANCE, conformance_cases

WORKER = pathlib.Path(__file__).with_name("gloo_worker.py")


@pytest.mark.gloo
def test_device_put_and_get_in_four_gloo_processes():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         str(WORKER), str(CONFORMANCE)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # The four processes share one pipe, so their lines can interleave: match, don't split.
    done = sorted(re.findall(r"rank (\d+): (\d+) layouts checked", proc.stdout))
    jax_cases = sum(1 for c in conformance_cases() if c["mesh"] == {"x": 4} and "error" not in c)
    expected = jax_cases + 5 + 1  # JAX's 4-device cases, five specs on the 2x2 mesh, one callback
    assert done == [(str(r), str(expected)) for r in range(4)], proc.stdout
    assert sorted(re.findall(r"rank (\d+): shard_map ok", proc.stdout)) == ["0", "1", "2", "3"], proc.stdout
