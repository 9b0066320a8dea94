"""Under data parallelism each rank does 1/n of the step for every model family (the flops of
`cost_analysis` against the one-device program's), with the one-device results, and a simple
step sends only what DP must: the gradients' all-reduces and the loss's."""

import logging

import pytest
import torch
from test_hf_models import make_model

import ndfunc as nf
from ndfunc.sharding import P

logging.getLogger("transformers").setLevel(logging.ERROR)
RANKS = 4


def _sgd(loss):
    def step(params, buffers, x, y):
        value, grads = nf.value_and_grad(loss)(params, buffers, x, y)
        return {k: v - 0.1 * grads[k] for k, v in params.items()}, value

    return step


def _mlp():
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(16, 32, generator=g), "w2": torch.randn(32, 4, generator=g)}
    loss = lambda p, b, x, y: torch.nn.functional.mse_loss(torch.tanh(x @ p["w1"]) @ p["w2"], y)  # noqa: E731
    return _sgd(loss), params, {}, torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)


def _cnn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10))
    params, buffers, apply = nf.nn.functional(model)
    loss = lambda p, b, x, y: torch.nn.functional.cross_entropy(apply(p, b, x), y)  # noqa: E731
    g = torch.Generator().manual_seed(1)
    # (a batch big enough that gathering activations costs more than reducing the weight gradients)
    return _sgd(loss), params, buffers, torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)


class _MixerBlock(torch.nn.Module):
    """MLP-Mixer's block: an MLP across tokens, then one across channels, each after a LayerNorm."""

    def __init__(self, tokens: int, channels: int):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(channels), torch.nn.LayerNorm(channels)
        self.tokens = torch.nn.Sequential(torch.nn.Linear(tokens, 2 * tokens), torch.nn.GELU(),
                                          torch.nn.Linear(2 * tokens, tokens))
        self.channels = torch.nn.Sequential(torch.nn.Linear(channels, 2 * channels), torch.nn.GELU(),
                                            torch.nn.Linear(2 * channels, channels))

    def forward(self, x):
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


def _mixer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), _MixerBlock(8, 16), _MixerBlock(8, 16))
    params, buffers, apply = nf.nn.functional(model)
    loss = lambda p, b, x, y: torch.nn.functional.cross_entropy(apply(p, b, x).mean(1), y)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    return _sgd(loss), params, buffers, torch.randn(32, 8, 12, generator=g), torch.randint(0, 16, (32,), generator=g)


def _moe():
    """A top-1 mixture of experts with a capacity (GShard's dispatch): each token goes to its best
    expert's next free slot, tokens past the capacity are dropped; the slots count over the whole batch."""
    g = torch.Generator().manual_seed(4)
    # experts wide enough that splitting their work over the ranks beats reducing their inputs whole
    e, c, h, cap = 4, 12, 256, 6
    params = {"router": torch.randn(c, e, generator=g), "w_in": torch.randn(e, c, h, generator=g) / c**0.5,
              "w_out": torch.randn(e, h, c, generator=g) / h**0.5}

    def loss(p, b, x, y):
        gates = torch.softmax(x @ p["router"], -1)  # (n, e)
        mask = torch.nn.functional.one_hot(gates.argmax(-1), e).to(x.dtype)
        slot = (torch.cumsum(mask, 0) * mask - 1).to(torch.int64)  # each token's place in its expert's queue
        dispatch = torch.nn.functional.one_hot(slot.clamp(0, cap - 1), cap).to(x.dtype) * (
            (slot >= 0) & (slot < cap)).to(x.dtype)[..., None]  # (n, e, cap)
        routed = torch.einsum("nes,nc->esc", dispatch, x)
        out = torch.einsum("esh,ehc->esc", torch.relu(torch.einsum("esc,ech->esh", routed, p["w_in"])), p["w_out"])
        combined = torch.einsum("nes,esc->nc", dispatch * gates[..., None], out)
        return torch.nn.functional.mse_loss(combined, y)

    return _sgd(loss), params, {}, torch.randn(32, c, generator=g), torch.randn(32, c, generator=g)


def _hf(family):
    def case():
        params, buffers, apply = nf.nn.functional(make_model(family, "sdpa"))
        ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))
        return _sgd(lambda p, b, x, y: apply(p, b, x, labels=y).loss), params, buffers, ids, ids

    return case


FAMILIES = {"mlp_mse": _mlp, "cnn_batchnorm": _cnn, "mlp_mixer": _mixer, "moe_capacity": _moe, **{f"hf_{f}": _hf(f) for f in ("llama", "gpt2", "qwen2", "mistral")}}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_rank_does_one_nth_of_the_step_with_one_devices_results(family):
    step, params, buffers, x, y = FAMILIES[family]()
    whole = nf.jit(step).lower(params, buffers, x, y).cost_analysis()["flops"]
    want_params, want_loss = step(params, {k: v.clone() for k, v in buffers.items()}, x, y)
    with nf.simulate(RANKS):
        f = nf.jit(step, mesh=nf.make_mesh(dp=RANKS), in_shardings=(P(), P(), P("dp"), P("dp")),
                   out_shardings=(P(), P()))
        per_rank = f.lower(params, buffers, x, y).cost_analysis()["flops"]
        got_params, got_loss = f(params, buffers, x, y)
    assert per_rank == pytest.approx(whole / RANKS, rel=0.02), (per_rank, whole)
    torch.testing.assert_close(nf.device_get(got_loss), want_loss, rtol=1e-5, atol=1e-6)
    for k in want_params:
        torch.testing.assert_close(nf.device_get(got_params[k]), want_params[k], rtol=1e-4, atol=1e-6)


def test_the_dp_step_of_an_mlp_sends_the_gradients_and_the_loss_and_nothing_else():
    step, params, buffers, x, y = _mlp()
    with nf.simulate(RANKS):
        lowered = nf.jit(step, mesh=nf.make_mesh(dp=RANKS), in_shardings=(P(), P(), P("dp"), P("dp")),
                         out_shardings=(P(), P())).lower(params, buffers, x, y)
    costs = lowered.cost_analysis()
    assert set(costs["collectives"]) == {"all_reduce"}, costs["collectives"]
    # the two gradients and the scalar loss, fp32, each once, by ring all-reduces (each rank sends
    # 2 (n - 1) / n of what is reduced)
    assert costs["comm_bytes"]["all_reduce"] == 2 * (RANKS - 1) / RANKS * (16 * 32 + 32 * 4 + 1) * 4
