"""Schedules, optax's: functions from the step count (an integer tensor) to a value.

Each is built from torch ops on the count, with selects where optax has them, so a schedule inside
an update traces to a few scalar nodes and never reads the count back to Python. Values are
computed in the default float dtype (float32) as in optax; the update casts them to each leaf's
dtype. The short names `constant`, `linear_warmup` and `warmup_cosine_decay` are the same functions
as `constant_schedule`, `warmup_constant_schedule` and `warmup_cosine_decay_schedule`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ndfunc.optim._base import Schedule


def _as_count(count: Any) -> torch.Tensor:
    return count if isinstance(count, torch.Tensor) else torch.as_tensor(count)


def constant_schedule(value: float) -> Schedule:
    """The schedule that is `value` at every step.

    Example:
        >>> from ndfunc import optim
        >>> optim.constant_schedule(5e-4)(torch.tensor(100))
        0.0005
    """
    return lambda count: value


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    """`(init - end) * (1 - t / transition_steps) ** power + end`, `t` the steps since
    `transition_begin`, clipped to `[0, transition_steps]`. `transition_steps <= 0` holds
    `init_value`; a negative `transition_begin` counts as 0 (both as in optax).

    Example:
        >>> from ndfunc import optim
        >>> s = optim.polynomial_schedule(1.0, 0.0, power=2, transition_steps=10)
        >>> s(torch.tensor(5))
        tensor(0.2500)
    """
    if transition_steps <= 0:
        return lambda count: init_value
    transition_begin = max(transition_begin, 0)

    def schedule(count):
        t = torch.clamp(_as_count(count) - transition_begin, 0, transition_steps)
        frac = 1 - t / transition_steps
        return (init_value - end_value) * frac**power + end_value

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """From `init_value` to `end_value` in a straight line over `transition_steps` steps, starting
    at `transition_begin`; `end_value` after. `polynomial_schedule` with `power=1`.

    Example:
        >>> from ndfunc import optim
        >>> s = optim.linear_schedule(0.0, 1e-3, transition_steps=10)
        >>> s(torch.tensor(5)), s(torch.tensor(50))
        (tensor(0.0005), tensor(0.0010))
    """
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    """`init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * t / decay_steps))) ** exponent + alpha)`,
    `t` clipped to `decay_steps` (Loshchilov & Hutter, SGDR, 2017).

    Example:
        >>> from ndfunc import optim
        >>> optim.cosine_decay_schedule(1.0, decay_steps=10)(torch.tensor(5))
        tensor(0.5000)
    """
    if not decay_steps > 0:
        raise ValueError(f"cosine_decay_schedule needs decay_steps > 0, got {decay_steps}; it is the "
                         f"number of steps over which the value decays.")

    def schedule(count):
        t = torch.clamp(_as_count(count), max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """`schedules[i]` from `boundaries[i-1]` on, fed the steps since that boundary.

    Example:
        >>> from ndfunc import optim
        >>> s = optim.join_schedules([optim.constant_schedule(1.0), optim.constant_schedule(2.0)], [3])
        >>> s(torch.tensor(2)), s(torch.tensor(3))
        (tensor(1.), tensor(2.))
    """
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(f"join_schedules needs one boundary fewer than schedules, got "
                         f"{len(schedules)} schedules and {len(boundaries)} boundaries.")

    def schedule(count):
        count = _as_count(count)
        out = schedules[0](count)
        for boundary, later in zip(boundaries, schedules[1:]):
            out = torch.where(count < boundary, out, later(count - boundary))
        return out

    return schedule


def warmup_constant_schedule(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """Linear warmup from `init_value` to `peak_value` over `warmup_steps`, then held.

    Example:
        >>> from ndfunc import optim
        >>> s = optim.linear_warmup(0.0, 1e-3, warmup_steps=4)    # the short name
        >>> s(torch.tensor(1)), s(torch.tensor(9))
        (tensor(0.0003), tensor(0.0010))
    """
    return linear_schedule(init_value, peak_value, warmup_steps)


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                 decay_steps: int, end_value: float = 0.0, exponent: float = 1.0
                                 ) -> Schedule:
    """Linear warmup from `init_value` to `peak_value` over `warmup_steps`, then cosine decay to
    `end_value`. `decay_steps` counts the warmup too, as in optax: the cosine part lasts
    `decay_steps - warmup_steps` steps.

    Example:
        >>> from ndfunc import optim
        >>> s = optim.warmup_cosine_decay(0.0, 1.0, warmup_steps=2, decay_steps=12)
        >>> [round(float(s(torch.tensor(t))), 4) for t in (0, 1, 2, 7, 12, 20)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    if not decay_steps > warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay_schedule needs decay_steps > warmup_steps, got decay_steps="
            f"{decay_steps} and warmup_steps={warmup_steps}; decay_steps is the whole schedule's "
            f"length, warmup included."
        )
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    return join_schedules(
        [linear_schedule(init_value, peak_value, warmup_steps),
         cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)],
        [warmup_steps],
    )


# The short names: the same functions.
constant = constant_schedule
linear_warmup = warmup_constant_schedule
warmup_cosine_decay = warmup_cosine_decay_schedule
