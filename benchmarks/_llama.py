"""What the multi-process llama benchmarks share: their models, and the model, weights and
batches every rank builds alike (the same seeds, so every implementation sees the same data)."""

from __future__ import annotations

import dataclasses

import torch

import ndfunc as nf
from models import llama

CONFIGS = {
    "tiny": llama.LlamaConfig.tiny(),
    "mid": llama.LlamaConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768),
}


def setup(model: str, batch: int, seq: int, steps: int) -> tuple[llama.LlamaConfig, dict, list]:
    """(config, initial parameters, steps + 1 batches of random tokens and targets)."""
    cfg = dataclasses.replace(CONFIGS[model], max_seq_len=max(seq, 256))
    params = llama.init(cfg, nf.random.key(0))
    g = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
                "targets": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)}
               for _ in range(steps + 1)]
    return cfg, params, batches
