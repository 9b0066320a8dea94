"""Peak memory of one rank: training state, gathered FSDP units, activations, logits, allowance.

Every term is a closed form of the shape, the layout and the options; `Memory` keeps them apart so
a table can say which one a layout runs out on.
"""

from __future__ import annotations

import dataclasses

from ndfunc._src.planner.cluster import GiB
from ndfunc._src.planner.layout import Layout, Options
from ndfunc._src.planner.model import BF16, TransformerShape

# fp32 master weights (4) + fp32 gradients (4: FSDP2 keeps sharded gradients in the fp32 reduce
# dtype) + Adam's two fp32 moments (8) = 16 bytes per parameter, the mixed-precision figure of
# ZeRO (Rajbhandari et al. 2020, sec. 3.1, "16 Psi").
STATE_BYTES_PER_PARAM = 16
# Logits per token per vocabulary entry: the bf16 output projection, its fp32 copy for the loss,
# and the fp32 gradient the loss's backward writes, all alive as backward starts.
LOGIT_BYTES = BF16 + 4 + 4
# CUDA context, NCCL's buffers, cuBLAS workspaces and allocator fragmentation: a fixed allowance,
# not a model (published runs report 1-4 GiB of such overhead outside PyTorch's allocator stats).
OVERHEAD_BYTES = 3 * GiB


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one rank holds at its peak, term by term.

    - `params`, `grads`, `optimizer`: `num_params * (4 + 4 + 8) / (fsdp_size * tp)` (replicated
      over `dp_replicate`); a mixture of experts' MLP blocks over `fsdp_size` alone, whole over tp
      (`TransformerShape.local_params`).
    - `gathered`: FSDP's bf16 full layers: `(2 if prefetch else 1) * unit * 2 B / tp`, unit the
      larger of one layer and the embedding, plus one layer's unsharded bf16 gradient and its fp32
      copy for the reduce-scatter (6 B per parameter); without reshard-after-forward every layer
      stays gathered from forward to backward (`n_layers * layer * 2 B / tp`). 0 without FSDP. A
      mixture's layer is gathered with every expert, whole over tp (`local_layer_params`).
    - `activations`: `micro_batch * seq_len / cp` tokens x `n_layers` x
      `TransformerShape.activation_bytes_per_token(remat) / tp`; under full remat plus one layer
      rebuilt at a time (`none` bytes); a mixture's experts plus what one layer of them holds
      while they run (`moe_rebuilt_bytes_per_token`, its tokens split over tp too).
    - `logits`: `micro_batch * seq_len / cp * vocab / tp * 10 B` (loss-parallel output under TP).
    - `overhead`: the fixed allowance.
    """

    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    logits: float
    overhead: float

    @property
    def total(self) -> float:
        return sum(dataclasses.astuple(self))

    def __str__(self) -> str:
        parts = ", ".join(f"{f.name} {getattr(self, f.name) / GiB:.1f}" for f in dataclasses.fields(self))
        return f"{self.total / GiB:.1f} GiB ({parts})"


def memory_per_rank(model: TransformerShape, layout: Layout, options: Options, seq_len: int) -> Memory:
    """The peak bytes of one rank (see `Memory` for each formula).

    Example:
        >>> m = TransformerShape.named("llama3-8b")
        >>> mem = memory_per_rank(m, Layout(dp_shard=8), Options("full", micro_batch=1), 8192)
        >>> mem.params + mem.grads + mem.optimizer == 16 * m.num_params / 8
        True
    """
    p = model.local_params(layout.tp) / layout.fsdp_size
    gathered = 0.0
    if layout.fsdp_size > 1:
        layer = model.local_layer_params(layout.tp)
        unit = max(layer, model.embedding_params / layout.tp)
        gathered = (2 if options.prefetch else 1) * unit * options.compute_bytes + layer * (options.compute_bytes + 4)
        if not options.reshard_after_forward:
            gathered += model.n_layers * layer * options.compute_bytes
    tokens = options.micro_batch * seq_len / layout.cp
    per_layer = model.activation_bytes_per_token(options.remat, options.compute_bytes)
    activations = tokens * model.n_layers * per_layer / layout.tp
    if options.remat == "full":
        activations += tokens * model.activation_bytes_per_token("none", options.compute_bytes) / layout.tp
    activations += tokens * model.moe_rebuilt_bytes_per_token(options.compute_bytes) / layout.tp
    logits = tokens * model.vocab_size / layout.tp * LOGIT_BYTES
    return Memory(
        params=4 * p, grads=4 * p, optimizer=(STATE_BYTES_PER_PARAM - 8) * p, gathered=gathered,
        activations=activations, logits=logits, overhead=float(OVERHEAD_BYTES),
    )
