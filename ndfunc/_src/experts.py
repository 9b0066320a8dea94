"""A mixture of experts' experts as one op per call, split by the tokens.

transformers calls the experts of a mixture-of-experts layer (a class decorated with
`use_experts_implementation`: Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss, ...) as one function of
`(hidden_states (tokens, dim), top_k_index (tokens, k), top_k_weights (tokens, k))`, picked from its
`ExpertsInterface` by `config._experts_implementation`: grouped matmuls (its default), batched
matmuls, or the layer's own loop ('eager'). Each token's result reads its own row and the experts'
weights only, but traced op by op the call is a sort of every token by expert and offsets counted
from it: values, which no layout splits. So every rank ran every token's experts (grouped, the
offsets whole), held a copy of an expert's weights per token (batched), or raised DataDependentError
(the loop's `torch.where`).

While a step is traced, the call is one `ndfunc::experts`, made at run time by the implementation
the model asked for, on each rank's own tokens (its offsets its own); `ndfunc::experts_backward` is
its gradient, the forward made again under autograd (nothing is kept between the two but the
inputs, at the price of a second forward, as `ndfunc::rnn`'s). Both split by the tokens with the
weights whole (FSDP gathers them as any other); the weights' gradients are then each rank's sum over
its own tokens, pending, and the routing weights' follow their tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import itertools
import threading
import weakref
from collections.abc import Callable

import torch

from ndfunc._src import swaps
from ndfunc._src.contexts import set_within
from ndfunc._src.opaque import opaque_op, recomputed_gradients

# A traced experts call by the name its ops carry: the module (while it lives), its parameters' names
# as the call's own module names them, and that module: the implementation its interface picked
# over a copy of the experts module made when traced (its attributes, which may differ layer by
# layer, as they were; its parameters the op's, swapped in at run time, so a layer traced once for
# every layer alike, `repeated_layers`, stands for them all). A name is the class's and a count of
# the calls named in the process, in the order met: the same on every rank tracing the same steps
# (the ranks check that they run one program)
_LAYERS: dict[str, tuple[weakref.ref, tuple[str, ...], torch.nn.Module]] = {}
_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> implementation -> its name
_COUNT = itertools.count()
_NAMING = threading.Lock()
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("ndfunc_experts_traced", default=False)


class _Implemented(torch.nn.Module):
    """An experts module called through the implementation its interface picked, not through its
    `forward`: a subclass's forward around the decorated one (transformers' Ergo scales the
    experts' output) stays outside the op, traced as it is, and is not made again inside."""

    def __init__(self, experts: torch.nn.Module, implementation: Callable):
        super().__init__()
        self.experts, self.implementation = experts, implementation

    def forward(self, hidden, index, weights):
        return self.implementation(self.experts, hidden, index, weights)


def _run(layer: str, hidden, index, weights, params) -> torch.Tensor:
    """The experts call the step was traced with (the implementation its config names) on these
    tensors, the module's parameters `params`."""
    ref, names, call = _LAYERS.get(layer, (lambda: None, (), None))
    if ref() is None:
        raise RuntimeError(f"ndfunc::experts: the experts module {layer} this step was traced with is gone (its "
                           f"model freed); keep the model a step was traced from alive while the step runs.")
    token = _TRACING.set(False)  # (a program run while another step is traced: the call itself)
    try:
        return torch.func.functional_call(call, dict(zip(names, params)), (hidden, index, weights))
    finally:
        _TRACING.reset(token)


