"""Building blocks, optax's: each a `GradientTransformation` that does one thing to the updates.

Every update is a select/arithmetic expression over tensors (no `.item()`, no branch on a value),
so `make_fx` traces it; step counts live in the state as int32 tensors.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from ndfunc._src.regions import repeated as leafwise  # under nf.jit: traced once per leaf shape, copied
from ndfunc.optim._base import (
    EmptyState,
    GradientTransformation,
    PyTree,
    Schedule,
    check_same_structure,
    require_params,
    safe_increment,
    zeros_count,
)
from ndfunc.tree import tree_broadcast_prefix

ScalarOrSchedule = float | torch.Tensor | Schedule


class ScaleByScheduleState(NamedTuple):
    """`scale_by_schedule`'s state: how many updates it has scaled."""

    count: torch.Tensor  # int32, 0-dim: updates seen so far


class TraceState(NamedTuple):
    """`trace`'s state: the running momentum, laid out as the parameters."""

    trace: PyTree


class ScaleByAdamState(NamedTuple):
    """`scale_by_adam`'s state: the step count and both moments, laid out as the parameters."""

    count: torch.Tensor  # int32, 0-dim: updates seen so far
    mu: PyTree  # first moment, like params
    nu: PyTree  # second moment, like params


ScaleState = EmptyState
AddDecayedWeightsState = EmptyState
ClipByGlobalNormState = EmptyState


def _times(value: Any, g: torch.Tensor) -> torch.Tensor:
    # A 0-dim tensor factor (a scheduled learning rate) is cast to the leaf's dtype: every leaf
    # keeps its own dtype whatever the schedule computes in.
    return g * (value.to(g.dtype) if isinstance(value, torch.Tensor) else value)


_scaled = leafwise(_times)  # (a factor the step did not compute, a tensor closed over: op by op)


def _check_scalar(value: Any, name: str, example: str = "1e-3") -> None:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return
        got = f"a tensor of shape {tuple(value.shape)}"
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        return
    else:
        got = f"a {type(value).__name__}"
    raise TypeError(
        f"{name} must be a number or a 0-dim tensor, got {got}; pass e.g. {example}."
    )


def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Multiply every update by a fixed `step_size`.

    Example:
        >>> from ndfunc import optim
        >>> optim.scale(-2.0).update(torch.ones(2), optim.EmptyState())[0]
        tensor([-2., -2.])
    """
    _check_scalar(step_size, "step_size")

    def init(params):
        del params
        return ScaleState()

    def update(updates, state, params=None):
        del params
        return optree.tree_map(lambda g: _scaled(step_size, g), updates), state

    return GradientTransformation(init, update)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply the updates by `step_size_fn(count)`, `count` the number of earlier updates.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.scale_by_schedule(optim.linear_schedule(1.0, 0.0, transition_steps=4))
        >>> state = opt.init(torch.zeros(1))
        >>> for _ in range(3):
        ...     updates, state = opt.update(torch.ones(1), state)
        >>> updates, state.count
        (tensor([0.5000]), tensor(3, dtype=torch.int32))
    """
    if not callable(step_size_fn):
        raise TypeError(f"step_size_fn must be a function of the step count, got "
                        f"{type(step_size_fn).__name__}; for a fixed factor use optim.scale.")

    def init(params):
        return ScaleByScheduleState(count=zeros_count(params))

    def update(updates, state, params=None):
        del params
        step_size = step_size_fn(state.count)
        updates = optree.tree_map(lambda g: _scaled(step_size, g), updates)
        return updates, ScaleByScheduleState(count=safe_increment(state.count))

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True
                           ) -> GradientTransformation:
    """Scale by `-learning_rate` (by `learning_rate` if `flip_sign=False`): a fixed number or
    0-dim tensor becomes `scale`, a schedule becomes `scale_by_schedule`.

    Example:
        >>> from ndfunc import optim
        >>> optim.scale_by_learning_rate(0.1).update(torch.ones(2), optim.EmptyState())[0]
        tensor([-0.1000, -0.1000])
    """
    sign = -1 if flip_sign else 1
    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    _check_scalar(learning_rate, "learning_rate (unless a schedule, a function of the step count)",
                  "3e-4 or optim.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 1000)")
    return scale(sign * learning_rate)


