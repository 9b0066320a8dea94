"""Transforms of a jitted step's program, and of the functions a step is made of.

Passes over the program, given to `nf.jit(..., transforms=[...])`, each a `Transform`
(`ndfunc._src.transforms.base`, the protocol and its hook points): `fsdp`, `ring_attention`,
`mixed_precision`, and `remat_regions`, which every program runs first (the recomputation that
`remat` marks). Function transforms beside them: `remat` (recompute a region in backward) and
`nf.accumulate` (`ndfunc._src.transforms.accumulate`: micro-batches, one program however many; it makes
jitted programs, so it is imported from `ndfunc`, not here).
"""

from ndfunc._src.transforms.base import Transform as Transform
from ndfunc._src.transforms.fsdp import fsdp as fsdp
from ndfunc._src.transforms.precision import mixed_precision as mixed_precision
from ndfunc._src.transforms.remat import remat as remat
from ndfunc._src.transforms.remat import remat_regions as remat_regions
from ndfunc._src.transforms.ring import ring_attention as ring_attention
from ndfunc._src.transforms.ring import unzigzag as unzigzag
from ndfunc._src.transforms.ring import zigzag as zigzag

__all__ = ["Transform", "fsdp", "mixed_precision", "remat", "remat_regions", "ring_attention", "unzigzag", "zigzag"]
