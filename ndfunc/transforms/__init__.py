"""Passes over a partitioned or lowered program, given to `nf.jit(..., transforms=[...])`."""

from ndfunc.transforms.fsdp import fsdp as fsdp

__all__ = ["fsdp"]
