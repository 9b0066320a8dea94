"""A checkpoint's index read without running code.

DCP writes a checkpoint's index (`.metadata`) with `pickle`, and its `FileSystemReader` reads it
with `pickle.load`: a checkpoint from elsewhere could name any callable in it and have it run when
loaded. `Reader` is that reader with the index read by an unpickler that admits only what DCP's
index is made of (its metadata dataclasses, `torch.Size`, dtypes, layouts, paths), as
`torch.load(weights_only=True)` admits only tensors. The data files DCP reads with
`torch.load(weights_only=True)` already.
"""

from __future__ import annotations

import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA = ".metadata"  # DCP's index of a checkpoint: written last, so a complete checkpoint has it

_ADMITTED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "torch": {"Size"},  # and the dtypes (`_admitted`)
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class RefusedIndex(pickle.UnpicklingError):
    """An index that names something DCP's index is not made of."""


def _admitted(module: str, name: str) -> bool:
    if name in _ADMITTED.get(module, ()):
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise RefusedIndex(f"{module}.{name}")
        return super().find_class(module, name)


def read_index(path: pathlib.Path) -> Metadata:
    """The index at `path` (a `.metadata` file); `RefusedIndex` names what it holds that DCP's does not."""
    with open(path, "rb") as f:
        metadata = _IndexUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise RefusedIndex(f"a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class Reader(dcp.FileSystemReader):
    """DCP's file system reader, its index read by `read_index`."""

    def __init__(self, path: str | pathlib.Path):
        super().__init__(str(path))
        self.directory = pathlib.Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_index(self.directory / (METADATA if rank is None else f"__{rank}{METADATA}"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # (as DCP's own reader does)
        return metadata
