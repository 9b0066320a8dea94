"""The optimizer interface: a pair of pure functions over pytrees, optax's `GradientTransformation`.

`init(params) -> state` and `update(updates, state, params=None) -> (updates, state)` build new
tensors and never write into their arguments, so a whole train step traces with `make_fx` into one
functional graph. States are NamedTuples of tensors (or tuples of them, for `chain`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import optree
import torch

from ndfunc._src.regions import repeated
from ndfunc._src.sharding.shape_dtype import eval_shape, has_stand_ins, is_stand_in

PyTree = Any
Params = PyTree
Updates = PyTree
OptState = Any
Schedule = Callable[[torch.Tensor], Any]
"""A function of the step count (an integer tensor) to a value, a float or 0-dim tensor."""


class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    def __call__(self, updates: Updates, state: OptState, params: Params | None = None
                 ) -> tuple[Updates, OptState]: ...


class _Transformation(NamedTuple):
    init: TransformInitFn
    update: TransformUpdateFn


class GradientTransformation(_Transformation):
    """A gradient transformation: `init(params) -> state`, `update(updates, state, params=None)
    -> (updates, state)`. Both are pure.

    `init` over `nf.ShapeDtypeStruct` stand-ins returns the state as stand-ins (nothing allocated),
    each part shaped like the parameters laid out as they are (`state_shardings`), every other
    leaf replicated on their mesh: what `nf.jit(...).lower` plans a step over.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.sgd(0.1)
        >>> params = {'w': torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({'w': torch.ones(2)}, state, params)
        >>> optim.apply_updates(params, updates)
        {'w': tensor([0.9000, 0.9000])}
    """

    __slots__ = ()

    def __new__(cls, init: TransformInitFn, update: TransformUpdateFn):
        return super().__new__(cls, _over_stand_ins(init), update)


def _over_stand_ins(init: TransformInitFn) -> TransformInitFn:
    """`init`, which over stand-ins runs on fake tensors and lays the state out like the params."""
    if getattr(init, "_over_stand_ins", False):
        return init

    def over_stand_ins(params):
        if not has_stand_ins(params):
            return init(params)
        from ndfunc.optim._shardings import state_shardings

        state = eval_shape(init, params)
        shardings = optree.tree_map(lambda x: x.sharding if is_stand_in(x) else None, params, none_is_leaf=True)
        if any(s is None for s in optree.tree_leaves(shardings, none_is_leaf=True)):
            return state  # a parameter without a layout (or a tensor): the state's is for in_shardings to say
        return state_shardings(state, shardings)

    over_stand_ins._over_stand_ins = True
    over_stand_ins.__wrapped__ = init
    return over_stand_ins


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none."""


def identity() -> GradientTransformation:
    """The transformation that returns its updates unchanged.

    Example:
        >>> from ndfunc import optim
        >>> optim.identity().update(torch.ones(2), optim.EmptyState())
        (tensor([1., 1.]), EmptyState())
    """

    def init(params):
        del params
        return EmptyState()

    def update(updates, state, params=None):
        del params
        return updates, state

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply `transforms` one after another; the state is the tuple of their states.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.5))
        >>> state = opt.init(torch.zeros(2))
        >>> updates, _ = opt.update(torch.tensor([3.0, 4.0]), state)
        >>> updates
        tensor([-0.3000, -0.4000])
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain expects GradientTransformations, but argument {i} is a {type(t).__name__}; "
                f"build one with an optimizer factory such as optim.adam(1e-3) or optim.trace(0.9)."
            )

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = f"a tuple of {len(state)}" if isinstance(state, tuple) else f"a {type(state).__name__}"
            raise ValueError(
                f"this chain of {len(transforms)} transformations expects a tuple of "
                f"{len(transforms)} states, got {got}; pass the state that its init returned."
            )
        new_states = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init, update)


def apply_updates(params: Params, updates: Updates) -> Params:
    """`params + updates`, leaf by leaf, each result in its parameter's dtype. New tensors; the
    arguments are untouched.

    Example:
        >>> from ndfunc import optim
        >>> optim.apply_updates({'w': torch.ones(2)}, {'w': torch.tensor([0.5, -0.5])})
        {'w': tensor([1.5000, 0.5000])}
    """
    check_same_structure(params, updates, "params", "updates",
                         "pass the updates that opt.update(grads, state, params) returned")
    return optree.tree_map(_apply, params, updates)


@repeated  # under nf.jit: traced once per leaf shape, copied to the other leaves of that shape
def _apply(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (p + u).to(p.dtype)


def check_same_structure(a: PyTree, b: PyTree, a_name: str, b_name: str, fix: str) -> None:
    """Raise a `ValueError` naming both structures unless `a` and `b` have the same one."""
    a_spec, b_spec = optree.tree_structure(a), optree.tree_structure(b)
    if a_spec != b_spec:
        raise ValueError(
            f"{b_name} must have the same tree structure as {a_name}; {a_name} is {a_spec} but "
            f"{b_name} is {b_spec}; {fix}."
        )


def require_params(params: Params | None, who: str) -> Params:
    if params is None:
        raise ValueError(
            f"{who} needs the parameters, but update was called with params=None; call "
            f"opt.update(grads, state, params)."
        )
    return params


def zeros_count(params: Params) -> torch.Tensor:
    """A 0-dim int32 step counter (optax's dtype) on the device of the first parameter."""
    leaves = optree.tree_leaves(params)
    device = leaves[0].device if leaves and isinstance(leaves[0], torch.Tensor) else None
    return torch.zeros((), dtype=torch.int32, device=device)


def safe_increment(count: torch.Tensor) -> torch.Tensor:
    """`count + 1`, held at the dtype's maximum instead of wrapping around (optax's
    `safe_increment`); a select, not a branch, so it traces."""
    max_count = torch.iinfo(count.dtype).max
    return torch.where(count < max_count, count + 1, count)
