"""A sampler's value one block and one chunk at a time: from a block of the global shape to the
flat indices a kernel hashes, computed `CHUNK` elements per step."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

# The package, for `CHUNK`: read at each call, so setting `ndfunc.random.CHUNK` takes effect.
from ndfunc import random as nfr
from ndfunc.random._compile import compiled_chunks
from ndfunc.random._threefry import check_key, check_shape

Index = tuple[slice, ...]


def sample(name: str, key, shape, index, dtype: torch.dtype, kernel: Callable, *args) -> torch.Tensor:
    """`kernel(k0, k1, flat, *args)` over the flat indices of the block, one chunk at a time."""
    k0, k1 = check_key(name, key)
    shape = check_shape(name, shape)
    block, flat_indices = _block(name, shape, index)
    if get_proxy_mode() is not None:  # being traced (make_fx): one node, see _op.py
        from ndfunc.random._op import traced_block

        bounds = [_bounds(name, s, n, d) for d, (s, n) in enumerate(zip(_full(index, shape), shape))]
        return traced_block(kernel.__name__, key, shape, bounds, dtype, args)
    numel, device = math.prod(block), key.device
    # Under torch.compile a graph holds the ops of one chunk; numel / CHUNK copies help no one.
    chunk = max(numel, 1) if torch.compiler.is_compiling() else nfr.CHUNK
    if numel <= chunk:
        return kernel(k0, k1, flat_indices(0, numel, device), *args).reshape(block)
    out = torch.empty(numel, dtype=dtype, device=device)
    done = compiled_chunks(out, kernel, k0, k1, flat_indices, args, device)
    for start in range(done, numel, chunk):
        stop = min(start + chunk, numel)
        out[start:stop] = kernel(k0, k1, flat_indices(start, stop, device), *args)
    return out.reshape(block)


def _full(index, shape) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in shape) if index is None else tuple(index)


def _block(name: str, shape: tuple[int, ...], index) -> tuple[tuple[int, ...], Callable]:
    """The block's shape, and a function from a range of its row-major element numbers to their
    flat indices in the global value."""
    if index is None:
        index = tuple(slice(None) for _ in shape)
    if not isinstance(index, (tuple, list)) or not all(isinstance(s, slice) for s in index):
        raise TypeError(
            f"{name} expects index to be a tuple of slice(start, stop), one per dim (as "
            f"NamedSharding.shard_indices gives), got {index!r}."
        )
    if len(index) != len(shape):
        raise ValueError(
            f"{name}: index has {len(index)} slice(s) but shape {shape} has {len(shape)} dims; give "
            f"one slice(start, stop) per dim, as NamedSharding.shard_indices does."
        )
    # Runs of dims: an outer dim merges with the run inside it when that run is whole, so a block
    # that is contiguous in the global value is one run and its flat indices one arange.
    runs: list[list[int]] = []  # [start, length, extent, stride] per run, innermost first
    stride = 1
    block = []
    for dim in reversed(range(len(shape))):
        start, stop = _bounds(name, index[dim], shape[dim], dim)
        block.append(stop - start)
        if runs and runs[-1][0] == 0 and runs[-1][1] == runs[-1][2]:
            run = runs[-1]
            run[0], run[1], run[2] = start * run[2], (stop - start) * run[2], shape[dim] * run[2]
        else:
            runs.append([start, stop - start, shape[dim], stride])
        stride *= shape[dim]
    block = tuple(reversed(block))

    def flat_indices(first: int, last: int, device) -> torch.Tensor:
        local = torch.arange(first, last, dtype=torch.int64, device=device)
        if len(runs) <= 1:
            return local + (runs[0][0] if runs else 0)
        flat = torch.zeros_like(local)
        for start, length, _, step in runs:
            flat += (local % length + start) * step
            local = local.div_(length, rounding_mode="floor")
        return flat

    return block, flat_indices


def _bounds(name: str, s: slice, size: int, dim: int) -> tuple[int, int]:
    start = 0 if s.start is None else s.start
    stop = size if s.stop is None else s.stop
    ok = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (start, stop))
    if s.step not in (None, 1) or not ok or not 0 <= start <= stop <= size:
        raise ValueError(
            f"{name}: index[{dim}] = {s!r} is not a block of dim {dim} of size {size}; need "
            f"slice(start, stop) with integers 0 <= start <= stop <= {size} and no step."
        )
    return int(start), int(stop)
