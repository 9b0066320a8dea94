"""Stand-ins for tensors: a shape, a dtype and a sharding, with no data (JAX's `ShapeDtypeStruct`).

A step lowered over stand-ins is planned as it would be over real arguments of those shapes and
layouts, on any mesh (an `AbstractMesh` of 1,024 ranks included), and nothing is allocated:
tracing runs on fake tensors of the global shapes, and every pass after it is arithmetic on shapes.

    params = optree.tree_map(lambda s, spec: nf.ShapeDtypeStruct(s, torch.bfloat16,
                             sharding=NamedSharding(mesh, spec)), llama.param_shapes(cfg), specs)
    lowered = step.lower(params, opt.init(params), batch)   # opt.init over stand-ins: stand-ins
    lowered.memory_analysis(), lowered.cost_analysis()

`eval_shape(fn, *args)` runs any function over stand-ins (and tensors) on fake tensors and returns
its results as stand-ins, as `jax.eval_shape` does.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ndfunc._src.sharding.errors import ShardingError
from ndfunc._src.sharding.named_sharding import NamedSharding
from ndfunc._src.torch_compat import FakeTensorMode, no_dispatch_modes


class ShapeDtypeStruct:
    """A value's global shape, dtype, sharding and device, and no data.

    `nf.jit(...).lower(...)` takes it wherever it takes a tensor; `sharding` (a `NamedSharding`
    over a `Mesh` or an `AbstractMesh`) lays it out as a DTensor's placements would, and `None` is
    replicated (or whatever `in_shardings` asks). It cannot be run: lower, read, and plan.

    Example:
        >>> from ndfunc.sharding import AbstractMesh, NamedSharding, P
        >>> mesh = AbstractMesh({'dp_shard': 512, 'tp': 2})
        >>> w = nf.ShapeDtypeStruct((8192, 28672), torch.bfloat16, sharding=NamedSharding(mesh, P('dp_shard', 'tp')))
        >>> w.shape, w.nbytes, w.sharding.shard_shape(w.shape)
        ((8192, 28672), 469762048, (16, 14336))
    """

    __slots__ = ("_shape", "_dtype", "_sharding", "_device")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, *, sharding: NamedSharding | None = None,
                 device: torch.device | str = "cpu"):
        if isinstance(shape, numbers.Integral) or not all(
                isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise TypeError(f"ShapeDtypeStruct: shape is a sequence of sizes >= 0, like (4096, 1024), "
                            f"got {shape!r}.")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"ShapeDtypeStruct: dtype is a torch.dtype (torch.bfloat16, ...), got {dtype!r}.")
        if sharding is not None:
            if not isinstance(sharding, NamedSharding):
                raise TypeError(f"ShapeDtypeStruct: sharding is a NamedSharding(mesh, P(...)) or None, got "
                                f"{sharding!r} of type {type(sharding).__name__}; a bare P needs its mesh: "
                                f"NamedSharding(mesh, spec).")
            try:
                sharding.check(tuple(shape))
            except ShardingError as e:
                raise type(e)(f"ShapeDtypeStruct: {e}") from None
        object.__setattr__(self, "_shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "_dtype", dtype)
        object.__setattr__(self, "_sharding", sharding)
        object.__setattr__(self, "_device", torch.device(device))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ShapeDtypeStruct is immutable")

    def __reduce__(self):
        return (_rebuild, (self._shape, self._dtype, self._sharding, self._device))

    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self._dtype)
    sharding = property(lambda self: self._sharding)
    device = property(lambda self: self._device)

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        """The number of elements (of the global value)."""
        return math.prod(self._shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the global value."""
        return self.size * self._dtype.itemsize

    def with_sharding(self, sharding: NamedSharding | None) -> "ShapeDtypeStruct":
        return ShapeDtypeStruct(self._shape, self._dtype, sharding=sharding, device=self._device)

    def _key(self):
        return (self._shape, self._dtype, self._sharding, self._device)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShapeDtypeStruct) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = "" if self._sharding is None else f", sharding={self._sharding!r}"
        extra += "" if self._device.type == "cpu" else f", device={str(self._device)!r}"
        return f"ShapeDtypeStruct(shape={self._shape}, dtype={str(self._dtype).removeprefix('torch.')}{extra})"


def is_stand_in(x: Any) -> bool:
    return isinstance(x, ShapeDtypeStruct)


def has_stand_ins(tree: Any) -> bool:
    return any(map(is_stand_in, optree.tree_leaves(tree)))


def eval_shape(fn: Callable, *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)`'s results as `ShapeDtypeStruct`s, computed on fake tensors: stand-ins
    and tensors go in, nothing of their size is allocated (`jax.eval_shape`). Results carry no
    sharding.

    Example:
        >>> out = nf.eval_shape(lambda a, b: a @ b, nf.ShapeDtypeStruct((1 << 20, 4096), torch.bfloat16),
        ...                     torch.ones(4096, 8, dtype=torch.bfloat16))
        >>> out
        ShapeDtypeStruct(shape=(1048576, 8), dtype=bfloat16)
    """
    with no_dispatch_modes():  # a fake of the global value, not one per simulated rank
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fakes = optree.tree_map(
                lambda x: torch.empty(x.shape, dtype=x.dtype, device=x.device) if is_stand_in(x) else x,
                (args, kwargs))
            out = fn(*fakes[0], **fakes[1])
        return optree.tree_map(
            lambda x: ShapeDtypeStruct(tuple(x.shape), x.dtype, device=x.device) if isinstance(x, torch.Tensor) else x,
            out)


def _rebuild(shape, dtype, sharding, device) -> ShapeDtypeStruct:
    return ShapeDtypeStruct(shape, dtype, sharding=sharding, device=device)
