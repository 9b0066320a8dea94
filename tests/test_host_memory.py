"""ndfunc.host_memory: a step's freed host memory stays mapped for the next step. The reference is
the same training loop in a process whose malloc is left as it is, counted in page faults."""

import subprocess
import sys

import pytest

from ndfunc.host_memory import _glibc

# an eager MLP step (activations of 1 and 3 MiB, freed as backward passes them): page faults per
# step, after five steps to warm up
LOOP = """
import resource, sys, torch
import ndfunc as nf
torch.set_num_threads(1)
nf.init(keep_host_memory=sys.argv[1] == "keep")
g = torch.Generator().manual_seed(0)
ws = [torch.randn(256, 768, generator=g, requires_grad=True) for _ in range(4)]
x = torch.randn(1024, 256, generator=g)
def step():
    h = x
    for w in ws:
        h = torch.tanh(h @ w) @ w.T
    h.square().mean().backward()
    for w in ws:
        w.grad = None
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 20)
"""


def faults_per_step(keep: bool) -> int:
    out = subprocess.run([sys.executable, "-c", LOOP, "keep" if keep else "leave"], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(_glibc() is None, reason="malloc's thresholds are glibc's (mallopt); this C library has none to set")
def test_a_gloo_world_reuses_the_pages_the_last_step_freed():
    left = faults_per_step(keep=False)  # glibc as it is: freed blocks go back, and fault in again
    assert left >= 256  # a MiB of pages, at least, every step
    assert faults_per_step(keep=True) < left / 4
