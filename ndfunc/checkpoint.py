"""Sharded checkpoints on torch.distributed.checkpoint: `save(path, tree)` writes each rank's blocks,
`async_save` does so while training goes on, `load(path, like)` reads them into any layout (another
mesh, another spec, one device), and a `Manager` keeps a run's checkpoints (atomic, the last `keep`,
asynchronous saves)."""

from ndfunc._src.checkpoint import CheckpointError as CheckpointError
from ndfunc._src.checkpoint import Manager as Manager
from ndfunc._src.checkpoint import async_save as async_save
from ndfunc._src.checkpoint import load as load
from ndfunc._src.checkpoint import save as save

__all__ = ["CheckpointError", "Manager", "async_save", "load", "save"]
