"""A Llama-family decoder as pure functions over a parameter tree.

    init(cfg, key) -> params          apply(params, tokens, cfg) -> logits
    loss(params, batch, cfg) -> loss  param_axes(cfg) -> logical dim names of every parameter

RMSNorm, rotary embeddings computed from token positions, grouped-query attention through one
`F.scaled_dot_product_attention` call, SwiGLU. Numerics follow Hugging Face's `LlamaForCausalLM`
(rotate-half RoPE, RMSNorm in float32), so its weights load without permutation (models/hf.py).

Shape legend:
    B batch            L sequence          D model dim (embed)   V vocabulary
    H query heads      G key/value heads   K head dim (D // H)   F feed-forward dim
    R query heads per key/value head (H // G)

Parameters (weights as `x @ w`, input dims first):
    embed (V, D)                   layers[i].attn.wq (D, H, K)   .wk/.wv (D, G, K)   .wo (H, K, D)
    layers[i].mlp.w1/.w3 (D, F)    layers[i].mlp.w2 (F, D)       norms (D,)          lm_head (D, V)
"""

from __future__ import annotations

import copy
import dataclasses

import einops
import optree
import torch
import torch.nn.functional as F

import ndfunc as nf
from ndfunc import random

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    remat: str | None = None  # recompute each decoder layer in backward: 'full' or 'save_dots' (nf.remat)

    def __post_init__(self) -> None:
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"LlamaConfig.{field} must be >= 1, got {getattr(self, field)}.")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must be a multiple of n_heads {self.n_heads} (head_dim = dim // n_heads).")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}: each key/value "
                f"head serves n_heads // n_kv_heads query heads."
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim {self.dim // self.n_heads} must be even for rotary embeddings.")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def tiny(cls) -> "LlamaConfig":
        """For tests: byte vocabulary, two layers, GQA; every dim divides by 8 ranks."""
        return cls(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128, max_seq_len=256)

    @classmethod
    def small(cls) -> "LlamaConfig":
        """About 100M parameters (tied embeddings), for real runs and benchmarks."""
        return cls(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048,
                   tie_embeddings=True, max_seq_len=2048)

    @classmethod
    def llama3_8b(cls, **changes) -> "LlamaConfig":
        """Llama 3 8B's shape (Meta's params.json: 32 layers, dim 4096, GQA 32/8, ffn 14336,
        vocabulary 128256), for planning with stand-ins; 8.03e9 parameters."""
        return cls(**{**dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             rope_theta=500000.0, max_seq_len=8192), **changes})

    @classmethod
    def llama3_70b(cls, **changes) -> "LlamaConfig":
        """Llama 3 70B's shape (80 layers, dim 8192, GQA 64/8, ffn 28672, vocabulary 128256);
        70.6e9 parameters."""
        return cls(**{**dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                             rope_theta=500000.0, max_seq_len=8192), **changes})

    def num_params(self) -> int:
        return sum(shape.numel() for shape in optree.tree_leaves(param_shapes(self)))


def param_shapes(cfg: LlamaConfig) -> dict:
    """The shape of every parameter, as a tree like `init`'s (`torch.Size` leaves: a shape is one
    leaf of the tree, not a tuple of leaves)."""
    D, H, G, K, F_, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    S = torch.Size
    layer = {
        "attn_norm": S((D,)),
        "attn": {"wq": S((D, H, K)), "wk": S((D, G, K)), "wv": S((D, G, K)), "wo": S((H, K, D))},
        "mlp_norm": S((D,)),
        "mlp": {"w1": S((D, F_)), "w3": S((D, F_)), "w2": S((F_, D))},
    }
    shapes = {"embed": S((V, D)), "layers": [copy.deepcopy(layer) for _ in range(cfg.n_layers)], "norm": S((D,))}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = S((D, V))
    return shapes


def abstract_params(cfg: LlamaConfig, shardings=None, dtype: torch.dtype = torch.float32) -> dict:
    """The parameters as `nf.ShapeDtypeStruct` stand-ins, each laid out by `shardings` (a tree of
    NamedShardings like `init`'s, or None): what `nf.jit(...).lower` plans a step over on any
    mesh, with nothing allocated.

    Example:
        >>> params = abstract_params(LlamaConfig.llama3_70b())
        >>> params['layers'][0]['mlp']['w1']
        ShapeDtypeStruct(shape=(8192, 28672), dtype=float32)
    """
    shapes = param_shapes(cfg)
    is_shape = lambda x: isinstance(x, torch.Size)  # noqa: E731
    if shardings is None:
        return optree.tree_map(lambda s: nf.ShapeDtypeStruct(s, dtype), shapes, is_leaf=is_shape)
    return optree.tree_map(lambda s, sharding: nf.ShapeDtypeStruct(s, dtype, sharding=sharding), shapes, shardings,
                           is_leaf=is_shape)


