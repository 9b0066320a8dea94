"""Custom ops' registered gradients under `torch.func`.

A `torch.library.custom_op` with a gradient registered for it (`torch.library.register_autograd`:
transformers' grouped matmul of a mixture of experts, a kernel library's fused op) differentiates
under plain autograd, but torch.func refuses the `autograd.Function` torch makes of it (it has no
`setup_context`), and `nf.value_and_grad` is torch.func's: the step raised. While a step is traced
under a gradient, such an op is called through a Function that has one, made of the same
registered pieces (`call`); it is then the op in the program, as any op. One gradient only: its
backward is no Function's forward (under a gradient of a gradient, torch.func's own refusal).
"""

from __future__ import annotations

import torch
from torch._library.custom_ops import OPDEFS, CustomOpDef

_OURS = ("aten", "prims", "ndfunc")


def registered(func) -> CustomOpDef | None:
    """The definition of `func` (an op of `torch.ops`) where it is a custom op with a gradient
    registered; else None. A few lookups: the tracer asks it of every call."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        name = func._qualified_op_name
    elif isinstance(func, torch._ops.OpOverload):
        name = func._name
    else:
        return None
    if name.split("::", 1)[0] in _OURS:
        return None
    found = OPDEFS.get(name)
    return found if found is not None and found._backward_fn is not None else None


def call(func, definition: CustomOpDef, args: tuple, kwargs: dict):
    """`func(*args, **kwargs)` through `_Registered`: its arguments read as the dispatcher reads
    them (those before the keyword-only ones positional, however they were passed)."""
    schema = definition._opoverload._schema
    given = list(args)
    positional, keywords = [], {}
    for i, a in enumerate(schema.arguments):
        value = given[i] if i < len(given) else kwargs.get(a.name, a.default_value)
        if a.kwarg_only:
            keywords[a.name] = value
        else:
            positional.append(value)
    return _Registered.apply(func, definition, keywords, *positional)


class _Registered(torch.autograd.Function):
    """A custom op, its registered `setup_context` and backward as a Function's (the leading three
    inputs are the op, its definition and its keyword-only arguments: no gradient)."""

    @staticmethod
    def forward(func, definition, keywords, *args):
        return func(*args, **keywords)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, definition, keywords, *args = inputs
        ctx.definition = definition
        if keywords:
            definition._setup_context_fn(ctx=ctx, inputs=tuple(args), keyword_only_inputs=keywords, output=output)
        else:
            definition._setup_context_fn(ctx=ctx, inputs=tuple(args), output=output)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[3:]  # (as the op's own Function shows its backward: the op's inputs)
        try:
            with torch.no_grad():  # (one gradient only: a custom op its backward calls is called as in plain autograd)
                found = ctx.definition._backward_fn(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (None, None, None, *(found if isinstance(found, tuple) else (found,)))
