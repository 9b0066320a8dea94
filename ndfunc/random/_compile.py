"""Opt-in torch.compile'd sampling kernels, checked bit for bit against the eager ones.

The eager kernels stay the reference: a kernel is compiled once per sampler and static arguments,
compared with the eager kernel on its first chunk, and never used again if it fails or differs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# The package, for `COMPILE_CHUNK`: read at each call, so setting `ndfunc.random.COMPILE_CHUNK` works.
from ndfunc import random as nfr
from ndfunc._src.torch_compat import current_dispatch_mode

_COMPILE = {"enabled": False}
_COMPILED: dict = {}  # (kernel, static args) -> compiled kernel, or None: it failed or differed


def use_compile(enabled: bool = True) -> None:
    """Opt in (or out) to torch.compile'd kernels for values of at least `COMPILE_CHUNK` elements.

    Eager kernels run one torch op at a time over each chunk (some 300 for a normal): on a 2-core
    CPU, 10**8 float32 normals take 15-20x `torch.randn`'s time. Compiled, a chunk is one fused
    loop: about 2x (benchmarks/rng.py measures both). Each kernel (per sampler and dtype) compiles on first use,
    which takes tens of seconds, and is checked bit for bit against the eager kernel on that first
    chunk; one that fails to compile or differs is never used, and the eager kernels stay the
    reference. Not used under a dispatch mode (such as `nf.simulate` outside a callback) or while
    tracing.
    """
    _COMPILE["enabled"] = bool(enabled)


def compiled_chunks(out: torch.Tensor, kernel: Callable, k0, k1, flat_indices: Callable, args, device) -> int:
    """Fill `out` from its start with compiled chunks of `COMPILE_CHUNK` values, if compiling is on
    and `out` holds at least one chunk. Returns how many values were written: the caller computes
    the rest eagerly."""
    numel = out.numel()
    done = 0
    if _COMPILE["enabled"] and numel >= nfr.COMPILE_CHUNK and current_dispatch_mode() is None:
        while done + nfr.COMPILE_CHUNK <= numel:
            values = _compiled(kernel, k0, k1, flat_indices(done, done + nfr.COMPILE_CHUNK, device), args)
            if values is None:  # the kernel would not compile, or differed from the eager one
                break
            out[done:done + nfr.COMPILE_CHUNK] = values
            done += nfr.COMPILE_CHUNK
    return done


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
