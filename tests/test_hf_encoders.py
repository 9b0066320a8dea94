"""Hugging Face models that are not causal LMs, called as they are (`nf.nn.functional`): an
encoder with a padding mask (BERT), an encoder-decoder with relative position buckets (T5), an
audio encoder-decoder whose encoder layers get a transposed input (Whisper, with SDPA), and a
vision transformer (ViT). Each jitted `nf.value_and_grad` of the model's own loss, on two simulated
ranks, against `torch.func.grad_and_value` eagerly: batch split (dp), parameters sharded too
(fsdp, by `nf.nn.partition_specs`), and the token sequence split (cp)."""

from __future__ import annotations

import pytest
import torch
import transformers

import ndfunc as nf
from ndfunc.sharding import P

V, B, S = 64, 4, 16
TOL = dict(rtol=1e-4, atol=1e-5)


def _ids(seed: int, shape=(B, S), low: int = 2) -> torch.Tensor:
    return torch.randint(low, V, shape, generator=torch.Generator().manual_seed(seed))


def _padding() -> torch.Tensor:
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -5:] = 0
    mask[3, -9:] = 0
    return mask


def bert():
    config = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    x = _ids(1)
    labels = torch.where(torch.rand(B, S, generator=torch.Generator().manual_seed(2)) < 0.3, x, -100)
    return transformers.BertForMaskedLM, config, dict(input_ids=x, attention_mask=_padding(), labels=labels)


def t5():
    config = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration, config, dict(input_ids=_ids(1), attention_mask=_padding(),
                                                                 labels=_ids(5))


def whisper():
    config = transformers.WhisperConfig(vocab_size=V, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32,
                                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                                        suppress_tokens=None, begin_suppress_tokens=None)
    features = torch.randn(B, 8, 32, generator=torch.Generator().manual_seed(4))  # (batch, mel bins, frames)
    return transformers.WhisperForConditionalGeneration, config, dict(input_features=features, labels=_ids(5))


def vit():
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    image_size=16, patch_size=4, num_channels=3, num_labels=3,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pixels = torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    return transformers.ViTForImageClassification, config, dict(pixel_values=pixels, labels=_ids(3, (B,), 0) % 3)


FAMILIES = {"bert": bert, "t5": t5, "whisper": whisper, "vit": vit}
SEQUENCES = ("input_ids", "attention_mask", "labels")  # what cp splits (dim 1); a classification's labels stay whole


CASES = [pytest.param(f, layout, marks=() if f == "bert" else pytest.mark.slow)
         for f in FAMILIES for layout in ("dp", "fsdp", "cp") if not (f == "vit" and layout == "cp")]  # (no sequence)


@pytest.mark.parametrize("family,layout", CASES)
def test_a_hugging_face_model_that_is_no_causal_lm_trains_equal_to_eager(family, layout):
    cls, config, inputs = FAMILIES[family]()
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation="sdpa").eval()
    params, buffers, apply = nf.nn.functional(model)

    def loss(p, batch):
        return apply(p, buffers, **batch).loss

    want_grads, want_loss = torch.func.grad_and_value(loss)(params, inputs)
    axis = {"dp": "dp", "fsdp": "dp_shard", "cp": "cp"}[layout]
    with nf.simulate(2):
        mesh = nf.make_mesh(**{axis: 2})
        pspec = nf.nn.partition_specs(model, mesh, fsdp="dp_shard") if layout == "fsdp" else {k: P() for k in params}
        if layout == "cp":
            bspec = {k: P(None, "cp") if k in SEQUENCES and v.dim() == 2 else P() for k, v in inputs.items()}
        else:
            bspec = {k: P(axis) for k in inputs}
        step = nf.jit(nf.value_and_grad(loss), mesh=mesh, in_shardings=(pspec, bspec), out_shardings=(P(), pspec))
        got_loss, got_grads = nf.device_get(step(params, inputs))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")
