"""Read blocks of tensors from a safetensors file with plain reads, never mapping the file.

safetensors' own `get_slice` reads through a memory map: a rank that takes a column slice of a
row-major matrix touches every page, and those pages count in its resident memory. Here a block is
read in bands of whole rows with `os.pread` into a bounded buffer, and only the block is kept, so
a rank's memory grows by its block (plus one band), whatever the slice's shape.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a
JSON header mapping names to dtype, shape and [begin, end) byte offsets, then the raw data.
"""

from __future__ import annotations

import ctypes
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
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path} is {size} bytes, shorter than a safetensors header's length "
                                 f"(8 bytes); the file is truncated or not safetensors.")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise ValueError(f"{self.path} says its header is {length} bytes, but the file has {size - 8} after "
                                 f"the length; the file is truncated or not safetensors.")
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path} has a damaged header (not JSON: {e}); the file is corrupted or not "
                                 f"safetensors.") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path} has a header that is a JSON {type(header).__name__}, not an object of "
                             f"tensors; the file is corrupted or not safetensors.")
        header.pop("__metadata__", None)
        data = size - 8 - length
        for name, entry in header.items():
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                    or not 0 <= offsets[0] <= offsets[1] <= data or not isinstance(entry.get("shape"), list)):
                raise ValueError(f"{self.path}: the header's entry for {name!r} ({entry!r}) is not a dtype, a shape "
                                 f"and data offsets within the file's {data} data bytes; the file is corrupted.")
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


CODES = {dtype: code for code, dtype in DTYPES.items()}


def write(path: str | os.PathLike, entries, metadata: dict[str, str] | None = None, write: bool = True) -> None:
    """Write a safetensors file from `entries`: (name, shape, dtype, fetch) each, `fetch()` giving
    the whole tensor when its turn comes. The header is made from the shapes first, then each
    tensor is fetched, written and dropped, so the writer holds one tensor at a time. With
    `write=False` the tensors are still fetched in turn (every rank takes part in each gather)
    but nothing is written (the ranks other than the one that writes)."""
    header, offset = {}, 0
    for name, shape, dtype, _ in entries:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as safetensors writes it
    out = open(path, "wb") if write else None
    try:
        if out is not None:
            out.write(struct.pack("<Q", len(text)) + text)
        for name, shape, dtype, fetch in entries:
            x = fetch()
            if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
                raise ValueError(f"{name}: fetched {x.dtype}{list(x.shape)}, announced {dtype}{list(shape)}.")
            if out is not None:
                x = x.detach().cpu().contiguous()
                out.write(memoryview(ctypes.string_at(x.data_ptr(), x.numel() * x.element_size())) if x.numel() else b"")
            del x
    finally:
        if out is not None:
            out.close()
