"""Pure optimizers over pytrees of tensors, in optax's shape.

An optimizer is a `GradientTransformation(init, update)`: `state = opt.init(params)`, then
`updates, state = opt.update(grads, state, params)` and `params = apply_updates(params, updates)`.
Nothing is written in place and no value is read back to Python, so a train step with its update
traces with `make_fx` into one functional graph. Build optimizers from blocks with `chain`, e.g.
`chain(clip_by_global_norm(1.0), adamw(warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000)))`.

Example:
    >>> from ndfunc import optim
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    >>> params = {'w': torch.ones(3)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({'w': torch.full((3,), 10.0)}, state, params)
    >>> optim.apply_updates(params, updates)['w']
    tensor([0.9890, 0.9890, 0.9890])
"""

from ndfunc.optim._alias import adam as adam
from ndfunc.optim._alias import adamw as adamw
from ndfunc.optim._alias import sgd as sgd
from ndfunc.optim._base import EmptyState as EmptyState
from ndfunc.optim._base import GradientTransformation as GradientTransformation
from ndfunc.optim._base import OptState as OptState
from ndfunc.optim._base import Schedule as Schedule
from ndfunc.optim._base import apply_updates as apply_updates
from ndfunc.optim._base import chain as chain
from ndfunc.optim._base import identity as identity
from ndfunc.optim._schedules import constant as constant
from ndfunc.optim._schedules import constant_schedule as constant_schedule
from ndfunc.optim._schedules import cosine_decay_schedule as cosine_decay_schedule
from ndfunc.optim._schedules import join_schedules as join_schedules
from ndfunc.optim._schedules import linear_schedule as linear_schedule
from ndfunc.optim._schedules import linear_warmup as linear_warmup
from ndfunc.optim._schedules import polynomial_schedule as polynomial_schedule
from ndfunc.optim._schedules import warmup_constant_schedule as warmup_constant_schedule
from ndfunc.optim._schedules import warmup_cosine_decay as warmup_cosine_decay
from ndfunc.optim._schedules import (
    warmup_cosine_decay_schedule as warmup_cosine_decay_schedule,
)
from ndfunc.optim._shardings import state_shardings as state_shardings
from ndfunc.optim._transforms import ScaleByAdamState as ScaleByAdamState
from ndfunc.optim._transforms import ScaleByScheduleState as ScaleByScheduleState
from ndfunc.optim._transforms import TraceState as TraceState
from ndfunc.optim._transforms import add_decayed_weights as add_decayed_weights
from ndfunc.optim._transforms import clip_by_global_norm as clip_by_global_norm
from ndfunc.optim._transforms import global_norm as global_norm
from ndfunc.optim._transforms import scale as scale
from ndfunc.optim._transforms import scale_by_adam as scale_by_adam
from ndfunc.optim._transforms import scale_by_learning_rate as scale_by_learning_rate
from ndfunc.optim._transforms import scale_by_schedule as scale_by_schedule
from ndfunc.optim._transforms import trace as trace

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "OptState",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "Schedule",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "constant_schedule",
    "cosine_decay_schedule",
    "global_norm",
    "identity",
    "join_schedules",
    "linear_schedule",
    "linear_warmup",
    "polynomial_schedule",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "state_shardings",
    "sgd",
    "trace",
    "warmup_constant_schedule",
    "warmup_cosine_decay",
    "warmup_cosine_decay_schedule",
]
