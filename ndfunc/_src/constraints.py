"""`nf.with_sharding_constraint`: pin the layout of a value inside a function that `nf.jit` traces.
`nf.with_logical_constraint`: the same, with the value's dims named (`('batch', 'seq', None)`) and
the mesh axes taken from the `nf.sharding.axis_rules` in force, if any.

In a traced program the constraint is one node, `ndfunc.sharding_constraint(x, spec)`, which the
partitioner reads as a fixed placement; its gradient carries the same constraint, as in JAX (the
transpose of a sharding constraint is a sharding constraint). Called eagerly on a DTensor it
reshards like `nf.device_put`; on a plain (replicated, global) tensor it changes nothing.
"""

from __future__ import annotations

import json

import torch
from torch.distributed.tensor import DTensor

from ndfunc._src.sharding.errors import RankError
from ndfunc._src.sharding.named_sharding import NamedSharding
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.sharding.rules import current_rules, logical_spec

_lib = torch.library.Library("ndfunc", "DEF")
_lib.define("sharding_constraint(Tensor x, str spec) -> Tensor")
# The value is unchanged; a copy because an op's output may not alias its input.
_lib.impl("sharding_constraint", lambda x, spec: x.clone(), "CompositeExplicitAutograd")
sharding_constraint_op = torch.ops.ndfunc.sharding_constraint.default


def encode_spec(spec: PartitionSpec) -> str:
    """`P('dp', None, ('a', 'b'))` -> `'["dp", null, ["a", "b"]]'`: a graph-safe string."""
    return json.dumps([list(e) if isinstance(e, tuple) else e for e in spec])


def decode_spec(text: str) -> PartitionSpec:
    return PartitionSpec(*json.loads(text))


class _Constraint(torch.autograd.Function):
    # An autograd.Function with setup_context, so torch.func.grad (and make_fx over it) can see
    # through it: forward and backward are both the constraint op.
    @staticmethod
    def forward(x, spec):
        return torch.ops.ndfunc.sharding_constraint(x, spec)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.ndfunc.sharding_constraint(grad, ctx.spec), None


def with_sharding_constraint(x: torch.Tensor, sharding: PartitionSpec | NamedSharding) -> torch.Tensor:
    """`x`, laid out as `sharding` says (a `P`, or a NamedSharding on the function's mesh).

    Example:
        >>> y = nf.with_sharding_constraint(torch.ones(4, 2), P('dp', None))  # plain: unchanged
        >>> torch.equal(y, torch.ones(4, 2))
        True
    """
    if isinstance(x, DTensor):
        from ndfunc._src.transfer import device_put

        return device_put(x, sharding)
    if isinstance(sharding, NamedSharding):
        sharding.check(tuple(x.shape))
        spec = sharding.spec
    elif isinstance(sharding, PartitionSpec):
        spec = sharding
    else:
        raise TypeError(
            f"with_sharding_constraint expects a PartitionSpec or NamedSharding, got {sharding!r}; "
            f"write P('dp', None) or NamedSharding(mesh, P('dp', None))."
        )
    if len(spec) > x.ndim:
        raise RankError(
            f"with_sharding_constraint got {spec!r} for a value of rank {x.ndim} (shape "
            f"{tuple(x.shape)}); the spec needs at most one entry per dim."
        )
    return _Constraint.apply(x, encode_spec(spec))


def with_logical_constraint(x: torch.Tensor, names: tuple) -> torch.Tensor:
    """`x` constrained to the layout the current `nf.sharding.axis_rules` give its dims' logical
    names (one per dim; None: not sharded); unchanged where no rules are set.

    Example:
        >>> x = torch.ones(4, 2)
        >>> nf.with_logical_constraint(x, ('batch', None)) is x  # no rules here: x itself
        True
    """
    rules = current_rules()
    if rules is None:
        return x
    if len(names) != x.ndim:
        raise RankError(
            f"with_logical_constraint got names {tuple(names)} for a value of rank {x.ndim} (shape "
            f"{tuple(x.shape)}); give one logical name (or None) per dim."
        )
    return with_sharding_constraint(x, logical_spec(names, rules))
