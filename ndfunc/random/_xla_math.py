"""XLA's float32 erf_inv, log1p and erf, as its CPU code computes them, bit for bit.

XLA expands these functions into polynomials and its CPU code fuses their multiply-adds. Both are
reproduced here: the coefficients as the float32 words XLA rounds them to, and a fused multiply-add
as an exact float64 product, a float64 sum, then float32 (`fma`). That double rounding could differ
in the last bit; it did not in 3e8 such operations (10**7 normals).
"""

from __future__ import annotations

import math
import struct

import torch


def f32(word: int) -> float:
    """The float32 whose bits are `word` (XLA's constants, exactly as it rounds them)."""
    return struct.unpack("<f", struct.pack("<I", word))[0]


def fma(a: torch.Tensor, b, c) -> torch.Tensor:
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
_ERFINV_LT5 = tuple(map(f32, (0x32F16588, 0x34B84B36, 0xB66C7357, 0xB6935AC1, 0x396532DB,
                              0xBAA45408, 0xBB88E4EF, 0x3E7C8F63, 0x3FC02E2F)))
_ERFINV_GE5 = tuple(map(f32, (0xB951F09B, 0x38D3B56B, 0x3AB0DC72, 0xBB70BDE7, 0x3BBC127B,
                              0xBBF9C5D7, 0x3C1AA57E, 0x3F8036DB, 0x40354F7E)))
# Each coefficient is picked as ge5 + choose * (lt5 - ge5) in float64, choose 0 or 1: the difference
# of two float32 is exact in float64, so the pick is exactly lt5 or ge5.
_ERFINV_STEP = tuple(lt5 - ge5 for lt5, ge5 in zip(_ERFINV_LT5, _ERFINV_GE5))
assert all(ge5 + step == lt5 for lt5, ge5, step in zip(_ERFINV_LT5, _ERFINV_GE5, _ERFINV_STEP))


def erfinv32(u: torch.Tensor) -> torch.Tensor:
    """erfinv of float32 `u` in [-1, 1] as XLA's CPU code computes it, multiply-adds fused."""
    log = _log1p32(u * -u)
    below = log > -5.0
    # torch's float32 sqrt is not correctly rounded on every CPU; float64's, rounded to float32, is.
    w = _select(below, -2.5 - log, torch.sqrt(-log.double()).float() - 3.0).double()
    choose = below.double()
    coefficient = lambda i: (choose * _ERFINV_STEP[i]).add_(_ERFINV_GE5[i])
    p = fma(coefficient(0), w, coefficient(1))
    for i in range(2, 9):
        p = fma(w, p, coefficient(i))
    return u * p.masked_fill_(u.abs() == 1.0, math.inf)


# XLA's float32 log (Cephes logf) and log1p (Cephes' rational form below |x| < sqrt(2) - 1).
_LOG_POLY = tuple((f32(a), f32(b), f32(c)) for a, b, c in (
    (0x3D9021BB, 0xBDEBD1B8, 0x3DEF251A), (0xBDFE5D4F, 0x3E11E9BF, 0xBE2AAE50), (0x3E4CCEAC, 0xBE7FFFFC, 0x3EAAAAAA)))
# Numerator and denominator start at 4.527e-05 and 1 (as float32), then Horner steps in x.
_LOG1P_DEN = tuple(map(f32, (0x3F800000, 0x417101AD, 0x42A6185B, 0x435DC32D, 0x439A8CA3, 0x43586D8A, 0x42707982)))
_LOG1P_NUM = tuple(map(f32, (0x383DE04B, 0x3EFF40C5, 0x40D284FA, 0x41EF4B9C, 0x4273CC76, 0x426473AD, 0x41A05101)))


def _log1p32(x: torch.Tensor) -> torch.Tensor:
    """log1p of float32 `x` in [-1, 0] as XLA's CPU code computes it (x + 1 = 0 gives a finite
    value here, not -inf: erfinv's caller overrides that case)."""
    word = (x + 1.0).clamp_min_(f32(0x00800000)).view(torch.int32)
    m = ((word & -2139095041) | 0x3F000000).view(torch.float32)  # mantissa in [0.5, 1)
    small = (m < f32(0x3F3504F3)).float()
    t = (m - 1.0) + m * small  # m * small: m where small, else 0
    exponent = ((word >> 23) - 126).float() - small
    t2 = t * t
    t3 = (t2 * t).double()
    t64 = t.double()
    a, b, c = (fma(t64, fma(t64, p0, p1), p2) for p0, p1, p2 in _LOG_POLY)
    poly = fma(t3, fma(t3, fma(t3, a, b), c), exponent * f32(0xB95E8083))
    large = fma(exponent, f32(0x3F318000), (t - 0.5 * t2) + poly)
    x64 = x.double()
    den, num = _LOG1P_DEN[0], _LOG1P_NUM[0]
    for d, n in zip(_LOG1P_DEN[1:], _LOG1P_NUM[1:]):
        den, num = fma(x64, den, d), fma(x64, num, n)
    x2 = x * x
    near_zero = x + fma(x2, -0.5, (x * x2) * (num / den))
    return _select(x.abs() < f32(0x3ED413CD), near_zero, large)


_ERF_NUM = tuple(map(f32, (0x39702D51, 0x3B5F5DA2, 0x3D50B6EB, 0x3E3DA740, 0x3F906EBA)))
_ERF_DEN = tuple(map(f32, (0xB3FD3906, 0x37C588DF, 0x3A856D28, 0x3C6687D4, 0x3DE34C21, 0x3EFEB44A, 0x3F800000)))


def erf32(x: torch.Tensor) -> torch.Tensor:
    """XLA's float32 erf (a rational function clamped to |x| < 3.744, with explicit FMAs)."""
    edge = f32(0x406F9C68)
    xc = x.clamp(-edge, edge)
    x2 = xc * xc
    num = fma(x2, _ERF_NUM[0], _ERF_NUM[1])
    for c in _ERF_NUM[2:]:
        num = fma(num, x2, c)
    den = fma(x2, _ERF_DEN[0], _ERF_DEN[1])
    for c in _ERF_DEN[2:]:
        den = fma(den, x2, c)
    return torch.where(x.abs() >= edge, torch.copysign(torch.ones_like(x), x), (xc * num) / den)
