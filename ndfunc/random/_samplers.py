"""The samplers, as JAX's: `bits`, `uniform`, `normal`, `truncated_normal`, `bernoulli`.

Each checks its arguments, then runs a kernel (flat indices of a chunk -> values) over the block
asked for (see `_blocks.sample`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from ndfunc.random._blocks import Index, sample
from ndfunc.random._threefry import hash_flat
from ndfunc.random._xla_math import erf32, erfinv32, f32, fma

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def bits(key: torch.Tensor, shape: Sequence[int], *, index: Index | None = None) -> torch.Tensor:
    """Uniform 32-bit words (in int64, each in [0, 2**32)), as `jax.random.bits(key, shape)`.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.bits(nfr.key(42), (3,))
        tensor([2098992034, 2919706841, 2646866425])
    """
    return sample("bits", key, shape, index, torch.int64, _bits_kernel)


def uniform(
    key: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    minval: float | torch.Tensor = 0.0,
    maxval: float | torch.Tensor = 1.0,
    *,
    index: Index | None = None,
) -> torch.Tensor:
    """Uniform values in [minval, maxval), as `jax.random.uniform`.

    Args:
        key: from `key`, `split` or `fold_in`.
        shape: the global shape.
        dtype: float32, float16, bfloat16 or float64.
        minval, maxval: Python floats or 0-d tensors.
        index: a tuple of `slice(start, stop)`, one per dim (as `NamedSharding.shard_indices`
            gives): return only that block of the global value, computing nothing else.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.uniform(nfr.key(42), (2, 3))  # jax.random.uniform(jax.random.key(42), (2, 3))
        tensor([[0.4887, 0.6798, 0.6163],
                [0.5610, 0.4506, 0.5859]])
        >>> torch.equal(nfr.uniform(nfr.key(42), (2, 3), index=(slice(1, 2), slice(0, 3))),
        ...             nfr.uniform(nfr.key(42), (2, 3))[1:2])
        True
    """
    dtype = _check_dtype("uniform", dtype)
    if _is_number(minval, 0.0) and _is_number(maxval, 1.0):  # u * 1 + 0 and max(0, u) are exact
        return sample("uniform", key, shape, index, dtype, _unit_kernel, dtype)
    lo, hi = (_scalar("uniform", name, v, dtype, key) for name, v in (("minval", minval), ("maxval", maxval)))
    return sample("uniform", key, shape, index, dtype, _uniform_kernel, lo, hi, dtype)


def normal(
    key: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float32, *, index: Index | None = None
) -> torch.Tensor:
    """Standard normal values, as `jax.random.normal`: sqrt(2) * erfinv(uniform in (-1, 1)).

    `index` selects a block of the global value (see `uniform`). Dtypes other than float32 are the
    float32 values, cast.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.normal(nfr.key(42), (4,))  # jax.random.normal(jax.random.key(42), (4,))
        tensor([-0.0283,  0.4671,  0.2957,  0.1535])
    """
    dtype = _check_dtype("normal", dtype)
    return sample("normal", key, shape, index, dtype, _normal_kernel, dtype)


def truncated_normal(
    key: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    lower: float | torch.Tensor = -2.0,
    upper: float | torch.Tensor = 2.0,
    *,
    index: Index | None = None,
) -> torch.Tensor:
    """Standard normal values conditioned on (lower, upper), as `jax.random.truncated_normal`.

    Inverse-CDF sampling: uniform between erf(lower/sqrt 2) and erf(upper/sqrt 2), mapped back by
    sqrt(2) erfinv, then clipped into the open interval. Dtypes other than float32 are the float32
    values, cast and clipped again in the dtype.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.truncated_normal(nfr.key(42), (4,), lower=-1.0, upper=1.0)
        tensor([-0.0193,  0.3127,  0.2003,  0.1046])
    """
    dtype = _check_dtype("truncated_normal", dtype)
    if _is_number(lower) and _is_number(upper) and not lower < upper:
        raise ValueError(f"truncated_normal needs lower < upper, got lower={lower}, upper={upper}.")
    lo, hi = (_scalar("truncated_normal", name, v, torch.float32, key) for name, v in (("lower", lower), ("upper", upper)))
    # As XLA rewrites it: erf(x * float32(1/sqrt 2)), not erf(x / sqrt 2).
    a, b = erf32(lo * f32(0x3F3504F3)), erf32(hi * f32(0x3F3504F3))
    inf = torch.tensor(math.inf, dtype=dtype, device=key.device)
    floor, ceiling = torch.nextafter(lo.to(dtype), inf), torch.nextafter(hi.to(dtype), -inf)
    return sample("truncated_normal", key, shape, index, dtype, _truncated_kernel, a, b, floor, ceiling, dtype)


def bernoulli(
    key: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    p: float | torch.Tensor = 0.5,
    *,
    index: Index | None = None,
) -> torch.Tensor:
    """Booleans, True with probability `p`: `uniform(key, shape, dtype) < p`, as
    `jax.random.bernoulli` (whose `dtype` is that of `p`). Returns a bool tensor.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.bernoulli(nfr.key(42), (4,), p=0.5)
        tensor([ True, False, False, False])
    """
    dtype = _check_dtype("bernoulli", dtype)
    if _is_number(p) and not 0.0 <= p <= 1.0:
        raise ValueError(f"bernoulli needs a probability p in [0, 1], got {p}.")
    threshold = _scalar("bernoulli", "p", p, dtype, key)
    return sample("bernoulli", key, shape, index, torch.bool, _bernoulli_kernel, threshold, dtype)


# ---- kernels: flat indices of a chunk -> values ---------------------------------------------------
# Module-level functions of tensors and static dtypes, so that torch.compile can fuse one whole
# chunk (see `use_compile`) and make_fx can trace it.


def _bits_kernel(k0, k1, flat):
    w0, w1 = hash_flat(k0, k1, flat)
    return w0.bitwise_xor_(w1)


def _unit_kernel(k0, k1, flat, dtype):
    return _unit(*hash_flat(k0, k1, flat), dtype)


def _uniform_kernel(k0, k1, flat, lo, hi, dtype):
    u = _unit(*hash_flat(k0, k1, flat), dtype)
    if dtype == torch.float32:  # JAX's CPU code fuses the multiply-add
        return torch.maximum(lo, fma(u, hi - lo, lo))
    return torch.maximum(lo, u * (hi - lo) + lo)


def _normal_kernel(k0, k1, flat, dtype):
    u = (_unit(*hash_flat(k0, k1, flat), torch.float32) * 2.0 + _NORMAL_LOW).clamp_min_(_NORMAL_LOW)
    return (erfinv32(u) * _SQRT2).to(dtype)


def _truncated_kernel(k0, k1, flat, a, b, floor, ceiling, dtype):
    u = torch.maximum(a, fma(_unit(*hash_flat(k0, k1, flat), torch.float32), b - a, a))
    x = (erfinv32(u) * _SQRT2).to(dtype)
    return torch.minimum(ceiling, torch.maximum(floor, x))


def _bernoulli_kernel(k0, k1, flat, threshold, dtype):
    return _unit(*hash_flat(k0, k1, flat), dtype) < threshold


# By name, for the traced form of a sampler (ndfunc.random_block, see _op.py).
KERNELS = {k.__name__: k for k in (_bits_kernel, _unit_kernel, _uniform_kernel, _normal_kernel,
                                   _truncated_kernel, _bernoulli_kernel)}



# ---- bits to floats ------------------------------------------------------------------------------


def _unit(w0: torch.Tensor, w1: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniform in [0, 1) as JAX draws it: random mantissa bits under the exponent of 1.0, minus 1.

    float32 uses all 32 bits of w0 ^ w1, float16 the low 16, bfloat16 the low 8 (JAX draws at
    least 8 bits), float64 the 64 bits w0 << 32 | w1.
    """
    if dtype == torch.float64:  # (w0 << 32 | w1) >> 12, without overflowing int64
        mantissa = (w0 << 20) | (w1 >> 12)
        return (mantissa | 0x3FF0000000000000).view(torch.float64) - 1.0
    word = w0.bitwise_xor_(w1)
    if dtype == torch.float32:
        return ((word >> 9) | 0x3F800000).to(torch.int32).view(torch.float32) - 1.0
    if dtype == torch.float16:
        return (((word & 0xFFFF) >> 6) | 0x3C00).to(torch.int16).view(torch.float16) - 1.0
    return (((word & 0xFF) >> 1) | 0x3F80).to(torch.int16).view(torch.bfloat16) - 1.0


_SQRT2 = f32(0x3FB504F3)
_NORMAL_LOW = f32(0xBF7FFFFF)  # nextafter(-1, 0): uniform(-1, 1) must not reach erfinv(-1) = -inf


def _check_dtype(name: str, dtype) -> torch.dtype:
    if dtype not in _FLOATS:
        raise TypeError(
            f"{name} samples float32 (bit for bit with JAX), float16, bfloat16 or float64, got {dtype!r}."
        )
    return dtype


def _is_number(value, equal_to: float | None = None) -> bool:
    """A Python number (static: safe to branch on), optionally equal to `equal_to`."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return number and (equal_to is None or value == equal_to)


def _scalar(fn: str, name: str, value, dtype: torch.dtype, key: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.ndim:
            raise ValueError(
                f"{fn} expects {name} to be a Python float or a 0-d tensor, got a tensor of shape "
                f"{tuple(value.shape)}; a different {name} per element is not supported."
            )
        return value.to(device=key.device, dtype=dtype)
    if not _is_number(value):
        raise TypeError(f"{fn} expects {name} to be a Python float or a 0-d tensor, got {value!r}.")
    return torch.tensor(float(value), dtype=dtype, device=key.device)
