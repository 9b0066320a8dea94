"""The Threefry-2x32 hash, and keys built from it as JAX builds them: `key`, `split`, `fold_in`.

A key is an int64 tensor of shape (2,) holding two uint32 words `[k0, k1]`, each in [0, 2**32).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

_MASK = 0xFFFFFFFF
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k0: torch.Tensor, k1: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor):
    """Threefry-2x32, 20 rounds (Salmon et al., SC'11), exactly as JAX's `threefry2x32_p`.

    Every argument holds uint32 words in int64; `k0`, `k1` broadcast against the counter words
    `x0`, `x1`. Returns the two output words, each masked to [0, 2**32).
    """
    if not torch.compiler.is_dynamo_compiling() and get_proxy_mode() is not None:  # traced: one node (_op.py)
        from ndfunc.random._op import threefry_op

        return threefry_op(k0, k1, x0, x1)
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


def hash_flat(k0, k1, flat: torch.Tensor):
    """The two threefry words of each flat index (JAX's iota_2x32_shape: hi and lo halves)."""
    return threefry2x32(k0, k1, flat >> 32, flat & _MASK)


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
    k0, k1 = check_key("split", key)
    shape = (num,) if isinstance(num, numbers.Integral) and not isinstance(num, bool) else num
    shape = check_shape("split", shape, what="num")
    flat = torch.arange(math.prod(shape), dtype=torch.int64, device=key.device)
    return torch.stack(hash_flat(k0, k1, flat), dim=-1).reshape(*shape, 2)


def fold_in(key: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """A new key from `key` and a 32-bit integer, as `jax.random.fold_in`.

    `data` is a Python int in [0, 2**32) or a 0-d integer tensor (taken modulo 2**32, as JAX does
    for arrays). Typical use: one key per layer or per step, `fold_in(key, layer)`.

    Example:
        >>> from ndfunc import random as nfr
        >>> nfr.fold_in(nfr.key(42), 7)
        tensor([2547012911, 1371500959])
    """
    k0, k1 = check_key("fold_in", key)
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


def check_key(name: str, key) -> tuple[torch.Tensor, torch.Tensor]:
    """The two words of `key`, or an error naming `name` (the caller) that says how to build one."""
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


def check_shape(name: str, shape, what: str = "shape") -> tuple[int, ...]:
    """`shape` (an int or a sequence of non-negative ints) as a tuple of ints."""
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    ok = isinstance(shape, (tuple, list, torch.Size)) and all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in shape
    )
    if not ok:
        raise TypeError(f"{name} expects {what} to be a tuple of non-negative ints, like (4, 8), got {shape!r}.")
    return tuple(int(d) for d in shape)
