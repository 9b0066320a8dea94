"""Custom ops' registered gradients, and old-style `autograd.Function`s, under `torch.func`.

A `torch.library.custom_op` with a gradient registered for it (`torch.library.register_autograd`:
transformers' grouped matmul of a mixture of experts, a kernel library's fused op) differentiates
under plain autograd, but torch.func refuses the `autograd.Function` torch makes of it (it has no
`setup_context`), and `nf.value_and_grad` is torch.func's: the step raised. While a step is traced
under a gradient, such an op is called through a Function that has one, made of the same
registered pieces (`call`); it is then the op in the program, as any op. One gradient only: its
backward is no Function's forward (under a gradient of a gradient, torch.func's own refusal).

An `autograd.Function` written the old way (`forward(ctx, *args)`, no `setup_context`: BLOOM's
GeLU, RecurrentGemma's square root) is refused by torch.func as well. While a step is traced
(`accepting_old_functions`), one is applied as a Function of the new form made of its own
pieces (`_new_style`): its forward run with a stand-in context that records what it saves and
sets, replayed onto the real context by `setup_context`. torch's `Function.apply` is a classmethod
whose function a model's module may hold already (`gelu = GeLUFunction.apply`, bound at its
import), so inside `swaps.swapped()` that function's code is swapped (`_diverting`), not the
attribute: every name bound to it reaches `applied`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import types

import torch

from ndfunc._src import swaps, torch_compat

_OURS = ("aten", "prims", "ndfunc")


def registered(func) -> tuple | None:
    """(schema, backward, setup_context) of `func` (an op of `torch.ops`) where it is a custom op
    with a gradient registered (`torch_compat.registered_gradient`); else None. A few lookups: the
    tracer asks it of every call."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        name = func._qualified_op_name
    elif isinstance(func, torch._ops.OpOverload):
        name = func._name
    else:
        return None
    if name.split("::", 1)[0] in _OURS:
        return None
    found = torch_compat.registered_gradient(name)
    if found is None or any(isinstance(a.type, torch.ListType) for a in found[0].arguments):
        return None  # (a list of tensors: torch's own Function, which torch.func refuses, as before)
    return found


def call(func, definition: tuple, args: tuple, kwargs: dict):
    """`func(*args, **kwargs)` through `_Registered` (`definition`: `registered`'s): its arguments
    read as the dispatcher reads them (those before the keyword-only ones positional, however they
    were passed)."""
    schema = definition[0]
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
        ctx._ndfunc_backward, setup = definition[1:]
        if setup is None:  # (a gradient that reads nothing saved)
            return
        if keywords:
            setup(ctx=ctx, inputs=tuple(args), keyword_only_inputs=keywords, output=output)
        else:
            setup(ctx=ctx, inputs=tuple(args), output=output)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[3:]  # (as the op's own Function shows its backward: the op's inputs)
        try:
            with torch.no_grad():  # (one gradient only: a custom op its backward calls is called as in plain autograd)
                found = ctx._ndfunc_backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (None, None, None, *(found if isinstance(found, tuple) else (found,)))


_ACCEPTING = contextvars.ContextVar("ndfunc_old_functions", default=False)


@contextlib.contextmanager
def accepting_old_functions():
    """Inside (this thread, this context; with `swaps.swapped()`, as the tracer enters both), an
    old-style Function applied under a torch.func transform is applied as `_new_style` of it;
    elsewhere `Function.apply` does what torch's does."""
    token = _ACCEPTING.set(True)
    try:
        yield
    finally:
        _ACCEPTING.reset(token)


_APPLY = torch.autograd.Function.__dict__["apply"].__func__  # the function `MyFunction.apply` calls
_torchs_apply = types.FunctionType(_APPLY.__code__, _APPLY.__globals__, _APPLY.__name__, _APPLY.__defaults__,
                                   _APPLY.__closure__)  # torch's, kept to call while its code is swapped


def applied(cls, *args, **kwargs):
    """`cls.apply(*args, **kwargs)` inside `swaps.swapped()`: torch's, but for an old-style Function
    under a gradient inside `accepting_old_functions`."""
    if (_ACCEPTING.get() and torch_compat.func_transforms_active() and not torch_compat.has_setup_context(cls)
            and torch_compat.func_transforms() == ["Grad"]):
        return _new_style(cls).apply(*args, **kwargs)  # (one gradient: what it saves is no constant)
    return _torchs_apply(cls, *args, **kwargs)


class _Diverting:
    def apply(cls, *args, **kwargs):
        """Its code runs as `_APPLY`'s, among torch's module's globals: it imports what it calls."""
        __class__  # noqa: B018 - a code object swapped in has torch's one free variable (its `super()`'s class)
        from ndfunc._src.custom_gradients import applied

        return applied(cls, *args, **kwargs)


@swaps.register(_APPLY, "__code__")
def _diverting(torchs: types.CodeType) -> types.CodeType:
    return _Diverting.apply.__code__


class _Recorded:
    """A stand-in for an old-style forward's context: what it saves, marks and sets, and what it
    reads back of that (`needs_input_grad`: every tensor's, as under a gradient)."""

    def __init__(self, args: tuple):
        object.__setattr__(self, "saved", None)
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "attributes", {
            "needs_input_grad": tuple(isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())
                                      for a in args)})

    def save_for_backward(self, *tensors):
        object.__setattr__(self, "saved", tensors)

    def mark_non_differentiable(self, *tensors):
        self.calls.append(("mark_non_differentiable", tensors))

    def mark_dirty(self, *tensors):
        self.calls.append(("mark_dirty", tensors))

    def set_materialize_grads(self, value):
        self.calls.append(("set_materialize_grads", (value,)))

    def __setattr__(self, name, value):
        self.attributes[name] = value

    def __getattr__(self, name):
        try:
            return self.attributes[name]
        except KeyError:
            raise AttributeError(name) from None


_LAST = threading.local()  # the record of the forward that ran last here (its setup_context follows)


@functools.cache
def _new_style(cls) -> type[torch.autograd.Function]:
    """`cls` (an old-style Function) as a Function with `setup_context`: the same forward and
    backward; the tensors its forward saved, where they are its inputs or its output, saved as
    `setup_context` sees those."""

    def forward(*args):
        ctx = _Recorded(args)
        out = cls.forward(ctx, *args)
        _LAST.record = (ctx, args, out)
        return out

    def setup_context(ctx, inputs, output):
        record, args, out = _LAST.record  # (kept: under a transform each level's Function sets its context)
        for name, value in record.attributes.items():
            if name != "needs_input_grad":  # (the context's own)
                setattr(ctx, name, value)
        outs = out if isinstance(out, tuple) else (out,)
        given = output if isinstance(output, tuple) else (output,)

        def as_seen(t):  # (an input or an output of the forward: the one setup_context sees)
            for mine, theirs in ((args, inputs), (outs, given)):
                for a, b in zip(mine, theirs):
                    if t is a:
                        return b
            return t
        for method, tensors in record.calls:
            getattr(ctx, method)(*(as_seen(t) for t in tensors))
        if record.saved is not None:
            ctx.save_for_backward(*(as_seen(t) for t in record.saved))

    return type(f"{cls.__name__}NewStyle", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(lambda ctx, *grads: cls.backward(ctx, *grads))})

