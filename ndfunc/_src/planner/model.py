"""The shape of a Llama-style decoder, and the counts the planner derives from it alone.

Parameters, flops per token and activation bytes per token are closed forms of the shape; the
layout divides them later (`memory.py`, `estimate.py`). Nothing here knows about ranks.
"""

from __future__ import annotations

import dataclasses

REMAT_POLICIES = ("none", "selective", "full")
BF16 = 2  # bytes per activation element: activations are bf16 under mixed precision


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A Llama decoder: embedding, `n_layers` x (GQA attention + SwiGLU MLP, RMSNorm before each),
    final RMSNorm, output projection (tied to the embedding when `tie_embeddings`).

    Example:
        >>> s = TransformerShape.named("llama3-8b")
        >>> s.head_dim, f"{s.num_params / 1e9:.2f}e9"
        (128, '8.03e9')
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    tie_embeddings: bool = False
    name: str = "custom"
    # None: dim // n_heads, filled in when the shape is made (so `dataclasses.replace` of dim or
    # n_heads keeps it: pass head_dim=None again); Qwen3's and Gemma's configs set their own
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerShape.{field} must be an int >= 1, got {value!r}.")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"TransformerShape.tie_embeddings must be True or False, got {self.tie_embeddings!r}.")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"TransformerShape: dim {self.dim} must be a multiple of n_heads {self.n_heads}, "
                                 f"or head_dim given.")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        elif isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"TransformerShape.head_dim must be an int >= 1 or None, got {self.head_dim!r}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"TransformerShape: n_heads {self.n_heads} must be a multiple of n_kv_heads "
                             f"{self.n_kv_heads}.")

    @classmethod
    def named(cls, name: str) -> TransformerShape:
        """A built-in shape (`model_names()`): Meta's published Llama 3.1 configurations."""
        if name.lower() not in _MODELS:
            raise ValueError(f"unknown model {name!r}: expected one of {', '.join(model_names())}.")
        return _MODELS[name.lower()]

    @classmethod
    def from_config(cls, cfg: object, name: str = "custom") -> TransformerShape:
        """The shape of any config with `vocab_size, dim, n_layers, n_heads, n_kv_heads, ffn_dim`
        (and optionally `tie_embeddings`, `head_dim`), e.g. `models.llama.LlamaConfig`, or with
        Hugging Face's names for them (`hidden_size, num_hidden_layers, num_attention_heads,
        intermediate_size`, and optionally `num_key_value_heads` (as many as query heads where
        absent, as transformers reads it), `tie_word_embeddings`, `head_dim`: a transformers
        `LlamaConfig`, Mistral's, Qwen2's and Qwen3's), read by attribute or, for a parsed
        config.json, by key, so the planner never imports a model. A mixture of experts is refused:
        this shape is a dense decoder, and would count one expert of many."""
        get = cfg.get if isinstance(cfg, dict) else lambda key, default=None: getattr(cfg, key, default)
        what = "the config" if isinstance(cfg, dict) else type(cfg).__name__
        hf = get("hidden_size") is not None
        fields = _HF_NAMES if hf else _OUR_NAMES
        missing = [f for f in fields if get(f) is None and f not in _OPTIONAL]
        if missing:
            raise TypeError(f"{what} lacks {missing}; a TransformerShape needs {[*_OUR_NAMES[:6]]}, or Hugging "
                            f"Face's {[f for f in _HF_NAMES if f not in _OPTIONAL]}.")
        experts = {key: get(key) for key in _EXPERT_KEYS if isinstance(get(key), int) and get(key) > 1}
        if experts:
            counts = ", ".join(f"{k}={v}" for k, v in experts.items())
            raise ValueError(f"{what} describes a mixture of experts ({counts}); "
                             f"TransformerShape models dense Llama-style decoders and would count one expert of many. "
                             f"Plan this model from its own step instead: ndfunc.plan.plan_step.")
        values = [get(f) for f in fields]
        if values[4] is None:  # no key/value heads of their own (multi-head attention)
            values[4] = values[3]
        tie = values[6]
        return cls(*values[:6], False if tie is None else tie, name, values[7])

    @property
    def q_dim(self) -> int:
        """Width of the query projection (and of attention's output): `n_heads * head_dim`."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection: `n_kv_heads * head_dim`."""
        return self.n_kv_heads * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def output_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab_size * self.dim

    @property
    def layer_linear_params(self) -> int:
        """One layer's matmul weights: wq, wo (dim x q_dim), wk, wv (dim x kv_dim), w1, w2, w3."""
        return 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim + 3 * self.dim * self.ffn_dim

    @property
    def layer_params(self) -> int:
        return self.layer_linear_params + 2 * self.dim  # + the two RMSNorm weights

    @property
    def num_params(self) -> int:
        """Every parameter: llama3-8b 8.03e9, llama3-70b 70.6e9, as Meta publishes them."""
        return self.embedding_params + self.output_params + self.n_layers * self.layer_params + self.dim

    def model_flops_per_token(self, seq_len: int) -> float:
        """Flops per trained token by the convention MFU figures use (torchtitan's
        `get_num_flop_per_token`): `6 * (num_params - embedding) + 12 * L * n_heads * head_dim * S`.

        6 = 2 (multiply-add) x 3 (forward, two backward matmuls) per weight; the embedding is a
        lookup, not a matmul, so it is left out (an untied output projection counts). Attention:
        QK^T and PV, 2 flops per multiply-add, x3 for backward, over the whole sequence: causal
        masking is *not* discounted and recomputation is *not* counted, so this is the work the
        model needs, not what the kernels execute (`executed_flops_per_token`).
        """
        return 6 * (self.num_params - self.embedding_params) + 12 * self.n_layers * self.q_dim * seq_len

    def executed_flops_per_token(self, seq_len: int, remat: str) -> tuple[float, float, float]:
        """(layer matmuls, output projection, attention) flops the kernels run per token.

        Matmuls: `2 * params * (3 + r)`, `r = 1` when a full remat recomputes each layer's forward
        (the output projection is outside the layers and never recomputed). Attention: a causal
        flash kernel skips the masked half, so `2 * 2 * L * q_dim * S / 2` forward, times `3 + r`.
        `selective` keeps every matmul and attention output, so it recomputes no matmul.
        """
        check_remat(remat)
        r = 1 if remat == "full" else 0
        layers = 2 * self.n_layers * self.layer_linear_params * (3 + r)
        output = 2 * self.vocab_size * self.dim * 3
        attention = 2 * self.n_layers * self.q_dim * seq_len * (3 + r)
        return float(layers), float(output), float(attention)

    def activation_bytes_per_token(self, remat: str, element_bytes: int = BF16) -> float:
        """Bytes one layer keeps per token for backward, unsharded (bf16 unless `element_bytes`
        says otherwise; flash attention).

        Counted the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
        Transformer Models", sec. 4) count GPT's `34 * h` bytes, for a Llama layer (D = dim,
        Q = q_dim, K = kv_dim, F = ffn_dim; Q = D unless `head_dim` says otherwise); flash
        attention keeps no S x S scores, so their `5as/h` term is gone:
          - none: norm inputs and outputs 4 * 2D, q 2Q, k and v 2 * 2K, attention output 2Q;
            SwiGLU's w1 output, its silu, w3 output and their product 4 * 2F:
            `8 D + 4 Q + 4 K + 8 F`.
          - selective (JAX's `save_dots`: keep matmul and attention outputs, recompute norms,
            rotary and silu): layer input 2D, q/k/v 2Q + 4K, attention output 2Q, wo output 2D,
            w1 and w3 outputs 4F: `4 D + 4 Q + 4 K + 4 F`.
          - full: the layer input, 2D (the rest is rebuilt one layer at a time in backward:
            `memory.py` adds one layer's `none` bytes for that).
        Tensor parallelism with sequence parallelism divides every term by tp (Korthikanti
        sec. 4.2.2); context parallelism divides the tokens.
        """
        check_remat(remat)
        d, q, k, f = self.dim, self.q_dim, self.kv_dim, self.ffn_dim
        elements = {"none": 4 * d + 2 * q + 2 * k + 4 * f, "selective": 2 * d + 2 * q + 2 * k + 2 * f, "full": d}[remat]
        return float(element_bytes * elements)


_OUR_NAMES = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "head_dim")
_HF_NAMES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "tie_word_embeddings", "head_dim")
_OPTIONAL = frozenset({"num_key_value_heads", "tie_embeddings", "tie_word_embeddings", "head_dim"})
# the keys transformers' mixture-of-experts configs give their experts per layer (Mixtral, Qwen-MoE,
# DeepSeek, Llama 4, OLMoE)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def check_remat(remat: str) -> None:
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}: expected one of {', '.join(REMAT_POLICIES)}.")


def model_names() -> tuple[str, ...]:
    """The built-in model shapes `TransformerShape.named` knows."""
    return tuple(_MODELS)


# Meta's Llama 3.1 model cards / the reference `params.json` of each size.
_MODELS = {
    "llama3-8b": TransformerShape(128256, 4096, 32, 32, 8, 14336, name="llama3-8b"),
    "llama3-70b": TransformerShape(128256, 8192, 80, 64, 8, 28672, name="llama3-70b"),
    "llama3-405b": TransformerShape(128256, 16384, 126, 128, 8, 53248, name="llama3-405b"),
}
