"""Hugging Face Llama checkpoints <-> ndfunc parameter trees.

`load_llama(path, shardings)` reads each rank's block of each tensor straight from the safetensors
file (plain reads in bounded bands, models/safetensors_io.py), so no rank ever holds a whole copy of
a sharded weight, and its memory grows by its blocks only.
`save_llama(path, cfg, params)` writes a directory `transformers.LlamaForCausalLM` loads, and
`save_model(path, model, params)` one any transformers model's class loads, of its own parameters.

Hugging Face stores projections as `nn.Linear` weights, (out, in); ndfunc keeps input dims first
and heads as their own dim (see models/llama.py). Each parameter maps to one HF tensor by a
layout: the same array (`same`), its transpose (`T`), or a head-split transpose (`qkv`, `o`).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable

import torch

import ndfunc as nf
from models import safetensors_io
from models.llama import LlamaConfig, param_shapes
from models.safetensors_io import SafetensorsFile
from ndfunc.tree import (
    tree_broadcast_prefix,
    tree_flatten_with_path,
    tree_map_with_path,
)

Index = tuple[slice, ...]


def hf_layout(cfg: LlamaConfig) -> dict[str, tuple[str, str]]:
    """ndfunc parameter path -> (Hugging Face tensor name, layout)."""
    names = {"embed": ("model.embed_tokens.weight", "same"), "norm": ("model.norm.weight", "same")}
    if not cfg.tie_embeddings:
        names["lm_head"] = ("lm_head.weight", "T")
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        names.update({
            f"{ours}.attn_norm": (f"{hf}.input_layernorm.weight", "same"),
            f"{ours}.mlp_norm": (f"{hf}.post_attention_layernorm.weight", "same"),
            f"{ours}.attn.wq": (f"{hf}.self_attn.q_proj.weight", "qkv"),
            f"{ours}.attn.wk": (f"{hf}.self_attn.k_proj.weight", "qkv"),
            f"{ours}.attn.wv": (f"{hf}.self_attn.v_proj.weight", "qkv"),
            f"{ours}.attn.wo": (f"{hf}.self_attn.o_proj.weight", "o"),
            f"{ours}.mlp.w1": (f"{hf}.mlp.gate_proj.weight", "T"),
            f"{ours}.mlp.w3": (f"{hf}.mlp.up_proj.weight", "T"),
            f"{ours}.mlp.w2": (f"{hf}.mlp.down_proj.weight", "T"),
        })
    return names


def read_block(read: Callable[[Index], torch.Tensor], layout: str, shape: tuple[int, ...], index: Index) -> torch.Tensor:
    """Our block `index` of a parameter of `shape`, from `read(hf_index)` of the HF tensor."""
    if layout == "same":
        return read(index)
    if layout == "T":
        return read((index[1], index[0])).T
    if layout == "qkv":  # ours (D, H, K) = hf (H*K, D) split and transposed
        d, h, k = index
        head_dim = shape[2]
        rows = read((slice(h.start * head_dim, h.stop * head_dim), d))  # (h*K, d): whole heads only
        return rows.unflatten(0, (h.stop - h.start, head_dim))[:, k, :].permute(2, 0, 1)
    if layout == "o":  # ours (H, K, D) = hf (D, H*K) split and transposed
        h, k, d = index
        head_dim = shape[1]
        cols = read((d, slice(h.start * head_dim, h.stop * head_dim)))  # (d, h*K)
        return cols.unflatten(1, (h.stop - h.start, head_dim))[:, :, k].permute(1, 2, 0)
    raise ValueError(f"unknown layout {layout!r}")


def to_hf(layout: str, x: torch.Tensor) -> torch.Tensor:
    """A whole parameter in Hugging Face's layout (the inverse of `read_block` over everything)."""
    if layout == "same":
        return x
    if layout == "T":
        return x.T
    if layout == "qkv":
        return x.permute(1, 2, 0).flatten(0, 1)
    if layout == "o":
        return x.permute(2, 0, 1).flatten(1, 2)
    raise ValueError(f"unknown layout {layout!r}")


def config_from_hf(hf: dict) -> LlamaConfig:
    """A LlamaConfig from a Hugging Face `config.json`; refuses what models/llama.py does not compute."""
    refused = [
        ("model_type", hf.get("model_type", "llama"), "llama"),
        ("hidden_act", hf.get("hidden_act", "silu"), "silu"),
        ("attention_bias", bool(hf.get("attention_bias", False)), False),
        ("mlp_bias", bool(hf.get("mlp_bias", False)), False),
        ("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0), 1.0),
    ]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    refused.append(("rope type", rope.get("rope_type", rope.get("type", "default")), "default"))
    for field, value, supported in refused:
        if value != supported:
            raise ValueError(
                f"config.json has {field} = {value!r}; ndfunc's Llama computes only {field} = "
                f"{supported!r} (plain Llama: no biases, SiLU, full default rotary embedding)."
            )
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise ValueError(
            f"config.json has head_dim {hf['head_dim']} but hidden_size {hf['hidden_size']} / "
            f"num_attention_heads {heads} = {hf['hidden_size'] // heads}; ndfunc's Llama needs them equal."
        )
    return LlamaConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=hf.get("rms_norm_eps", 1e-6),  # transformers' LlamaConfig default
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 2048),
    )


def config_to_hf(cfg: LlamaConfig, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json; expected a Hugging "
            f"Face checkpoint directory saved with safetensors."
        )
    return {name: single for name in SafetensorsFile(single).names()}


