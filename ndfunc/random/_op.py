"""A sampler in a traced program is one node: `ndfunc.random_block(key, kernel, shape, starts, stops, ...)`;
so is each key derived in it (`fold_in`, `split`): `ndfunc.threefry2x32(k0, k1, x0, x1)`.

Tracing the kernel itself would put one chunk's ~300 ops in the graph and, run whole, hold some 30
times the block's bytes at once. As one node, the program computes the block chunk by chunk (the
eager path), its size in the graph does not depend on the block's, and a partitioner can shard it
by changing `starts`/`stops`: every rank computes only its own block of the global value
(`random_block_at`, the partitioner's local op for a sharded one, reads them from the rank's
coordinates).
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("ndfunc", "FRAGMENT")
_lib.define(
    "random_block(Tensor key, str kernel, int[] shape, int[] starts, int[] stops, ScalarType out_dtype, "
    "Tensor[] tensor_args, ScalarType? kernel_dtype) -> Tensor"
)


def _run(key, kernel, shape, starts, stops, out_dtype, tensor_args, kernel_dtype):
    from ndfunc.random._blocks import sample
    from ndfunc.random._samplers import KERNELS

    args = (*tensor_args, kernel_dtype) if kernel_dtype is not None else tuple(tensor_args)
    index = tuple(slice(a, b) for a, b in zip(starts, stops))
    return sample(kernel, key, shape, index, out_dtype, KERNELS[kernel], *args)


def _meta(key, kernel, shape, starts, stops, out_dtype, tensor_args, kernel_dtype):
    return torch.empty([b - a for a, b in zip(starts, stops)], dtype=out_dtype, device=key.device)


# The same block, where it starts read from a rank's mesh coordinates at run time (so one program
# serves every rank, and in simulation each simulated rank gets its own): `starts = offset + coords @
# weights` (`weights`, (len(coords), ndim) flattened, say how far one step along each axis moves each
# dim), `block` its shape.
_lib.define(
    "random_block_at(Tensor key, str kernel, int[] shape, int[] offset, int[] block, Tensor coords, int[] weights, "
    "ScalarType out_dtype, Tensor[] tensor_args, ScalarType? kernel_dtype) -> Tensor"
)


def _starts(coords: torch.Tensor, weights, ndim: int) -> list[int]:
    w = torch.tensor(weights, dtype=torch.int64).view(-1, ndim)
    return (coords.reshape(-1, 1).to(torch.int64).cpu() * w).sum(0).tolist()


def _run_at(key, kernel, shape, offset, block, coords, weights, out_dtype, tensor_args, kernel_dtype):
    starts = [a + b for a, b in zip(offset, _starts(coords, weights, len(shape)))]
    return _run(key, kernel, shape, starts, [a + b for a, b in zip(starts, block)], out_dtype, tensor_args,
                kernel_dtype)


def _meta_at(key, kernel, shape, offset, block, coords, weights, out_dtype, tensor_args, kernel_dtype):
    return torch.empty(list(block), dtype=out_dtype, device=key.device)


# The hash itself, for keys: traced op by op, its 20 rounds would be ~150 nodes on a few words per
# `fold_in` or `split`, each planned by the partitioner (a Llama's init folds one key per matrix).
_lib.define("threefry2x32(Tensor k0, Tensor k1, Tensor x0, Tensor x1) -> (Tensor, Tensor)")


def _run_threefry(k0, k1, x0, x1):
    from ndfunc.random._threefry import threefry2x32

    return threefry2x32(k0, k1, x0, x1)


def _meta_threefry(k0, k1, x0, x1):
    shape = torch.broadcast_shapes(k0.shape, k1.shape, x0.shape, x1.shape)
    return (torch.empty(shape, dtype=torch.int64, device=x0.device),
            torch.empty(shape, dtype=torch.int64, device=x0.device))


for _key in ("CPU", "CUDA"):
    _lib.impl("random_block", _run, _key)
    _lib.impl("random_block_at", _run_at, _key)
    _lib.impl("threefry2x32", _run_threefry, _key)
_lib.impl("random_block", _meta, "Meta")
_lib.impl("random_block_at", _meta_at, "Meta")
_lib.impl("threefry2x32", _meta_threefry, "Meta")
random_block_op = torch.ops.ndfunc.random_block.default
random_block_at_op = torch.ops.ndfunc.random_block_at.default
threefry_op = torch.ops.ndfunc.threefry2x32.default


def traced_block(kernel_name: str, key, shape, bounds, out_dtype, args) -> torch.Tensor:
    """Emit the node for `kernel(k0, k1, flat, *args)` over the block `bounds` ((start, stop) per dim)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    kernel_dtype = args[-1] if args and isinstance(args[-1], torch.dtype) else None
    assert len(tensors) + (kernel_dtype is not None) == len(args), "kernel args: tensors, then a dtype"
    return torch.ops.ndfunc.random_block(
        key, kernel_name, list(shape), [a for a, _ in bounds], [b for _, b in bounds], out_dtype, tensors, kernel_dtype
    )
