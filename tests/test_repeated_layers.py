"""A model's `ModuleList` layers that are alike, called through `nf.nn.functional`, are traced once
and copied per layer under `nf.jit`: the program is the one traced op by op, node for node, and
computes what eager does; layers that read what differs per layer, take a KV cache or run hooks are
traced op by op."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import transformers

import ndfunc as nf
from ndfunc._src import repeated_layers
from ndfunc._src.trace import trace
from test_stamp import canonical

logging.getLogger("transformers").setLevel(logging.ERROR)


class Block(torch.nn.Module):
    def __init__(self, index: int, reads_index: bool):
        super().__init__()
        self.index, self.reads_index = index, reads_index  # an index, as transformers' layer_idx
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x, scale=None):
        y = torch.tanh(self.proj(self.norm(x)))
        if self.reads_index:
            y = y / (self.index + 1)
        return x + y * (1.0 if scale is None else scale)


class Stack(torch.nn.Module):
    def __init__(self, n: int, reads_index: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(i, reads_index) for i in range(n))

    def forward(self, x, scale=None):
        for layer in self.layers:
            x = layer(x, scale=scale)
        return x.square().mean()


def hf_model(family: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config_cls, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                       "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                       "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
    config = config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    return cls(config)


def counted(monkeypatch, model: torch.nn.Module) -> list:
    """Each run of a layer's own forward (the op-by-op trace runs it once per layer)."""
    layer_cls = type(next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))[0])
    runs, forward = [], layer_cls.forward
    monkeypatch.setattr(layer_cls, "forward", lambda self, *a, **k: runs.append(1) or forward(self, *a, **k))
    return runs


def traced_both_ways(model, call, args):
    """The gradient step of `call(apply, params, buffers, *args)` traced with the layers copied and
    traced op by op (nothing routed): (copied, op by op, params)."""
    params, buffers, apply = nf.nn.functional(model)

    def step(params, *args):
        return nf.value_and_grad(lambda p: call(apply, p, buffers, *args))(params)
    copied = trace(step, (params, *args))
    routed = repeated_layers.routed
    repeated_layers.routed = lambda module: contextlib.nullcontext()
    try:
        plain = trace(step, (params, *args))
    finally:
        repeated_layers.routed = routed
    return copied, plain, params, step


def lm_loss(apply, p, buffers, ids, **kwargs):
    return apply(p, buffers, ids, labels=ids, **kwargs).loss


@pytest.mark.parametrize("family", ["torch", "llama", "gpt2", "qwen2", "mistral"])
def test_alike_layers_are_traced_once_and_the_program_is_the_one_traced_op_by_op(monkeypatch, family):
    layers = 6
    if family == "torch":
        model, call, args = Stack(layers), lambda apply, p, b, x: apply(p, b, x), (torch.randn(4, 8),)
    else:
        model, call = hf_model(family, layers), lm_loss
        args = (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)),)
    runs = counted(monkeypatch, model)
    copied, plain, params, step = traced_both_ways(model, call, args)
    assert 0 < len(runs) - layers < layers  # copied: the templates' runs, fewer than the layers; op by op: one each
    assert canonical(copied.graph) == canonical(plain.graph)
    (value, grads), (want_value, want_grads) = copied(params, *args), step(params, *args)
    torch.testing.assert_close(value, want_value)
    torch.testing.assert_close(grads, want_grads)


def test_layers_that_read_what_differs_per_layer_are_traced_op_by_op_and_compute_what_eager_does(monkeypatch):
    model, x = Stack(4, reads_index=True), torch.randn(4, 8)
    runs = counted(monkeypatch, model)
    copied, plain, params, step = traced_both_ways(model, lambda apply, p, b, x: apply(p, b, x), (x,))
    # a template tried per signature (the first layer's input is not differentiated, the others' are),
    # each failing on the index; then each layer
    assert len(runs) - 4 == 2 + 4
    assert canonical(copied.graph) == canonical(plain.graph)
    torch.testing.assert_close(copied(params, x), step(params, x))
    assert [layer.index for layer in model.layers] == [0, 1, 2, 3]  # put back


def test_layers_given_a_kv_cache_running_hooks_or_with_a_replaced_forward_are_traced_op_by_op(monkeypatch):
    model = hf_model("llama", 3)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    runs = counted(monkeypatch, model)
    copied, plain, params, step = traced_both_ways(model, lambda *a: lm_loss(*a, use_cache=True), (ids,))
    assert len(runs) == 2 * 3  # a DynamicCache written by every layer: each layer, in both traces
    assert canonical(copied.graph) == canonical(plain.graph)
    seen = []
    model.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    runs.clear()
    copied, plain, params, step = traced_both_ways(model, lm_loss, (ids,))
    assert len(runs) == 2 * 3 and len(seen) == 2 * 1  # a hook in one layer: every layer op by op
    torch.testing.assert_close(copied(params, ids), step(params, ids))

    model = Stack(9)  # a forward replaced on the instance (accelerate's hooks): that layer op by op
    wrapped = model.layers[0].forward
    model.layers[0].forward = lambda *a, **k: wrapped(*a, **k) * 2
    runs = counted(monkeypatch, model)
    x = torch.randn(4, 8)
    copied, plain, params, step = traced_both_ways(model, lambda apply, p, b, x: apply(p, b, x), (x,))
    # (the replaced layer runs uncounted) op by op: 8 runs; copied: the others' template, and copies
    assert len(runs) - 8 < 8 and "forward" in vars(model.layers[0])  # (and the replacement kept)
    assert canonical(copied.graph) == canonical(plain.graph)
    torch.testing.assert_close(copied(params, x), step(params, x))


def test_apply_calls_a_hugging_face_model_without_a_kv_cache_unless_asked():
    model = hf_model("llama", 2)
    params, buffers, apply = nf.nn.functional(model)
    ids = torch.randint(0, 64, (2, 8))
    assert model(ids).past_key_values is not None  # the model's own default
    assert apply(params, buffers, ids).past_key_values is None
    assert apply(params, buffers, ids, use_cache=True).past_key_values is not None
    torch.testing.assert_close(apply(params, buffers, ids).logits, model(ids).logits)
