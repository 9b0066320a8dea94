"""Read blocks of tensors from a safetensors file with plain reads, never mapping the file.

safetensors' own `get_slice` reads through a memory map: a rank that takes a column slice of a
row-major matrix touches every page, and those pages count in its resident memory. Here a block is
read in bands of whole rows with `os.pread` into a bounded buffer, and only the block is kept, so
a rank's memory grows by its block (plus one band), whatever the slice's shape.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a
JSON header mapping names to dtype, shape and [begin, end) byte offsets, then the raw data.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
BAND_BYTES = 4 << 20  # the most a read holds beyond the block itself


class SafetensorsFile:
    """One safetensors file: `names()`, `shape(name)`, `dtype(name)`, `read(name, index)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        self._entries = header
        self._data_start = 8 + length

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self._entry(name)["dtype"]
        if code not in DTYPES:
            raise ValueError(f"{name} in {self.path} has dtype {code}, which ndfunc cannot read; expected one of {sorted(DTYPES)}.")
        return DTYPES[code]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The block `index` (a slice per leading dim; missing dims whole) of tensor `name`."""
        shape, dtype = self.shape(name), self.dtype(name)
        begin = self._data_start + self._entry(name)["data_offsets"][0]
        index = _full_index(shape, index, name)
        block = [s.stop - s.start for s in index]
        itemsize = torch.empty((), dtype=dtype).element_size()
        row_shape = shape[1:]
        row_bytes = math.prod(row_shape) * itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if not shape or all(s.start == 0 and s.stop == n for s, n in zip(index[1:], row_shape)):
                # Whole rows are one contiguous range: read it straight into the block's storage.
                start = begin + (index[0].start * row_bytes if shape else 0)
                storage = bytearray(math.prod(block) * itemsize)
                _pread_into(fd, memoryview(storage), start, self.path)
                return _as_tensor(storage, dtype, block)
            out = torch.empty(block, dtype=dtype)
            rows = max(1, BAND_BYTES // max(row_bytes, 1))
            band = bytearray(min(rows, block[0]) * row_bytes)  # one buffer, reused for every band
            for r in range(index[0].start, index[0].stop, rows):
                r1 = min(r + rows, index[0].stop)
                view = memoryview(band)[: (r1 - r) * row_bytes]
                _pread_into(fd, view, begin + r * row_bytes, self.path)
                chunk = _as_tensor(view, dtype, [r1 - r, *row_shape])
                out[r - index[0].start: r1 - index[0].start] = chunk[(slice(None), *index[1:])]
            return out
        finally:
            os.close(fd)

    def _entry(self, name: str) -> dict:
        if name not in self._entries:
            raise KeyError(f"{self.path} has no tensor {name!r}.")
        return self._entries[name]


def _pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError(f"{path} ends before byte {offset + len(view)}; the file is truncated.")
        done += n


def _as_tensor(buffer, dtype: torch.dtype, shape) -> torch.Tensor:
    if len(buffer) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def _full_index(shape: tuple[int, ...], index, name: str) -> tuple[slice, ...]:
    index = tuple(index or ())
    if len(index) > len(shape):
        raise ValueError(f"index {index} has {len(index)} entries but {name} has rank {len(shape)}.")
    full = []
    for s, n in zip(index + (slice(None),) * (len(shape) - len(index)), shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"index {index} for {name} has a step; blocks are contiguous slices.")
        full.append(slice(start, max(start, stop)))
    return tuple(full)