def trace(decay: float, nesterov: bool = False, accumulator_dtype: torch.dtype | None = None
          ) -> GradientTransformation:
    """Momentum: `trace = updates + decay * trace`; returns `trace`, or with `nesterov=True`
    `updates + decay * trace` (the new trace). `torch.optim.SGD`'s buffer with `dampening=0`.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.trace(0.5)
        >>> state = opt.init(torch.zeros(1))
        >>> _, state = opt.update(torch.ones(1), state)
        >>> opt.update(torch.ones(1), state)[0]
        tensor([1.5000])
    """

    def init(params):
        return TraceState(trace=optree.tree_map(
            lambda p: torch.zeros_like(p, dtype=accumulator_dtype), params))

    def update(updates, state, params=None):
        del params
        check_same_structure(state.trace, updates, "the momentum state", "updates",
                             "pass gradients shaped like the params given to init")
        new_trace = optree.tree_map(lambda g, t: g + decay * t.to(g.dtype), updates, state.trace)
        if nesterov:
            updates = optree.tree_map(lambda g, t: g + decay * t, updates, new_trace)
        else:
            updates = new_trace
        new_trace = optree.tree_map(lambda t, old: t.to(old.dtype), new_trace, state.trace)
        return updates, TraceState(trace=new_trace)

    return GradientTransformation(init, update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                  mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Adam's rescaling (Kingma & Ba 2014): `mu_hat / (sqrt(nu_hat + eps_root) + eps)`, the
    moments debiased by `1 - b**t`.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.scale_by_adam()
        >>> state = opt.init({'w': torch.zeros(2)})
        >>> updates, state = opt.update({'w': torch.tensor([2.0, -3.0])}, state)
        >>> updates['w'], state.count    # the first step is sign(g), up to eps
        (tensor([ 1., -1.]), tensor(1, dtype=torch.int32))
    """

    def init(params):
        return ScaleByAdamState(
            count=zeros_count(params),
            mu=optree.tree_map(lambda p: torch.zeros_like(p, dtype=mu_dtype), params),
            nu=optree.tree_map(torch.zeros_like, params),
        )

    def update(updates, state, params=None):
        del params
        check_same_structure(state.mu, updates, "the Adam state", "updates",
                             "pass gradients shaped like the params given to init")
        # lerp and addcmul, as torch.optim: one pass over each moment, not three or four
        mu = optree.tree_map(leafwise(lambda g, m: torch.lerp(m.to(g.dtype), g, 1 - b1)), updates, state.mu)
        nu = optree.tree_map(leafwise(lambda g, v: torch.addcmul(b2 * v, g, g, value=1 - b2)), updates, state.nu)
        count = safe_increment(state.count)

        corrections: dict = {}  # once per dtype, not per leaf

        def correction(decay, dtype):
            if (decay, dtype) not in corrections:
                corrections[decay, dtype] = _bias_correction(decay, count, dtype)
            return corrections[decay, dtype]

        def rescale(m, v, c1=None, c2=None):
            v_hat = v / (correction(b2, v.dtype) if c2 is None else c2)
            denom = torch.sqrt(v_hat + eps_root if eps_root else v_hat) + eps
            # mu_hat / denom, dividing by the correction last: under nf.jit the quotient is
            # written into denom's buffer, not a fresh one (mu itself is kept as state)
            return m / denom / (correction(b1, m.dtype) if c1 is None else c1)

        copied = leafwise(rescale)

        def corrected(m, v):  # the first leaf of each dtype makes its corrections; the others copy it
            if (b1, m.dtype) in corrections and (b2, v.dtype) in corrections:
                return copied(m, v, corrections[b1, m.dtype], corrections[b2, v.dtype])
            return rescale(m, v)

        updates = optree.tree_map(corrected, mu, nu)
        if mu_dtype is not None:
            mu = optree.tree_map(lambda m: m.to(mu_dtype), mu)
        return updates, ScaleByAdamState(count=count, mu=mu, nu=nu)

    return GradientTransformation(init, update)


def _bias_correction(decay: float, count: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`1 - decay**count` in `dtype`, as `-expm1(count * log(decay))`. The direct form loses most
    digits in float32: 0.999 is stored as 0.99899999, so `1 - 0.999**1` is off by 2e-5 relative,
    where torch.optim (Python floats) is exact; this form is good to an ulp."""
    if decay == 0:
        return torch.ones((), dtype=dtype, device=count.device)
    return -torch.expm1(count.to(dtype) * math.log(decay))


def add_decayed_weights(weight_decay: float = 0.0,
                        mask: PyTree | Callable[[PyTree], PyTree] | None = None
                        ) -> GradientTransformation:
    """`updates + weight_decay * params` (decoupled weight decay, AdamW's). `mask`, a tree of
    bools shaped like (a prefix of) the params or a function of the params returning one, limits
    the decay to leaves marked True.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.add_decayed_weights(0.5, mask={'w': True, 'b': False})
        >>> params = {'w': torch.ones(1), 'b': torch.ones(1)}
        >>> opt.update({'w': torch.zeros(1), 'b': torch.zeros(1)}, opt.init(params), params)[0]
        {'w': tensor([0.5000]), 'b': tensor([0.])}
    """
    _check_scalar(weight_decay, "weight_decay")

    def init(params):
        del params
        return AddDecayedWeightsState()

    def update(updates, state, params=None):
        params = require_params(params, "add_decayed_weights (weight decay)")
        check_same_structure(params, updates, "params", "updates",
                             "pass gradients shaped like the params")
        def decay(g, p):
            if isinstance(weight_decay, torch.Tensor):
                return g + _times(weight_decay, p).to(g.dtype)
            return torch.add(g, p.to(g.dtype), alpha=weight_decay)  # one pass
        if not isinstance(weight_decay, torch.Tensor):  # (a tensor it closes over cannot be copied)
            decay = leafwise(decay)
        if mask is None:
            return optree.tree_map(decay, updates, params), state
        mask_tree = mask(params) if callable(mask) else mask
        flags = tree_broadcast_prefix(mask_tree, params, prefix_name="mask", full_name="params")
        for flag in optree.tree_leaves(flags):
            if not isinstance(flag, bool):
                raise TypeError(
                    f"a weight-decay mask holds Python bools (True: decay this leaf), got "
                    f"{type(flag).__name__}; build it from the params' structure, e.g. "
                    f"lambda params: {{k: k != 'bias' for k in params}}."
                )
        updates = optree.tree_map(lambda g, p, on: decay(g, p) if on else g, updates, params, flags)
        return updates, state

    return GradientTransformation(init, update)


def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all leaves together, `sqrt(sum(x**2))`, in the widest leaf dtype.

    Example:
        >>> from ndfunc import optim
        >>> optim.global_norm({'a': torch.tensor([3.0]), 'b': torch.tensor([[4.0]])})
        tensor(5.)
    """
    leaves = optree.tree_leaves(tree)
    if not leaves:
        raise ValueError("global_norm of a tree with no tensors is undefined; pass gradients.")
    return torch.sqrt(sum(torch.sum(torch.square(x)) for x in leaves))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the updates by `max_norm / global_norm` when their global norm exceeds `max_norm`
    (Pascanu et al. 2012). Like `torch.nn.utils.clip_grad_norm_`, without its 1e-6 in the
    denominator: optax's formula.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.clip_by_global_norm(1.0)
        >>> opt.update([torch.tensor([3.0]), torch.tensor([4.0])], opt.init(None))[0]
        [tensor([0.6000]), tensor([0.8000])]
    """
    _check_scalar(max_norm, "max_norm")

    def init(params):
        del params
        return ClipByGlobalNormState()

    def update(updates, state, params=None):
        del params
        g_norm = global_norm(updates)
        # A select, not a branch: both sides are computed and the norm never leaves the device.
        keep = g_norm < max_norm
        clipped = optree.tree_map(
            lambda t: torch.where(keep, t, (t / g_norm.to(t.dtype)) * max_norm), updates)
        return clipped, state

    return GradientTransformation(init, update)
