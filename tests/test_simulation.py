"""Simulated ranks give what real ranks give, arguments included: a step that writes into its
arguments (BatchNorm's running statistics and counter) leaves them as every real rank would, once."""

import pathlib
import re

import pytest
import torch
from helpers import torchrun

import ndfunc as nf
from ndfunc.sharding import P

WORKER = pathlib.Path(__file__).with_name("models_worker.py")


def batchnorm_case():
    """A Linear-BatchNorm-ReLU-Linear train step (SGD) through `nf.nn.functional`, its buffers an
    argument the step writes into, and its data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    params, buffers, apply = nf.nn.functional(model)

    def step(params, buffers, x, y):
        loss, grads = nf.value_and_grad(lambda p, b: ((apply(p, b, x) - y) ** 2).mean())(params, buffers)
        return {k: v - 0.1 * grads[k] for k, v in params.items()}, loss

    g = torch.Generator().manual_seed(1)
    return step, params, {k: v.clone() for k, v in buffers.items()}, torch.randn(8, 4, generator=g), \
        torch.randn(8, 2, generator=g)


def run_batchnorm(n: int, case) -> dict:
    """Every output and every argument after one jitted call of `case` (`batchnorm_case()`, made
    outside any simulation) on `n` data-parallel ranks (this process's: simulated, or real under
    torchrun), as plain tensors."""
    step, params, buffers, x, y = case
    f = nf.jit(step, mesh=nf.make_mesh(dp=n), in_shardings=(P(), P(), P("dp"), P("dp")))
    new_params, loss = f(params, buffers, x, y)
    return nf.device_get({"params": new_params, "loss": loss, "buffers": buffers, "x": x, "y": y,
                          "old_params": params})


def test_a_step_writing_its_arguments_leaves_them_as_one_device_does():
    step, params, buffers, x, y = batchnorm_case()
    want_params, want_loss = step(params, buffers, x, y)  # eager: writes the buffers once
    with nf.simulate(4):
        got = run_batchnorm(4, batchnorm_case())
    assert int(got["buffers"]["1.num_batches_tracked"]) == 1  # not once per simulated rank
    for k in buffers:
        torch.testing.assert_close(got["buffers"][k], buffers[k], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["loss"], want_loss, rtol=1e-6, atol=1e-7)
    for k in want_params:
        torch.testing.assert_close(got["params"][k], want_params[k], rtol=1e-6, atol=1e-7)


@pytest.mark.gloo
def test_simulation_equals_four_gloo_processes_for_outputs_and_written_arguments(tmp_path):
    case = batchnorm_case()
    with nf.simulate(4):
        torch.save(run_batchnorm(4, case), tmp_path / "simulated.pt")
    proc = torchrun(WORKER, str(tmp_path / "simulated.pt"))
    ranks = ["0", "1", "2", "3"]
    assert sorted(re.findall(r"rank (\d+): batchnorm equals simulation", proc.stdout)) == ranks, proc.stdout
    for family, strategy in (("llama", "fsdp"), ("gpt2", "dp")):
        assert sorted(re.findall(rf"rank (\d+): {family} {strategy} equals eager", proc.stdout)) == ranks, proc.stdout


def test_an_empty_value_reduce_scattered_gives_every_rank_its_empty_block():
    # the simulated reduce-scatter split an empty sum into one block, not one per rank, and raised
    x = torch.randn(0, 2, 2)
    loss = lambda x: torch.linalg.matrix_power(x, 5).square().sum()  # noqa: E731
    want = torch.func.grad_and_value(loss)(x)
    spec = P(None, None, "dp")
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(spec,),
                      out_shardings=(P(), spec))
        value, grad = nf.device_get(step(x))
    torch.testing.assert_close((grad, value), want)
