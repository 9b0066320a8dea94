"""Modules as ndfunc takes them: `functional(module)` (parameters, buffers, a pure apply) and
`partition_specs(module, mesh, tp=, fsdp=)` (a spec per parameter, from the module's TP plan)."""

from ndfunc._src.module import functional as functional
from ndfunc._src.module import partition_specs as partition_specs

__all__ = ["functional", "partition_specs"]