def param_axes(cfg: LlamaConfig) -> dict:
    """Logical names of every parameter's dims, a tree like `init`'s (for `logical_to_mesh`)."""
    layer = {
        "attn_norm": ("embed",),
        "attn": {
            "wq": ("embed", "heads", "head_dim"),
            "wk": ("embed", "kv_heads", "head_dim"),
            "wv": ("embed", "kv_heads", "head_dim"),
            "wo": ("heads", "head_dim", "embed"),
        },
        "mlp_norm": ("embed",),
        "mlp": {"w1": ("embed", "mlp"), "w3": ("embed", "mlp"), "w2": ("mlp", "embed")},
    }
    axes = {"embed": ("vocab", "embed"), "layers": [copy.deepcopy(layer) for _ in range(cfg.n_layers)], "norm": ("embed",)}
    if not cfg.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


# Hugging Face's initializer_range: every matrix ~ N(0, 0.02^2), norm scales 1.
INIT_STD = 0.02


def init_param(cfg: LlamaConfig, key: torch.Tensor, path: str, shape: tuple[int, ...], index=None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One parameter, or only its block `index` (a tuple of slices): the values at a position
    depend only on (key, path, position), so any sharding of the init gives the same tensor."""
    block = shape if index is None else tuple(s.stop - s.start for s in index)
    if path.endswith("norm"):
        return torch.ones(block, dtype=dtype, device=key.device)
    param_key = random.fold_in(key, _path_id(path))
    return random.normal(param_key, shape, dtype, index=index) * INIT_STD


def init(cfg: LlamaConfig, key: torch.Tensor, dtype: torch.dtype = torch.float32) -> dict:
    """All parameters, whole. `key` is an `ndfunc.random.key`."""
    from ndfunc.tree import tree_map_with_path

    return tree_map_with_path(lambda path, shape: init_param(cfg, key, path, tuple(shape), dtype=dtype),
                              param_shapes(cfg))


def rms_norm(x_BLD: torch.Tensor, scale_D: torch.Tensor, eps: float) -> torch.Tensor:
    x = x_BLD.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return scale_D * x.to(x_BLD.dtype)


def rope_tables(positions_BL: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (B, L, K), in float32, from each token's own position."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions_BL.device) / head_dim)
    angles = positions_BL.float()[..., None] * inv_freq  # (B, L, K/2)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout: (B, L, K)
    return angles.cos(), angles.sin()


def apply_rope(x_BLHK: torch.Tensor, cos_BLK: torch.Tensor, sin_BLK: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BLHK.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos_BLK[:, :, None, :], sin_BLK[:, :, None, :]
    return (x_BLHK.float() * cos + rotated.float() * sin).to(x_BLHK.dtype)


def attention(layer: dict, x_BLD: torch.Tensor, cos, sin, cfg: LlamaConfig, mask_BLL=None) -> torch.Tensor:
    q_BLHK = torch.einsum("bld,dhk->blhk", x_BLD, layer["wq"])
    k_BLGK = torch.einsum("bld,dgk->blgk", x_BLD, layer["wk"])
    v_BLGK = torch.einsum("bld,dgk->blgk", x_BLD, layer["wv"])
    q_BLHK, k_BLGK = apply_rope(q_BLHK, cos, sin), apply_rope(k_BLGK, cos, sin)
    # key/value head g serves query heads g*R .. g*R + R-1 (R = H // G): attention reads the G
    # heads as they are (`enable_gqa`), so a ring passes, and remat keeps, G heads, not H copies
    k_BGLK = einops.rearrange(k_BLGK, "b l g k -> b g l k")
    v_BGLK = einops.rearrange(v_BLGK, "b l g k -> b g l k")
    q_BHLK = einops.rearrange(q_BLHK, "b l h k -> b h l k")
    gqa = cfg.n_heads != cfg.n_kv_heads
    if mask_BLL is None:
        o_BHLK = F.scaled_dot_product_attention(q_BHLK, k_BGLK, v_BGLK, is_causal=True, enable_gqa=gqa)
    else:
        o_BHLK = F.scaled_dot_product_attention(q_BHLK, k_BGLK, v_BGLK, attn_mask=mask_BLL[:, None], enable_gqa=gqa)
    return torch.einsum("bhlk,hkd->bld", o_BHLK, layer["wo"])


def mlp(layer: dict, x_BLD: torch.Tensor) -> torch.Tensor:
    gate_BLF = F.silu(x_BLD @ layer["w1"])
    return (gate_BLF * (x_BLD @ layer["w3"])) @ layer["w2"]


# the same program every layer: nf.jit traces it once and copies it (torch.compile compiles it once)
@torch.compiler.nested_compile_region
def decoder_layer(layer: dict, x_BLD: torch.Tensor, cos, sin, cfg: LlamaConfig, mask_BLL=None) -> torch.Tensor:
    x_BLD = x_BLD + attention(layer["attn"], rms_norm(x_BLD, layer["attn_norm"], cfg.norm_eps), cos, sin, cfg, mask_BLL)
    return x_BLD + mlp(layer["mlp"], rms_norm(x_BLD, layer["mlp_norm"], cfg.norm_eps))


def _residual(x_BLD: torch.Tensor) -> torch.Tensor:
    """The residual stream between layers: batch and sequence split as the axis rules say, the
    model dim whole (as FSDP and Megatron keep it). A no-op without `nf.sharding.axis_rules`."""
    return nf.with_logical_constraint(x_BLD, ("batch", "seq", None))


def apply(params: dict, tokens_BL: torch.Tensor, cfg: LlamaConfig, positions_BL: torch.Tensor | None = None,
          documents_BL: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, L, V) for tokens (B, L).

    `positions` (B, L) default to 0..L-1 for every row. Given, they place each token: rotary
    embeddings and the causal mask (a token sees those at its position or before) both follow them,
    so a permuted sequence gives the same logits, permuted. `documents` (B, L) packs several
    documents in a row: a token sees only tokens of its own document (its id), at its position or
    before; each document's positions restart at 0, so it reads as it would alone.
    """
    mask_BLL = None
    if positions_BL is None:
        if documents_BL is not None:
            raise ValueError("llama.apply: documents need positions (each document's tokens counted from 0).")
        positions_BL = torch.arange(tokens_BL.shape[1], device=tokens_BL.device).expand(tokens_BL.shape)
    else:
        mask_BLL = attention_mask(positions_BL, documents_BL)
    cos, sin = rope_tables(positions_BL, cfg.head_dim, cfg.rope_theta)
    x_BLD = _residual(F.embedding(tokens_BL, params["embed"]))
    block = nf.remat(decoder_layer, cfg.remat) if cfg.remat else decoder_layer
    for layer in params["layers"]:
        x_BLD = _residual(block(layer, x_BLD, cos, sin, cfg, mask_BLL))
    x_BLD = rms_norm(x_BLD, params["norm"], cfg.norm_eps)
    head_DV = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return x_BLD @ head_DV


def attention_mask(positions_BL: torch.Tensor, documents_BL: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query sees, (B, L, L) boolean: those at its position or before, and with
    `documents_BL` (packed documents' ids) only those of its own document."""
    mask_BLL = positions_BL[:, :, None] >= positions_BL[:, None, :]
    if documents_BL is not None:
        mask_BLL = mask_BLL & (documents_BL[:, :, None] == documents_BL[:, None, :])
    return mask_BLL


def token_losses(params: dict, batch: dict, cfg: LlamaConfig) -> torch.Tensor:
    """Each token's next-token cross-entropy (B, L), 0 where its target is -100 (`batch` as `loss`'s)."""
    return _cross_entropy(params, batch, cfg, "none").view(batch["targets"].shape)


def loss(params: dict, batch: dict, cfg: LlamaConfig) -> torch.Tensor:
    """Next-token cross-entropy, mean over targets that are not -100 (`batch`: tokens, targets (B, L)
    int64, optional positions and documents, as `apply` takes them). A batch whose every target is
    -100 has no mean: NaN, as in torch."""
    return _cross_entropy(params, batch, cfg, "mean")


def _cross_entropy(params: dict, batch: dict, cfg: LlamaConfig, reduction: str) -> torch.Tensor:
    logits_BLV = apply(params, batch["tokens"], cfg, batch.get("positions"), batch.get("documents"))
    return F.cross_entropy(logits_BLV.flatten(0, 1).float(), batch["targets"].flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def _path_id(path: str) -> int:
    """A stable 31-bit number for a parameter path (a fold_in datum that does not depend on the
    tree's order or on Python's hash seed)."""
    import zlib

    return zlib.crc32(path.encode()) & 0x7FFFFFFF
