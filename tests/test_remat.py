"""nf.remat: the same gradients as without it (torch.func on the plain function), the forward
computed again (flops), and the activations no longer held from forward to backward (peak)."""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch

import ndfunc as nf
from models import llama, train
from ndfunc.sharding import P

LAYERS = 4


def mlp_loss(policy):
    def layer(w, x):
        return torch.tanh(torch.tanh(x @ w).sin() @ w)

    block = nf.remat(layer, policy) if policy else layer

    def loss(ws, x):
        h = x
        for w in ws:
            h = block(w, h)
        return h.square().sum()

    return loss


def data():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, 64, generator=g) / 8 for _ in range(LAYERS)], torch.randn(256, 64, generator=g)


def lowered(policy, ws, x):
    with nf.simulate(2):
        step = nf.jit(nf.grad(mlp_loss(policy)), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")))
        return nf.device_get(step(ws, x)), step.lower(ws, x).cost_analysis()


def test_remat_keeps_the_gradients_and_trades_memory_for_recomputation():
    ws, x = data()
    expected = torch.func.grad(mlp_loss(None))(ws, x)
    results = {policy: lowered(policy, ws, x) for policy in (None, "full", "save_dots")}
    for grads, _ in results.values():  # summed over two ranks: another order than one device's
        for a, b in zip(grads, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    plain, full, dots = (results[p][1] for p in (None, "full", "save_dots"))
    # full: each layer's two products run again in backward, on each rank's 128 rows
    assert full["flops"] - plain["flops"] == LAYERS * 2 * (2 * 128 * 64 * 64)
    assert dots["flops"] == plain["flops"]  # the products are kept, only the rest is recomputed
    assert full["peak_memory_bytes"] < dots["peak_memory_bytes"] < plain["peak_memory_bytes"]


@pytest.mark.slow
def test_remat_in_the_llama_step_equals_the_plain_step_and_holds_far_fewer_activations():
    base = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=4)
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randint(0, base.vocab_size, (8, 64), generator=g) for k in ("tokens", "targets")}
    # eps 1e-5: with 1e-8, AdamW's first step turns fp32 summation-order noise near a zero gradient
    # into a whole step (the unsharded fp32 step is 3.6x the tolerance from the same in float64;
    # with 1e-5, 4% of it), so the comparison is of what remat does
    opt = nf.optim.adamw(1e-3, eps=1e-5)
    params = llama.init(base, nf.random.key(0))
    expected = train.make_step(base, opt)(params, opt.init(params), batch)
    activations = {}
    for policy in (None, "full"):
        cfg = dataclasses.replace(base, remat=policy)
        step = nf.jit(train.make_step(cfg, opt))
        got = step(params, opt.init(params), batch)
        for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):  # an Adam step: as elsewhere
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        fixed = 4 * sum(p.numel() * 4 for p in optree.tree_leaves(params))  # params, grads, two moments
        activations[policy] = step.lower(params, opt.init(params), batch).cost_analysis()["peak_memory_bytes"] - fixed
    assert activations["full"] <= 0.4 * activations[None]  # the guide's 60% (and more)


def test_remat_policy_is_checked():
    with pytest.raises(ValueError, match=r"^nf.remat: policy is one of \('full', 'save_dots'\), got 'some'\.$"):
        nf.remat(lambda x: x, "some")