def load_llama(path: str | os.PathLike, shardings=None) -> tuple[LlamaConfig, dict]:
    """Read a Hugging Face Llama directory into `(LlamaConfig, params)`.

    Args:
        path: a directory with `config.json` and `model.safetensors` (or a sharded index).
        shardings: None for whole tensors; else a prefix tree of NamedSharding (or `P` under a mesh)
            over the parameter tree, and each rank reads only its own block of each tensor.
    """
    path = pathlib.Path(path)
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    files, layout = _weight_files(path), hf_layout(cfg)
    missing = sorted(name for name, _ in layout.values() if name not in files)
    if missing:
        raise ValueError(
            f"{path} lacks {len(missing)} tensors that config.json's model needs, e.g. {missing[:3]}; "
            f"check that config.json belongs to these weights."
        )
    shapes = param_shapes(cfg)
    handles = {file: SafetensorsFile(file) for file in set(files.values())}

    def reader(name: str) -> Callable[[Index], torch.Tensor]:
        return lambda index: handles[files[name]].read(name, index)

    def load(p: str, shape: tuple[int, ...], sharding) -> torch.Tensor:
        name, kind = layout[p]
        read = reader(name)
        stored = handles[files[name]].shape(name)
        expected = tuple(to_hf(kind, torch.empty(shape, device="meta")).shape)
        if stored != expected:
            raise ValueError(
                f"{name} has shape {stored} in {files[name].name}, but config.json describes {expected}; "
                f"the config does not match the weights (check vocab_size, hidden_size, "
                f"intermediate_size and the head counts)."
            )
        whole = tuple(slice(0, n) for n in shape)
        if sharding is None:
            return read_block(read, kind, shape, whole).contiguous()
        return nf.make_array_from_callback(
            shape, sharding, lambda index: read_block(read, kind, shape, index).contiguous()
        )

    if shardings is None:
        return cfg, tree_map_with_path(lambda p, shape: load(p, tuple(shape), None), shapes)
    from ndfunc._src.sharding.named_sharding import resolve_sharding

    specs = tree_broadcast_prefix(shardings, shapes, prefix_name="shardings", full_name="parameters")
    params = tree_map_with_path(lambda p, shape, s: load(p, tuple(shape), resolve_sharding(s, p)), shapes, specs)
    return cfg, params


def save_llama(path: str | os.PathLike, cfg: LlamaConfig, params: dict) -> None:
    """Write `params` (whole tensors or DTensors of any layout) as a Hugging Face Llama directory.

    One tensor at a time is gathered (every rank takes part) and written by rank 0, then dropped:
    no rank holds more than one whole tensor beyond its own blocks. The file is written by
    `models.safetensors_io` (no numpy needed)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layout = hf_layout(cfg)
    entries = []
    for p, x in tree_flatten_with_path(params)[0]:
        if p not in layout:
            raise ValueError(f"parameter {p!r} has no place in a Hugging Face Llama checkpoint for {cfg}.")
        name, kind = layout[p]
        shape = tuple(to_hf(kind, torch.empty(x.shape, device="meta")).shape)
        entries.append((name, shape, x.dtype, lambda x=x, kind=kind: to_hf(kind, nf.device_get(x)).contiguous()))
    dtype = entries[0][2]
    writer = nf.rank() == 0
    safetensors_io.write(path / "model.safetensors", entries, metadata={"format": "pt"}, write=writer)
    if writer:
        (path / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype), indent=2))


def save_model(path: str | os.PathLike, model: torch.nn.Module, params: dict) -> None:
    """Write `params` (a transformers model's parameters by name, as `nf.nn.functional(model)`
    gives them: whole tensors or DTensors of any layout) as a directory `from_pretrained` loads, as
    `model.save_pretrained` would: its config (with the parameters' dtype), generation config and
    persistent buffers, and each parameter once (a tied one under its first name). Gathered and
    written a tensor at a time, as `save_llama`."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = dict(model.state_dict(keep_vars=True))
    first = dict(model.named_parameters())  # each tied parameter once, under its first name
    # a frozen one (no gradient: not among nf.nn.functional's params) as the model holds it
    missing = sorted({name for name, p in first.items() if p.requires_grad} - set(params))
    if missing:
        raise ValueError(f"save_model: {len(missing)} of {type(model).__name__}'s parameters are not among those "
                         f"given (e.g. {missing[0]!r}); pass every parameter nf.nn.functional(model) gives.")
    entries = []
    for name, x in tensors.items():
        if name in params:
            x = params[name]
        elif isinstance(x, torch.nn.Parameter) and name not in first:
            continue  # a tie's other name: transformers ties it again on loading
        entries.append((name, tuple(x.shape), x.dtype, lambda x=x: nf.device_get(x.detach()).contiguous()))
    writer = nf.rank() == 0
    safetensors_io.write(path / "model.safetensors", entries, metadata={"format": "pt"}, write=writer)
    if writer:
        config = type(model.config).from_dict(model.config.to_dict())
        name = next(iter(first))  # (a frozen base's, where it is one)
        dtype = params.get(name, first[name]).dtype
        # transformers >= 4.56 names it `dtype`; before, `torch_dtype`
        setattr(config, "dtype" if "dtype" in config.to_dict() else "torch_dtype", dtype)
        config.save_pretrained(path)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(path)
