"""The same sharding code in 4 real processes over gloo, launched by torchrun."""

import pathlib
import re
import subprocess
import sys

import pytest
from helpers import CONFORMANCE, conformance_cases, outside_torchrun_env, torchrun

WORKER = pathlib.Path(__file__).with_name("gloo_worker.py")


@pytest.mark.gloo
def test_device_put_and_get_in_four_gloo_processes():
    proc = torchrun(WORKER, str(CONFORMANCE))
    # The four processes share one pipe, so their lines can interleave: match, don't split.
    done = sorted(re.findall(r"rank (\d+): (\d+) layouts checked", proc.stdout))
    jax_cases = sum(1 for c in conformance_cases() if c["mesh"] == {"x": 4} and "error" not in c)
    expected = jax_cases + 5 + 1  # JAX's 4-device cases, five specs on the 2x2 mesh, one callback
    assert done == [(str(r), str(expected)) for r in range(4)], proc.stdout
    assert sorted(re.findall(r"rank (\d+): shard_map ok", proc.stdout)) == ["0", "1", "2", "3"], proc.stdout


@pytest.mark.gloo
def test_init_without_torchrun_is_a_world_of_one():
    env = outside_torchrun_env()
    script = (
        "import torch, ndfunc as nf\n"
        "from ndfunc.sharding import NamedSharding, P\n"
        "nf.init(); nf.init()\n"
        "assert (nf.rank(), nf.world_size(), nf.is_simulated()) == (0, 1, False)\n"
        "x = nf.device_put(torch.arange(6.0).reshape(2, 3), NamedSharding(nf.make_mesh(dp=1), P('dp')))\n"
        "assert torch.equal(nf.device_get(x), torch.arange(6.0).reshape(2, 3))\n"
        "nf.shutdown()\n"
        "print('world of one ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "world of one ok" in proc.stdout, proc.stdout + proc.stderr
