"""Optimizers as chains of building blocks, optax's `alias.py`: names, arguments and defaults are
optax's, and each matches its `torch.optim` counterpart step for step (see tests/test_optim.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ndfunc.optim._base import GradientTransformation, PyTree, chain, identity
from ndfunc.optim._transforms import (
    ScalarOrSchedule,
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)


def sgd(learning_rate: ScalarOrSchedule, momentum: float | None = None, nesterov: bool = False,
        accumulator_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Stochastic gradient descent, with optional (Nesterov) momentum: `torch.optim.SGD` with
    `dampening=0, weight_decay=0`.

    Args:
        learning_rate: a number, a 0-dim tensor, or a schedule of the step count.
        momentum: the momentum decay; None for none.
        nesterov: use Nesterov momentum.
        accumulator_dtype: dtype of the momentum buffer; None for each parameter's.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.sgd(0.1, momentum=0.9)
        >>> params = {'w': torch.ones(2)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({'w': torch.ones(2)}, state, params)
        >>> optim.apply_updates(params, updates)['w']
        tensor([0.9000, 0.9000])
    """
    return chain(
        trace(momentum, nesterov, accumulator_dtype) if momentum is not None else identity(),
        scale_by_learning_rate(learning_rate),
    )


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: torch.dtype | None = None) -> GradientTransformation:
    """Adam (Kingma & Ba 2014): `torch.optim.Adam`.

    Args:
        learning_rate: a number, a 0-dim tensor, or a schedule of the step count.
        b1, b2: decay rates of the first and second moments.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root (needed to differentiate through Adam).
        mu_dtype: dtype of the first moment; None for each parameter's.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.adam(1e-3)
        >>> params = {'w': torch.zeros(2)}
        >>> updates, state = opt.update({'w': torch.tensor([1.0, -1.0])}, opt.init(params), params)
        >>> updates['w'], type(state[0]).__name__
        (tensor([-0.0010,  0.0010]), 'ScaleByAdamState')
    """
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype),
        scale_by_learning_rate(learning_rate),
    )


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: torch.dtype | None = None, weight_decay: float = 1e-4,
          mask: PyTree | Callable[[PyTree], PyTree] | None = None) -> GradientTransformation:
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019): `torch.optim.AdamW`. The decay
    is multiplied by the learning rate, as in PyTorch and optax.

    Args:
        learning_rate, b1, b2, eps, eps_root, mu_dtype: as in `adam`.
        weight_decay: the decay strength.
        mask: a tree of bools shaped like (a prefix of) the params, or a function of the params
            returning one: decay only the leaves marked True. Adam itself applies to all leaves.

    Example:
        >>> from ndfunc import optim
        >>> opt = optim.adamw(1e-3, weight_decay=0.1, mask=lambda p: {k: k != 'bias' for k in p})
        >>> params = {'w': torch.ones(1), 'bias': torch.ones(1)}
        >>> updates, _ = opt.update({'w': torch.ones(1), 'bias': torch.ones(1)}, opt.init(params), params)
        >>> updates
        {'w': tensor([-0.0011]), 'bias': tensor([-0.0010])}
    """
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
