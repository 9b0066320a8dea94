"""Manual regions in a traced program: where `nf.shard_map` runs inside `nf.jit`.

Traced, a shard_map is three kinds of node. `ndfunc.enter_manual(x, spec)` takes a global value
laid out by `spec` to this rank's block; `ndfunc.exit_manual(y, spec, shape)` takes blocks back to
a global value laid out by `spec`; between them every op is already per rank (its shapes are block
shapes, its collectives are the `nf.lax` ones the user wrote, `ndfunc.axis_index(axes)` is the
rank's position). The partitioner fixes the two boundary layouts and leaves the region alone; the
lowering copies the region into the local program as it is. Their gradients are each other, so the
backward of a region is a region too.
"""

from __future__ import annotations

import json

import torch

from ndfunc._src.constraints import decode_spec, encode_spec

_lib = torch.library.Library("ndfunc", "FRAGMENT")
_lib.define("enter_manual(Tensor x, str spec, int[] block) -> Tensor")
_lib.define("exit_manual(Tensor y, str spec, int[] shape) -> Tensor")
_lib.define("axis_index(str axes, Device device) -> Tensor")
# nf.lax.ppermute in a traced program: `pairs` (global rank, global rank it sends to), flattened
_lib.define("ppermute(Tensor x, int[] pairs, str axis) -> Tensor")


def _outside(*args, **kwargs):
    raise RuntimeError("ndfunc manual-region ops exist only in programs that nf.jit traces and lowers.")


for _name in ("enter_manual", "exit_manual", "axis_index", "ppermute"):
    _lib.impl(_name, _outside, "CompositeExplicitAutograd")
_lib.impl("enter_manual", lambda x, spec, block: x.new_empty(block), "Meta")
_lib.impl("exit_manual", lambda y, spec, shape: y.new_empty(shape), "Meta")
_lib.impl("ppermute", lambda x, pairs, axis: torch.empty_like(x, memory_format=torch.contiguous_format), "Meta")


@torch.library.register_fake("ndfunc::axis_index", lib=_lib)
def _axis_index_fake(axes, device):
    return torch.empty((), dtype=torch.int64, device=device)


enter_op = torch.ops.ndfunc.enter_manual.default
exit_op = torch.ops.ndfunc.exit_manual.default
axis_index_op = torch.ops.ndfunc.axis_index.default
ppermute_op = torch.ops.ndfunc.ppermute.default


class _Boundary(torch.autograd.Function):
    """Entering or leaving a region; the gradient of each is the other."""

    @staticmethod
    def forward(x, op, inverse, spec, size, inverse_size):
        return op(x, spec, size)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.inverse, ctx.spec, ctx.size = inputs[2], inputs[3], inputs[5]

    @staticmethod
    def backward(ctx, grad):
        return ctx.inverse(grad, ctx.spec, ctx.size), None, None, None, None, None


def enter(x: torch.Tensor, spec, block) -> torch.Tensor:
    return _Boundary.apply(x, enter_op, exit_op, encode_spec(spec), list(block), list(x.shape))


def exit(y: torch.Tensor, spec, shape) -> torch.Tensor:  # noqa: A001 - the pair of enter
    return _Boundary.apply(y, exit_op, enter_op, encode_spec(spec), list(shape), list(y.shape))


def axis_index(axes: tuple[str, ...], device) -> torch.Tensor:
    return axis_index_op(json.dumps(list(axes)), device)


def spec_of(node: torch.fx.Node):
    return decode_spec(node.args[1])
