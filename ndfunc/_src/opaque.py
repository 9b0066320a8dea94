"""Opaque ops: a call ndfunc runs whole on each rank's block, split along one dim of each tensor.

A recurrent layer, a CTC loss and a mixture of experts' experts share one shape. Traced op by op,
each is many small ops, or ops whose shapes come from values, which no layout splits. ndfunc traces
each as one op and its backward. At run time the op calls torch's own kernel on each rank's
samples or tokens, and the backward makes the forward again inside (nothing crosses between the
two but the inputs). Every tensor is split along its own dim, or left whole (a weight, whose
gradient is then each rank's sum over its own part, pending).

`opaque_op` defines such a pair in one place, as JAX keeps a primitive's rules beside it:

- the two schemas, their kernels and their shapes (`register_fake`);
- which dim of each tensor splits (`dims`);
- the flops.

The partitioner reads `OPS` for the rule and the flop count (`planning/ops.py`).
`recomputed_gradients` is the backward they share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class OpaqueOp:
    """An opaque op and its backward, with what the partitioner reads of them.

    `dims(node)` gives, for a node of either op, the dim each tensor output and then each tensor
    input splits along (None: a weight, whole; its gradient, an output, each rank's pending sum).
    `flops(node)` gives its work."""

    forward: torch._ops.OpOverload
    backward: torch._ops.OpOverload
    dims: Callable[[torch.fx.Node], tuple[list, list]]
    flops: Callable[[torch.fx.Node], int]


OPS: list[OpaqueOp] = []

_LIB = torch.library.Library("ndfunc", "FRAGMENT")  # (kept alive: dropping it undefines the ops)


def opaque_op(name: str, schema: str, backward_schema: str, *,
              run: Callable, run_backward: Callable, fake: Callable, fake_backward: Callable,
              dims: Callable, flops: Callable) -> OpaqueOp:
    """Define `ndfunc::<name>` (`schema`: its arguments and results) and `ndfunc::<name>_backward`,
    made by `run` and `run_backward` at run time and shaped by `fake` and `fake_backward` in a
    trace, split as `dims` says; listed in `OPS` for the partitioner."""
    for op_name, op_schema, kernel, shapes in ((name, schema, run, fake),
                                               (f"{name}_backward", backward_schema, run_backward, fake_backward)):
        _LIB.define(op_name + op_schema)
        _LIB.impl(op_name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"ndfunc::{op_name}", shapes, lib=_LIB)
    made = OpaqueOp(getattr(torch.ops.ndfunc, name).default, getattr(torch.ops.ndfunc, f"{name}_backward").default,
                    dims, flops)
    OPS.append(made)
    return made


def recomputed_gradients(forward: Callable[[list[torch.Tensor]], torch.Tensor | Sequence[torch.Tensor]],
                         tensors: Sequence[torch.Tensor], grads, wanted: Sequence[bool] | None = None
                         ) -> list[torch.Tensor]:
    """The gradients of `forward(tensors)`'s results (given `grads` of them) to those of `tensors`
    `wanted` says (all by default): the forward made again under autograd. An input the results do
    not read gets zeros."""
    wanted = [True] * len(tensors) if wanted is None else list(wanted)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(w) for t, w in zip(tensors, wanted)]
        made = forward(leaves)
        asked = [x for x, w in zip(leaves, wanted) if w]
        found = torch.autograd.grad(made, asked, grads, allow_unused=True) if asked else ()
    return [torch.zeros_like(x) if g is None else g for g, x in zip(found, asked)]