def _own_tensors(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with its own parameter and buffer tables (the rest shared): the op's tensors are
    swapped into those, and the model itself, perhaps run eagerly in another thread, keeps its own."""
    copied = copy.copy(module)
    copied._parameters, copied._buffers = dict(module._parameters), dict(module._buffers)
    copied._modules = {name: None if sub is None else _own_tensors(sub) for name, sub in module._modules.items()}
    return copied


def _run_backward(layer: str, grad, hidden, index, weights, params, wanted) -> list[torch.Tensor]:
    """The gradients of `_run`'s result `grad` to those of [hidden, weights, *params] `wanted`
    says (a frozen expert's weights get none): the forward made again, under autograd."""
    return recomputed_gradients(lambda leaves: _run(layer, leaves[0], index, leaves[1], leaves[2:]),
                                (hidden, weights, *params), grad, wanted)


class _Experts(torch.autograd.Function):
    """`ndfunc::experts` with `ndfunc::experts_backward` as its gradient (a Function: torch.func's
    transforms trace through it); its tensors flat: hidden, index, weights, then the parameters."""

    @staticmethod
    def forward(layer, hidden, index, weights, *params):
        return experts_op(layer, hidden, index, weights, list(params))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layer, *tensors = inputs
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx, grad):
        hidden, index, weights, *params = ctx.saved_tensors
        _, wants_hidden, _, wants_weights, *wants_params = ctx.needs_input_grad
        wanted = [wants_hidden, wants_weights, *wants_params]
        made = iter(experts_backward_op(ctx.layer, grad, hidden, index, weights, list(params), wanted))
        hidden_grad, weights_grad, *params_grads = (next(made) if w else None for w in wanted)
        return None, hidden_grad, None, weights_grad, *params_grads


def _traced(implementation, module, *args, **kwargs):
    """An experts call while a step is traced: one `ndfunc::experts` where it has the interface's
    arguments (else `implementation`, op by op)."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    if len(args) + len(kwargs) != 3 or any(k not in names[len(args):] for k in kwargs):
        return implementation(module, *args, **kwargs)
    hidden, index, weights = (*args, *(kwargs[k] for k in names[len(args):]))
    named = list(module.named_parameters())
    if (hidden.dim() != 2 or index.dim() != 2 or weights.shape != index.shape or index.shape[0] != hidden.shape[0]
            or index.is_floating_point() or not named):
        return implementation(module, *args, **kwargs)
    layer = _name_of(module, implementation, tuple(n for n, _ in named))
    return _Experts.apply(layer, hidden, index, weights, *(p for _, p in named))


def _name_of(module: torch.nn.Module, implementation: Callable, names: tuple[str, ...]) -> str:
    """The name of `module` called through `implementation` (`_LAYERS`), its entry made the first
    time and dropped with the module."""
    with _NAMING:
        by_implementation = _NAMES.setdefault(module, {})
        layer = by_implementation.get(implementation)
        if layer is None:
            layer = by_implementation[implementation] = f"{type(module).__qualname__}:{next(_COUNT)}"
            _LAYERS[layer] = (weakref.ref(module, lambda _, layer=layer: _LAYERS.pop(layer, None)),
                              tuple(f"experts.{n}" for n in names), _Implemented(_own_tensors(module), implementation))
        return layer


def traced() -> contextlib.AbstractContextManager:
    """Inside, a transformers experts call is one `ndfunc::experts` (in this thread and context, with
    `swaps.swapped()`, as the tracer enters both)."""
    return set_within(_TRACING)


@swaps.register("transformers.integrations.moe:ExpertsInterface", "get_interface")  # (ndfunc never imports it)
def _routed_when_traced(theirs: Callable) -> Callable:
    """transformers' `ExpertsInterface.get_interface`, its implementation called through `_traced`
    while `_TRACING`."""
    def get_interface(self, experts_implementation, default):
        found = theirs(self, experts_implementation, default)
        return functools.partial(_traced, found) if _TRACING.get() else found

    return get_interface


def token_dims(node: torch.fx.Node) -> tuple[list, list]:
    """For a node of `ndfunc::experts` or its backward: (the token dim of each tensor output, of
    each tensor input; None for a parameter or its gradient)."""
    if node.target is experts_backward_op:
        params, wanted = node.args[5:7]
        made = [d for d, w in zip((0, 0, *[None] * len(params)), wanted) if w]
        return made, [0, 0, 0, 0, *[None] * len(params)]
    return [0], [0, 0, 0, *[None] * len(node.args[4])]


def flops(node: torch.fx.Node) -> int:
    """Each token's k experts' matmuls: 2 flops per weight element of one expert (a parameter's
    first dim counts the experts), per token and pick; its backward three times that (the forward
    made again, then two products per weight)."""
    backward = node.target is experts_backward_op
    index, params = (node.args[3], node.args[5]) if backward else (node.args[2], node.args[4])
    picks = index.meta["val"].numel()
    per_expert = sum(p.meta["val"].numel() // p.meta["val"].shape[0] for p in params if p.meta["val"].dim() >= 3)
    return 2 * picks * per_expert * (3 if backward else 1)


# output; hidden, index, weights, *params
_ops = opaque_op(
    "experts", "(str layer, Tensor hidden, Tensor index, Tensor weights, Tensor[] params) -> Tensor",
    "(str layer, Tensor grad, Tensor hidden, Tensor index, Tensor weights, Tensor[] params, bool[] wanted) -> Tensor[]",
    run=_run, run_backward=_run_backward, fake=lambda layer, hidden, *_: torch.empty_like(hidden),
    fake_backward=lambda layer, grad, hidden, index, weights, params, wanted: [
        torch.empty_like(t) for t, w in zip((hidden, weights, *params), wanted) if w],
    dims=token_dims, flops=flops)
experts_op, experts_backward_op = _ops.forward, _ops.backward
