"""The shape of a Llama-style decoder (dense, or a mixture of experts), and the counts the planner
derives from it alone.

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

    A mixture of experts (`n_experts` > 0: Mixtral, Qwen2/3-MoE, OLMoE) has in every layer, in
    place of the MLP, a router (`dim x n_experts`) sending each token to `experts_per_token` of
    `n_experts` SwiGLU experts of width `ffn_dim`, and where `shared_ffn_dim` > 0 one SwiGLU MLP of
    that width every token takes, scaled by a sigmoid gate (`dim` weights: Qwen2-MoE's). ndfunc runs
    the experts as one op on each rank's own tokens (`ndfunc._src.experts`), so the layout prices
    the MLP block as ndfunc runs it: whole over `tp` (its tokens split there, its gradients summed
    over it), gathered whole by FSDP, its experts' forward made again for their backward.

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
    n_experts: int = 0  # experts per layer; 0: a dense MLP of width ffn_dim
    experts_per_token: int = 0  # of them each token is routed to (top-k)
    shared_ffn_dim: int = 0  # width of an MLP every token takes beside its experts (0: none)

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
        for field in ("n_experts", "experts_per_token", "shared_ffn_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TransformerShape.{field} must be an int >= 0, got {value!r}.")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"TransformerShape: experts_per_token must be 1 to n_experts ({self.n_experts}), got "
                             f"{self.experts_per_token}.")
        if not self.n_experts and (self.experts_per_token or self.shared_ffn_dim):
            raise ValueError(f"TransformerShape: experts_per_token ({self.experts_per_token}) and shared_ffn_dim "
                             f"({self.shared_ffn_dim}) describe a mixture of experts; give n_experts too.")
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
        config.json, by key, so the planner never imports a model.

        A mixture of experts: `n_experts, experts_per_token, shared_ffn_dim` (ours), or Hugging
        Face's Mixtral (`num_local_experts`, `num_experts_per_tok`, each expert `intermediate_size`
        wide), Qwen2-MoE and Qwen3-MoE (`num_experts`, `moe_intermediate_size`, Qwen2-MoE's
        `shared_expert_intermediate_size`) and OLMoE (`num_experts`). One whose layers differ (a
        dense MLP in some: `mlp_only_layers`, `decoder_sparse_step`) or whose attention is not this
        shape's (DeepSeek's latent attention: `n_routed_experts`) is refused with what to use."""
        get = cfg.get if isinstance(cfg, dict) else lambda key, default=None: getattr(cfg, key, default)
        what = "the config" if isinstance(cfg, dict) else type(cfg).__name__
        hf = get("hidden_size") is not None
        fields = _HF_NAMES if hf else _OUR_NAMES
        missing = [f for f in fields if get(f) is None and f not in _OPTIONAL]
        if missing:
            raise TypeError(f"{what} lacks {missing}; a TransformerShape needs {[*_OUR_NAMES[:6]]}, or Hugging "
                            f"Face's {[f for f in _HF_NAMES if f not in _OPTIONAL]}.")
        values = [get(f) for f in fields]
        if values[4] is None:  # no key/value heads of their own (multi-head attention)
            values[4] = values[3]
        tie = values[6]
        moe = _experts_of(get, what) if hf else {k: get(k) for k in _OUR_EXPERT_NAMES if get(k) is not None}
        if hf and moe:
            values[5] = moe.pop("ffn_dim")  # each expert's width
        return cls(*values[:6], False if tie is None else tie, name, values[7], **moe)

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
    def layer_attention_params(self) -> int:
        """One layer's attention weights: wq, wo (dim x q_dim), wk, wv (dim x kv_dim)."""
        return 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim

    @property
    def layer_mlp_params(self) -> int:
        """One layer's MLP weights: w1, w2, w3 (dim x ffn_dim); of a mixture of experts, every
        expert's, the router's (dim x n_experts) and a shared MLP's with its gate (3 dim x
        shared_ffn_dim + dim)."""
        mlp = 3 * self.dim * self.ffn_dim
        if not self.n_experts:
            return mlp
        shared = 3 * self.dim * self.shared_ffn_dim + self.dim if self.shared_ffn_dim else 0
        return self.n_experts * mlp + self.dim * self.n_experts + shared

    @property
    def layer_linear_params(self) -> int:
        """One layer's matmul weights: attention's and the MLP's."""
        return self.layer_attention_params + self.layer_mlp_params

    @property
    def layer_params(self) -> int:
        return self.layer_linear_params + 2 * self.dim  # + the two RMSNorm weights

    @property
    def num_params(self) -> int:
        """Every parameter: llama3-8b 8.03e9, llama3-70b 70.6e9, as Meta publishes them; Mixtral
        8x7B 46.7e9, as Mistral does."""
        return self.embedding_params + self.output_params + self.n_layers * self.layer_params + self.dim

    @property
    def layer_inactive_params(self) -> int:
        """One layer's expert weights a token does not take: `(n_experts - experts_per_token) x 3
        dim x ffn_dim` (0 for a dense MLP)."""
        return (self.n_experts - self.experts_per_token) * 3 * self.dim * self.ffn_dim

    @property
    def active_params(self) -> int:
        """The parameters one token's forward reads: every one but the experts it is not routed to
        (Mixtral 8x7B: 12.9e9 of 46.7e9, as Mistral publishes it)."""
        return self.num_params - self.n_layers * self.layer_inactive_params

    @property
    def layer_whole_over_tp_params(self) -> int:
        """One layer's weights `tp` does not split: a mixture's MLP block (its router, experts and
        shared MLP), which ndfunc runs on each rank's own tokens, its weights whole; 0 for a dense
        MLP, which Megatron splits."""
        return self.layer_mlp_params if self.n_experts else 0

    def local_params(self, tp: int) -> float:
        """The parameters of one rank of a `tp` group before FSDP: all but the MLP blocks of a
        mixture of experts split `tp` ways, those whole."""
        whole = self.n_layers * self.layer_whole_over_tp_params
        return (self.num_params - whole) / tp + whole

    def local_layer_params(self, tp: int) -> float:
        """`local_params` of one layer: what FSDP gathers for it on a rank of a `tp` group."""
        whole = self.layer_whole_over_tp_params
        return (self.layer_params - whole) / tp + whole

    def model_flops_per_token(self, seq_len: int) -> float:
        """Flops per trained token by the convention MFU figures use (torchtitan's
        `get_num_flop_per_token`): `6 * (active_params - embedding) + 12 * L * n_heads * head_dim * S`.

        6 = 2 (multiply-add) x 3 (forward, two backward matmuls) per weight a token reads (every
        one of a dense model; of a mixture, its `experts_per_token` experts, as torchtitan counts
        a mixture's active parameters); the embedding is a lookup, not a matmul, so it is left out
        (an untied output projection counts). Attention: QK^T and PV, 2 flops per multiply-add, x3
        for backward, over the whole sequence: causal masking is *not* discounted and
        recomputation is *not* counted, so this is the work the model needs, not what the kernels
        execute (`executed_flops_per_token`).
        """
        return 6 * (self.active_params - self.embedding_params) + 12 * self.n_layers * self.q_dim * seq_len

    def executed_flops_per_token(self, seq_len: int, remat: str) -> tuple[float, float, float, float]:
        """(layer matmuls, experts' matmuls, output projection, attention) flops the kernels run per
        token.

        Matmuls: `2 * params * 3`, and once more each that a full remat recomputes: a layer's
        forward up to what its backward reads, so not a dense MLP's output projection (w2: its
        result only joins the residual stream, whose sum backward does not read; as torch's
        checkpoint stops early). The output projection is outside the layers and never recomputed.
        The experts a token takes (`experts_per_token x 3 dim x ffn_dim`): `2 * params * 4`, their
        forward made once more inside their backward (`ndfunc::experts_backward`), which a remat
        then need not make again. Attention: a causal flash kernel skips the masked half, so
        `2 * 2 * L * q_dim * S / 2` forward, times `3 + r` (`r = 1` under a full remat).
        `selective` keeps every matmul and attention output, so it recomputes no matmul.
        """
        check_remat(remat)
        r = 1 if remat == "full" else 0
        experts = self.experts_per_token * 3 * self.dim * self.ffn_dim if self.n_experts else 0
        active = self.layer_linear_params - self.layer_inactive_params - experts
        unread = 0 if self.n_experts else self.dim * self.ffn_dim  # (a mixture's shared MLP is gated: read)
        layers = 2 * self.n_layers * (active * 3 + (active - unread) * r)
        output = 2 * self.vocab_size * self.dim * 3
        attention = 2 * self.n_layers * self.q_dim * seq_len * (3 + r)
        return float(layers), float(2 * self.n_layers * experts * 4), float(output), float(attention)

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
        A mixture of experts (E experts, k a token, a shared MLP of width Fs) keeps in place of
        the MLP's: none, the router's fp32 probabilities 4E, the chosen experts' int64 indices and
        fp32 weights 12k, and the shared MLP's as a dense one's plus its gate, 8 Fs + 2; selective,
        the router's logits 2E and the shared MLP's w1 and w3 outputs 4 Fs. The experts keep
        nothing of their own: their forward is made again inside their backward
        (`moe_rebuilt_bytes_per_token`, one layer at a time).
        Tensor parallelism with sequence parallelism divides every term by tp (Korthikanti
        sec. 4.2.2; a mixture's MLP block runs on each rank's own tokens there); context
        parallelism divides the tokens.
        """
        check_remat(remat)
        d, q, k, f = self.dim, self.q_dim, self.kv_dim, self.ffn_dim
        if self.n_experts:
            e, top, fs = self.n_experts, self.experts_per_token, self.shared_ffn_dim
            mlp = {"none": (4 * e + 12 * top) / element_bytes + 4 * fs + (1 if fs else 0),
                   "selective": e + 2 * fs, "full": 0}[remat]
        else:
            mlp = {"none": 4 * f, "selective": 2 * f, "full": 0}[remat]
        elements = {"none": 4 * d + 2 * q + 2 * k, "selective": 2 * d + 2 * q + 2 * k, "full": d}[remat] + mlp
        return float(element_bytes * elements)

    def moe_rebuilt_bytes_per_token(self, element_bytes: int = BF16) -> float:
        """What one layer's experts hold per token while they run (in forward, and again in their
        backward, which makes their forward again), one layer at a time: for each of the k experts
        a token takes, its copy of the token and of its output (2D) and SwiGLU's w1 and w3 outputs,
        silu and product (4F). 0 for a dense model."""
        if not self.n_experts:
            return 0.0
        return float(element_bytes * self.experts_per_token * (2 * self.dim + 4 * self.ffn_dim))


_OUR_NAMES = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "head_dim")
_HF_NAMES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "tie_word_embeddings", "head_dim")
_OPTIONAL = frozenset({"num_key_value_heads", "tie_embeddings", "tie_word_embeddings", "head_dim"})
_OUR_EXPERT_NAMES = ("n_experts", "experts_per_token", "shared_ffn_dim")
# what a transformers mixture of experts calls its experts per layer: Mixtral (and gpt-oss, PhiMoE),
# Qwen2/3-MoE and OLMoE (and Llama 4), DeepSeek-V2/V3
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_EXPERT_MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # `model_type`s read as a TransformerShape


def _experts_of(get, what: str) -> dict:
    """`TransformerShape`'s expert fields (and each expert's width, `ffn_dim`) from a transformers
    config (`get(key)`), {} for a dense one; a ValueError naming what is not this shape."""
    counts = {key: get(key) for key in _EXPERT_KEYS if isinstance(get(key), int) and get(key) > 1}
    if not counts:
        return {}
    named = ", ".join(f"{k}={v}" for k, v in counts.items())
    instead = "Plan this model from its own step instead: ndfunc.plan.plan_step."
    if "n_routed_experts" in counts:
        raise ValueError(f"{what} describes DeepSeek's mixture of experts ({named}), whose latent attention "
                         f"and dense first layers are not a TransformerShape's. {instead}")
    kind = get("model_type")
    if kind is not None and kind not in _EXPERT_MODELS:
        raise ValueError(f"{what} describes a {kind} mixture of experts ({named}); the closed forms know "
                         f"{', '.join(_EXPERT_MODELS)}, whose layers are a TransformerShape's. {instead}")
    sparse_step, dense_layers = get("decoder_sparse_step"), get("mlp_only_layers")
    if (sparse_step not in (None, 1)) or dense_layers:
        raise ValueError(f"{what} describes a mixture of experts whose layers differ (decoder_sparse_step="
                         f"{sparse_step}, mlp_only_layers={dense_layers}: some take a dense MLP); a "
                         f"TransformerShape's layers are all alike. {instead}")
    top_k = get("num_experts_per_tok")
    if not isinstance(top_k, int):
        raise ValueError(f"{what} describes a mixture of experts ({named}) without num_experts_per_tok, the "
                         f"experts each token takes. {instead}")
    return {"n_experts": next(iter(counts.values())), "experts_per_token": top_k,
            "shared_ffn_dim": get("shared_expert_intermediate_size") or 0,
            "ffn_dim": get("moe_intermediate_size") or get("intermediate_size")}


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
