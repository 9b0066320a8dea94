"""Marks for a function called many times on the same shapes (a layer, an optimizer's per-leaf math).

Under `nf.jit`'s tracer (`routed`), a call of a marked function goes to the tracer's
`Stamps.call` (`ndfunc._src.stamp`): traced once per signature, copied at every call. Two marks:
PyTorch's `torch.compiler.nested_compile_region` (what a model author writes: eager it is a plain
call, torch.compile compiles the region once) and ndfunc's `repeated`, a plain call everywhere else,
so eager and torch.compile see the function as it is. `nf.optim` marks its per-leaf updates with
`repeated`: a model's parameters share a handful of shapes, and a per-leaf region in torch.compile
would be a compiled region per shape. Unmarked, a model's `ModuleList` layers that are alike are
routed here too when called through `nf.nn.functional` (`ndfunc._src.repeated_layers`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Any

import torch

from ndfunc._src import torch_compat

_CALL: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("ndfunc_region_call", default=None)


def repeated(fn: Callable) -> Callable:
    """`fn`, marked: under `nf.jit`'s tracer, traced once per signature and copied at each call."""
    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        call = current_call()
        return fn(*args, **kwargs) if call is None else call(fn, args, kwargs)

    return marked


PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)  # values a region may take and give as they are


def current_call() -> Callable | None:
    """Where a marked call goes here (`routed`): `Stamps.call` under `nf.jit`'s tracer, else None."""
    if torch.compiler.is_dynamo_compiling():  # (Dynamo reads no context variable)
        return None
    return _CALL.get()


torch_compat.route_nested_compile_regions(_CALL.get)  # (inside `swaps.swapped()`, as the tracer enters it)


@contextlib.contextmanager
def routed(call: Callable):
    """Inside (this thread, this context; with `swaps.swapped()` for PyTorch's mark), a marked call
    is `call(fn, args, kwargs)`."""
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)
