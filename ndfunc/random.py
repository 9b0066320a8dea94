"""Counter-based random numbers: JAX's threefry PRNG, bit for bit, one block at a time.

A key is an int64 tensor of shape (2,) holding two unsigned 32-bit words `[k0, k1]`, each in
[0, 2**32) (torch has no general uint32 arithmetic; int64 holds every uint32 and every sum of two).
The value at a global index of `shape` depends only on the key and that index: its bits are the
Threefry-2x32 hash of the flat row-major index under the key, as JAX computes them with
`jax_threefry_partitionable=True` (its default). So `normal(key, shape, index=block)` computes only
`normal(key, shape)[block]`, in chunks of `CHUNK` elements, and a sharded init gives the same full
tensor on any mesh while each rank computes just its own block.

Against JAX 0.10.2 (tests/test_random.py; data from tests/data/make_jax_random_cases.py):
- bit for bit: `key` (as with `jax_enable_x64`), `split`, `fold_in`, `bits`; `uniform` and
  `bernoulli` in float32, float16 and bfloat16, and in float64 on the default range [0, 1).
- float32 `normal` and `truncated_normal`: bit for bit with JAX on CPU. XLA expands erf_inv, log1p
  and erf into polynomials and its CPU code fuses their multiply-adds; both are reproduced here, a
  fused multiply-add as an exact float64 product, a float64 sum, then float32. That double rounding
  could differ in the last bit; it did not in 3e8 such operations (10**7 normals). JAX on GPU or TPU
  rounds the same formulas differently, so it can itself differ from JAX on CPU in the last bit.
- not bit for bit: float64 `uniform` off [0, 1) (JAX fuses `u * (maxval - minval) + minval`, which
  torch cannot do in float64), and `normal` / `truncated_normal` in other dtypes, which are the
  float32 values cast (JAX draws them at the dtype's own width).

Everything is torch ops on tensors (no `.item()`, no branching on tensor values, no numpy), so the
samplers can be traced. `use_compile()` opts in to `torch.compile`'d kernels for big values.

Example:
    >>> from ndfunc import random as nfr
    >>> key = nfr.key(0)
    >>> sharding = NamedSharding(AbstractMesh({'dp': 2, 'tp': 2}), P('dp', 'tp'))
    >>> blocks = [nfr.normal(key, (4, 6), index=i) for i in sharding.shard_indices((4, 6))]
    >>> blocks[3].shape, torch.equal(blocks[3], nfr.normal(key, (4, 6))[2:4, 3:6])
    (torch.Size([2, 3]), True)
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Callable, Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "CHUNK", "COMPILE_CHUNK", "bernoulli", "bits", "fold_in", "key", "normal", "split", "threefry2x32",
    "truncated_normal", "uniform", "use_compile",
]

Index = tuple[slice, ...]
CHUNK = 1 << 16  # elements hashed per step: threefry's ~140 temporaries stay in cache
_MASK = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _f32(word: int) -> float:
    """The float32 whose bits are `word` (XLA's constants, exactly as it rounds them)."""
    return struct.unpack("<f", struct.pack("<I", word))[0]


# ---- Threefry-2x32 -------------------------------------------------------------------------------


def threefry2x32(k0: torch.Tensor, k1: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor):
    """Threefry-2x32, 20 rounds (Salmon et al., SC'11), exactly as JAX's `threefry2x32_p`.

    Every argument holds uint32 words in int64; `k0`, `k1` broadcast against the counter words
    `x0`, `x1`. Returns the two output words, each masked to [0, 2**32).
    """
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    # x0 is masked only at the end: its low 32 bits are all that matter, and 20 rounds plus 5 key
    # injections keep it below 2**38. x1 must be exact before every rotation, so it is masked each
    # round (after the xor, which also drops x0's high bits).
    x0 = x0 + ks[0]
    x1 = (x1 + ks[1]).bitwise_and_(_MASK)
    high = torch.empty_like(x1)
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0.add_(x1)
            torch.bitwise_left_shift(x1, r, out=high)
            x1.bitwise_right_shift_(32 - r).bitwise_or_(high).bitwise_xor_(x0).bitwise_and_(_MASK)
        x0.add_(ks[(i + 1) % 3])
        x1.add_(ks[(i + 2) % 3] + (i + 1)).bitwise_and_(_MASK)
    return x0.bitwise_and_(_MASK), x1


def _hash(k0, k1, flat: torch.Tensor):
    """The two threefry words of each flat index (JAX's iota_2x32_shape: hi and lo halves)."""
    return threefry2x32(k0, k1, flat >> 32, flat & _MASK)


# ---- keys ----------------------------------------------------------------------------------------


def key(seed: int | torch.Tensor) -> torch.Tensor:
    """A key from an integer seed, as `jax.random.key(seed)` (threefry, `jax_enable_x64`).

    A 64-bit seed becomes its two's-complement words `[seed >> 32, seed & 0xFFFFFFFF]`. (JAX without
    x64 first truncates a seed to 32 bits; the two agree on seeds in [0, 2**32).) A tensor seed of
    at most 32 bits has high word 0, as in JAX.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.key(42), nfr.key(-1)
        (tensor([ 0, 42]), tensor([4294967295, 4294967295]))
    """
    if isinstance(seed, torch.Tensor):
        if seed.dtype.is_floating_point or seed.dtype.is_complex or seed.dtype == torch.bool or seed.ndim:
            raise TypeError(
                f"key expects an integer seed, got a tensor of shape {tuple(seed.shape)} and dtype "
                f"{seed.dtype}; pass a Python int or a 0-d integer tensor."
            )
        s = seed.to(torch.int64)
        high = torch.zeros_like(s) if seed.dtype.itemsize <= 4 else (s >> 32) & _MASK
        return torch.stack([high, s & _MASK])
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"key expects an integer seed, got {seed!r} of type {type(seed).__name__}.")
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"key expects a seed in [-2**63, 2**63) (64 bits), got {seed}.")
    seed = int(seed) & (2**64 - 1)
    return torch.tensor([seed >> 32, seed & _MASK], dtype=torch.int64)


