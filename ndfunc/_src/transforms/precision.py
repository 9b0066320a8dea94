"""`nf.mixed_precision`: fp32 master parameters and optimizer state, low-precision compute.

While the step is traced, every function differentiated by `nf.grad` / `nf.value_and_grad` sees
the float arguments it differentiates cast to `param_dtype`: forward and backward run in it, and
the gradients come back through the casts in the parameters' own dtype, for an optimizer that
keeps everything in fp32; a module's apply (`nf.nn.functional`) casts its parameters in every
call, differentiated or not, so an eval step computes as the training forward does, and its float
inputs, as FSDP2's `cast_forward_inputs` does. Casts are ops like any other: the partitioner
places them, so a parameter stored sharded is cast before it is gathered (the gather moves half
the bytes) when that is cheaper. After lowering, every reduction of `param_dtype` values sums in
`reduce_dtype` instead, and what reads the sum takes it so unless it reads it in `param_dtype`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ndfunc._src.module import COMPUTE_DTYPE
from ndfunc._src.transforms.base import Transform
from ndfunc._src.transforms.reduce import reduce_in


@dataclasses.dataclass(frozen=True)
class mixed_precision(Transform):  # noqa: N801 - a transform is named like the function it stands for
    """Compute in `param_dtype`, reduce gradients in `reduce_dtype`, keep the rest as it is.

    Use: `nf.jit(step, ..., transforms=[nf.mixed_precision(torch.bfloat16, torch.float32)])`.
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if not (isinstance(value, torch.dtype) and value.is_floating_point) and not (
                    name == "reduce_dtype" and value is None):
                raise TypeError(f"nf.mixed_precision: {name} is a floating-point torch.dtype (e.g. torch.bfloat16), "
                                f"got {value!r}.")

    @contextlib.contextmanager
    def tracing(self):
        token = COMPUTE_DTYPE.set(self.param_dtype)
        try:
            yield
        finally:
            COMPUTE_DTYPE.reset(token)

    def lowered(self, program) -> None:
        if self.reduce_dtype is not None:
            reduce_in(program.local, self.reduce_dtype, only_from=self.param_dtype)
