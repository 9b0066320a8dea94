"""Passes over a partitioned or lowered program, given to `nf.jit(..., transforms=[...])`."""

from ndfunc.transforms.fsdp import fsdp as fsdp
from ndfunc.transforms.precision import mixed_precision as mixed_precision
from ndfunc.transforms.ring import ring_attention as ring_attention
from ndfunc.transforms.ring import unzigzag as unzigzag
from ndfunc.transforms.ring import zigzag as zigzag

__all__ = ["fsdp", "mixed_precision", "ring_attention", "unzigzag", "zigzag"]