def split(key: torch.Tensor, num: int | Sequence[int] = 2) -> torch.Tensor:
    """`num` new keys, shape (num, 2) (or (*num, 2) for a tuple), as `jax.random.split`.

    Key i is the threefry hash of the counter i under `key`, JAX's partitionable split.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.split(nfr.key(42))
        tensor([[1832780943,  270669613],
                [  64467757, 2916123636]])
    """
    k0, k1 = _check_key("split", key)
    shape = (num,) if isinstance(num, numbers.Integral) and not isinstance(num, bool) else num
    shape = _check_shape("split", shape, what="num")
    flat = torch.arange(math.prod(shape), dtype=torch.int64, device=key.device)
    return torch.stack(_hash(k0, k1, flat), dim=-1).reshape(*shape, 2)


def fold_in(key: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """A new key from `key` and a 32-bit integer, as `jax.random.fold_in`.

    `data` is a Python int in [0, 2**32) or a 0-d integer tensor (taken modulo 2**32, as JAX does
    for arrays). Typical use: one key per layer or per step, `fold_in(key, layer)`.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.fold_in(nfr.key(42), 7)
        tensor([2547012911, 1371500959])
    """
    k0, k1 = _check_key("fold_in", key)
    if isinstance(data, torch.Tensor):
        if data.ndim or data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
            raise TypeError(
                f"fold_in expects a 32-bit integer, got a tensor of shape {tuple(data.shape)} and "
                f"dtype {data.dtype}; pass a Python int or a 0-d integer tensor (fold in one at a time)."
            )
        word = data.to(device=key.device, dtype=torch.int64) & _MASK
    elif isinstance(data, numbers.Integral) and not isinstance(data, bool):
        if not 0 <= data < 2**32:
            raise ValueError(f"fold_in expects data in [0, 2**32) (a uint32, as JAX), got {data}.")
        word = torch.tensor(int(data), dtype=torch.int64, device=key.device)
    else:
        raise TypeError(f"fold_in expects an integer, got {data!r} of type {type(data).__name__}.")
    # JAX hashes threefry_seed(data) = [data >> 32, data & 0xFFFFFFFF] = [0, data] under the key.
    return torch.stack(threefry2x32(k0, k1, torch.zeros_like(word), word))


# ---- samplers ------------------------------------------------------------------------------------


def bits(key: torch.Tensor, shape: Sequence[int], *, index: Index | None = None) -> torch.Tensor:
    """Uniform 32-bit words (in int64, each in [0, 2**32)), as `jax.random.bits(key, shape)`.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.bits(nfr.key(42), (3,))
        tensor([2098992034, 2919706841, 2646866425])
    """
    return _sample("bits", key, shape, index, torch.int64, _bits_kernel)


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
        return _sample("uniform", key, shape, index, dtype, _unit_kernel, dtype)
    lo, hi = (_scalar("uniform", name, v, dtype, key) for name, v in (("minval", minval), ("maxval", maxval)))
    return _sample("uniform", key, shape, index, dtype, _uniform_kernel, lo, hi, dtype)


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
    return _sample("normal", key, shape, index, dtype, _normal_kernel, dtype)


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
    a, b = _erf32(lo * _f32(0x3F3504F3)), _erf32(hi * _f32(0x3F3504F3))
    inf = torch.tensor(math.inf, dtype=dtype, device=key.device)
    floor, ceiling = torch.nextafter(lo.to(dtype), inf), torch.nextafter(hi.to(dtype), -inf)
    return _sample("truncated_normal", key, shape, index, dtype, _truncated_kernel, a, b, floor, ceiling, dtype)


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
    return _sample("bernoulli", key, shape, index, torch.bool, _bernoulli_kernel, threshold, dtype)


# ---- kernels: flat indices of a chunk -> values ---------------------------------------------------
# Module-level functions of tensors and static dtypes, so that torch.compile can fuse one whole
# chunk (see `use_compile`) and make_fx can trace it.


def _bits_kernel(k0, k1, flat):
    w0, w1 = _hash(k0, k1, flat)
    return w0.bitwise_xor_(w1)


def _unit_kernel(k0, k1, flat, dtype):
    return _unit(*_hash(k0, k1, flat), dtype)


def _uniform_kernel(k0, k1, flat, lo, hi, dtype):
    u = _unit(*_hash(k0, k1, flat), dtype)
    if dtype == torch.float32:  # JAX's CPU code fuses the multiply-add
        return torch.maximum(lo, _fma(u, hi - lo, lo))
    return torch.maximum(lo, u * (hi - lo) + lo)


def _normal_kernel(k0, k1, flat, dtype):
    u = (_unit(*_hash(k0, k1, flat), torch.float32) * 2.0 + _NORMAL_LOW).clamp_min_(_NORMAL_LOW)
    return (_erfinv32(u) * _SQRT2).to(dtype)


def _truncated_kernel(k0, k1, flat, a, b, floor, ceiling, dtype):
    u = torch.maximum(a, _fma(_unit(*_hash(k0, k1, flat), torch.float32), b - a, a))
    x = (_erfinv32(u) * _SQRT2).to(dtype)
    return torch.minimum(ceiling, torch.maximum(floor, x))


def _bernoulli_kernel(k0, k1, flat, threshold, dtype):
    return _unit(*_hash(k0, k1, flat), dtype) < threshold


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


_SQRT2 = _f32(0x3FB504F3)
_NORMAL_LOW = _f32(0xBF7FFFFF)  # nextafter(-1, 0): uniform(-1, 1) must not reach erfinv(-1) = -inf


def _fma(a: torch.Tensor, b, c) -> torch.Tensor:
    """float32 `a * b + c` rounded once, as a fused multiply-add: the product of two float32 is
    exact in float64, the sum is rounded there, then to float32 (see the module note).

    `a` is a tensor holding float32 values (in float32 or float64: pass float64 copies of operands
    used more than once); `b` and `c` are tensors or floats.
    """
    if a.dtype != torch.float64:
        a = a.double()
    if not isinstance(c, torch.Tensor):
        return (a * b).add_(c).float()
    if isinstance(b, torch.Tensor):
        return torch.addcmul(c, a, b).float()
    return torch.add(c, a, alpha=b).float()


def _select(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.where(mask, a, b)` for float32 tensors, by their bits: torch.where is several times
    slower than an integer op on CPU, and these kernels select four times per value."""
    ones = mask.to(torch.int32).neg_()
    a, b = a.view(torch.int32), b.view(torch.int32)
    return (b ^ ((a ^ b) & ones)).view(torch.float32)


# XLA's float32 erf_inv (Giles 2010, "Approximating the erfinv function"): coefficients for
# w = -log1p(-x^2) < 5 and >= 5, highest power first, as float32 words.
_ERFINV_LT5 = tuple(map(_f32, (0x32F16588, 0x34B84B36, 0xB66C7357, 0xB6935AC1, 0x396532DB,
                               0xBAA45408, 0xBB88E4EF, 0x3E7C8F63, 0x3FC02E2F)))
_ERFINV_GE5 = tuple(map(_f32, (0xB951F09B, 0x38D3B56B, 0x3AB0DC72, 0xBB70BDE7, 0x3BBC127B,
                               0xBBF9C5D7, 0x3C1AA57E, 0x3F8036DB, 0x40354F7E)))
# Each coefficient is picked as ge5 + choose * (lt5 - ge5) in float64, choose 0 or 1: the difference
# of two float32 is exact in float64, so the pick is exactly lt5 or ge5.
_ERFINV_STEP = tuple(lt5 - ge5 for lt5, ge5 in zip(_ERFINV_LT5, _ERFINV_GE5))
assert all(ge5 + step == lt5 for lt5, ge5, step in zip(_ERFINV_LT5, _ERFINV_GE5, _ERFINV_STEP))


def _erfinv32(u: torch.Tensor) -> torch.Tensor:
    """erfinv of float32 `u` in [-1, 1] as XLA's CPU code computes it, multiply-adds fused."""
    log = _log1p32(u * -u)
    below = log > -5.0
    # torch's float32 sqrt is not correctly rounded on every CPU; float64's, rounded to float32, is.
    w = _select(below, -2.5 - log, torch.sqrt(-log.double()).float() - 3.0).double()
    choose = below.double()
    coefficient = lambda i: (choose * _ERFINV_STEP[i]).add_(_ERFINV_GE5[i])
    p = _fma(coefficient(0), w, coefficient(1))
    for i in range(2, 9):
        p = _fma(w, p, coefficient(i))
    return u * p.masked_fill_(u.abs() == 1.0, math.inf)


# XLA's float32 log (Cephes logf) and log1p (Cephes' rational form below |x| < sqrt(2) - 1).
_LOG_POLY = tuple((_f32(a), _f32(b), _f32(c)) for a, b, c in (
    (0x3D9021BB, 0xBDEBD1B8, 0x3DEF251A), (0xBDFE5D4F, 0x3E11E9BF, 0xBE2AAE50), (0x3E4CCEAC, 0xBE7FFFFC, 0x3EAAAAAA)))
# Numerator and denominator start at 4.527e-05 and 1 (as float32), then Horner steps in x.
_LOG1P_DEN = tuple(map(_f32, (0x3F800000, 0x417101AD, 0x42A6185B, 0x435DC32D, 0x439A8CA3, 0x43586D8A, 0x42707982)))
_LOG1P_NUM = tuple(map(_f32, (0x383DE04B, 0x3EFF40C5, 0x40D284FA, 0x41EF4B9C, 0x4273CC76, 0x426473AD, 0x41A05101)))


def _log1p32(x: torch.Tensor) -> torch.Tensor:
    """log1p of float32 `x` in [-1, 0] as XLA's CPU code computes it (x + 1 = 0 gives a finite
    value here, not -inf: erfinv's caller overrides that case)."""
    word = (x + 1.0).clamp_min_(_f32(0x00800000)).view(torch.int32)
    m = ((word & -2139095041) | 0x3F000000).view(torch.float32)  # mantissa in [0.5, 1)
    small = (m < _f32(0x3F3504F3)).float()
    t = (m - 1.0) + m * small  # m * small: m where small, else 0
    exponent = ((word >> 23) - 126).float() - small
    t2 = t * t
    t3 = (t2 * t).double()
    t64 = t.double()
    a, b, c = (_fma(t64, _fma(t64, p0, p1), p2) for p0, p1, p2 in _LOG_POLY)
    poly = _fma(t3, _fma(t3, _fma(t3, a, b), c), exponent * _f32(0xB95E8083))
    large = _fma(exponent, _f32(0x3F318000), (t - 0.5 * t2) + poly)
    x64 = x.double()
    den, num = _LOG1P_DEN[0], _LOG1P_NUM[0]
    for d, n in zip(_LOG1P_DEN[1:], _LOG1P_NUM[1:]):
        den, num = _fma(x64, den, d), _fma(x64, num, n)
    x2 = x * x
    near_zero = x + _fma(x2, -0.5, (x * x2) * (num / den))
    return _select(x.abs() < _f32(0x3ED413CD), near_zero, large)


_ERF_NUM = tuple(map(_f32, (0x39702D51, 0x3B5F5DA2, 0x3D50B6EB, 0x3E3DA740, 0x3F906EBA)))
_ERF_DEN = tuple(map(_f32, (0xB3FD3906, 0x37C588DF, 0x3A856D28, 0x3C6687D4, 0x3DE34C21, 0x3EFEB44A, 0x3F800000)))


def _erf32(x: torch.Tensor) -> torch.Tensor:
    """XLA's float32 erf (a rational function clamped to |x| < 3.744, with explicit FMAs)."""
    edge = _f32(0x406F9C68)
    xc = x.clamp(-edge, edge)
    x2 = xc * xc
    num = _fma(x2, _ERF_NUM[0], _ERF_NUM[1])
    for c in _ERF_NUM[2:]:
        num = _fma(num, x2, c)
    den = _fma(x2, _ERF_DEN[0], _ERF_DEN[1])
    for c in _ERF_DEN[2:]:
        den = _fma(den, x2, c)
    return torch.where(x.abs() >= edge, torch.copysign(torch.ones_like(x), x), (xc * num) / den)


# ---- blocks, chunks and checks -------------------------------------------------------------------


def _sample(name: str, key, shape, index, dtype: torch.dtype, kernel: Callable, *args) -> torch.Tensor:
    """`kernel(k0, k1, flat, *args)` over the flat indices of the block, one chunk at a time."""
    k0, k1 = _check_key(name, key)
    shape = _check_shape(name, shape)
    block, flat_indices = _block(name, shape, index)
    numel, device = math.prod(block), key.device
    # A traced graph holds the ops of one chunk; tracing numel / CHUNK copies of them helps no one.
    chunk = max(numel, 1) if _tracing() else CHUNK
    if numel <= chunk:
        return kernel(k0, k1, flat_indices(0, numel, device), *args).reshape(block)
    out = torch.empty(numel, dtype=dtype, device=device)
    done = 0
    if _COMPILE["enabled"] and numel >= COMPILE_CHUNK and _get_current_dispatch_mode() is None:
        while done + COMPILE_CHUNK <= numel:
            values = _compiled(kernel, k0, k1, flat_indices(done, done + COMPILE_CHUNK, device), args)
            if values is None:  # the kernel would not compile, or differed from the eager one
                break
            out[done:done + COMPILE_CHUNK] = values
            done += COMPILE_CHUNK
    for start in range(done, numel, chunk):
        stop = min(start + chunk, numel)
        out[start:stop] = kernel(k0, k1, flat_indices(start, stop, device), *args)
    return out.reshape(block)


def _tracing() -> bool:
    return get_proxy_mode() is not None or torch.compiler.is_compiling()


# ---- optional torch.compile ----------------------------------------------------------------------

COMPILE_CHUNK = 1 << 20  # elements per compiled call: one fused loop, so it can be larger
_COMPILE = {"enabled": False}
_COMPILED: dict = {}  # (kernel, static args) -> compiled kernel, or None: it failed or differed


def use_compile(enabled: bool = True) -> None:
    """Opt in (or out) to torch.compile'd kernels for values of at least `COMPILE_CHUNK` elements.

    Eager kernels run one torch op at a time over each chunk (some 300 for a normal): on a 2-core
    CPU, 10**8 float32 normals take 15-20x `torch.randn`'s time. Compiled, a chunk is one fused
    loop: about 2x (benchmarks/random.py measures both). Each kernel (per sampler and dtype) compiles on first use,
    which takes tens of seconds, and is checked bit for bit against the eager kernel on that first
    chunk; one that fails to compile or differs is never used, and the eager kernels stay the
    reference. Not used under a dispatch mode (such as `nf.simulate` outside a callback) or while
    tracing.
    """
    _COMPILE["enabled"] = bool(enabled)


def _compiled(kernel: Callable, k0, k1, flat, args) -> torch.Tensor | None:
    static = (kernel, tuple(a for a in args if not isinstance(a, torch.Tensor)))
    fn = _COMPILED.get(static, False)
    if fn is None:
        return None
    try:
        if fn is not False:
            return fn(k0, k1, flat, *args)
        fn = torch.compile(kernel, dynamic=False, fullgraph=True)
        values = fn(k0, k1, flat, *args)
        expected = kernel(k0, k1, flat, *args)
        same = values.dtype == expected.dtype and torch.equal(_as_bytes(values), _as_bytes(expected))
    except Exception:  # noqa: BLE001 - whatever keeps a kernel from compiling: stay eager
        fn, same = None, False
    _COMPILED[static] = fn if same else None
    return values if same else None


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.uint8)


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


def _check_key(name: str, key) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(key, torch.Tensor):
        raise TypeError(
            f"{name} expects a key tensor (from ndfunc.random.key, split or fold_in), got "
            f"{type(key).__name__} {key!r}; build one with key({key!r})."
            if isinstance(key, int) else
            f"{name} expects a key tensor (from ndfunc.random.key, split or fold_in), got {type(key).__name__}."
        )
    if key.shape != (2,) or key.dtype != torch.int64:
        hint = (" For keys from split, take one: keys[i]." if key.ndim > 1 and key.shape[-1] == 2 else
                " A JAX key converts with torch.tensor(jax.random.key_data(k).tolist())." if key.shape == (2,) else "")
        raise TypeError(
            f"{name} expects a key: an int64 tensor of shape (2,) holding two uint32 words, got a "
            f"tensor of shape {tuple(key.shape)} and dtype {key.dtype}.{hint}"
        )
    return key[0], key[1]


def _check_shape(name: str, shape, what: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    ok = isinstance(shape, (tuple, list, torch.Size)) and all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in shape
    )
    if not ok:
        raise TypeError(f"{name} expects {what} to be a tuple of non-negative ints, like (4, 8), got {shape!r}.")
    return tuple(int(d) for d in shape)


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
