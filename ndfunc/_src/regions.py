"""Marks for a function called many times on the same shapes (a layer, an optimizer's per-leaf math).

Under `nf.jit`'s tracer (`routed`), a call of a marked function goes to the tracer's
`Stamps.call` (`ndfunc._src.stamp`): traced once per signature, copied at every call. Two marks:
PyTorch's `torch.compiler.nested_compile_region` (what a model author writes: eager it is a plain
call, torch.compile compiles the region once) and ndfunc's `repeated`, a plain call everywhere else,
so eager and torch.compile see the function as it is. `nf.optim` marks its per-leaf updates with
`repeated`: a model's parameters share a handful of shapes, and a per-leaf region in torch.compile
would be a compiled region per shape.
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
        if torch.compiler.is_dynamo_compiling():  # (Dynamo reads no context variable)
            return fn(*args, **kwargs)
        call = _CALL.get()
        return fn(*args, **kwargs) if call is None else call(fn, args, kwargs)

    return marked


@contextlib.contextmanager
def routed(call: Callable):
    """Inside (this thread, this context), a marked call is `call(fn, args, kwargs)`."""
    torch_compat.route_nested_compile_regions(_CALL.get)
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)
