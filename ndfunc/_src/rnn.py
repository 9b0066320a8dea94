"""`nn.LSTM`, `nn.GRU` and `nn.RNN` as one op per call, split by the batch.

Traced op by op, a recurrent layer is its cell unrolled: a few dozen ops per time step and layer,
forward and backward, so tracing and planning a 256-step LSTM took tens of seconds, and every one
of those ops split the same way (by the batch). `ndfunc::rnn` is the whole call (every layer and
direction), made by torch's own kernel for the device at run time (cuDNN, oneDNN, or the cells);
`ndfunc::rnn_backward` is its gradient, the forward made again inside under autograd (nothing
is kept between the two but the inputs: the activations live only inside the backward, at the
price of a second forward). Both split by the batch, the weights whole; the weights' gradients are
then each rank's sum over its own samples, pending. `TRACED_AS`: how the tracer records torch's
recurrent calls (one op where it can be, else cells that split by the batch, or torch's own).
"""

from __future__ import annotations

import torch

from ndfunc._src.opaque import opaque_op, recomputed_gradients
from ndfunc._src.torch_compat import func_transforms, lstm_cells

_KERNELS = {"lstm": torch.lstm, "gru": torch.gru, "rnn_tanh": torch.rnn_tanh, "rnn_relu": torch.rnn_relu}


def _run(mode, input, hx, params, has_biases, num_layers, bidirectional, batch_first,
         train: bool = False) -> list[torch.Tensor]:
    """torch's own recurrent function (no dropout): [output, *final states]. `train`: as a training
    step's (cuDNN differentiates only those)."""
    state = tuple(hx) if mode == "lstm" else hx[0]
    made = _KERNELS[mode](input, state, params, has_biases, num_layers, 0.0, train, bidirectional, batch_first)
    return list(made)


def _run_backward(mode, grads, input, hx, params, has_biases, num_layers, bidirectional, batch_first):
    """The gradients of `_run`'s results `grads` to [input, *hx, *params]: the forward made again,
    under autograd."""
    def forward(leaves):
        return _run(mode, leaves[0], leaves[1:1 + len(hx)], leaves[1 + len(hx):], has_biases, num_layers,
                    bidirectional, batch_first, train=True)
    return recomputed_gradients(forward, (input, *hx, *params), grads)


def _run_fake(mode, input, hx, params, has_biases, num_layers, bidirectional, batch_first):
    """`_run`'s results, of their shapes: the output's features are the last layer's state's (its
    projection's, for an LSTM with one), per direction."""
    features = hx[0].shape[-1] * (2 if bidirectional else 1)
    return [input.new_empty(*input.shape[:2], features), *(torch.empty_like(h) for h in hx)]


class _RNN(torch.autograd.Function):
    """`ndfunc::rnn` with `ndfunc::rnn_backward` as its gradient (a Function: torch.func's
    transforms trace through it). Its tensors come flat (a Function differentiates only those):
    the input, the states, then the weights."""

    @staticmethod
    def forward(mode, n_hx, flags, input, *tensors):
        return tuple(rnn_op(mode, input, list(tensors[:n_hx]), list(tensors[n_hx:]), *flags))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mode, ctx.n_hx, ctx.flags, *tensors = inputs
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        input, *rest = ctx.saved_tensors
        hx, params = rest[:ctx.n_hx], rest[ctx.n_hx:]
        likes = _run_fake(ctx.mode, input, hx, params, *ctx.flags)  # (only their shapes are read)
        grads = [torch.zeros_like(like) if g is None else g for g, like in zip(grads, likes)]
        return None, None, None, *rnn_backward_op(ctx.mode, grads, input, list(hx), list(params), *ctx.flags)


def rnn(mode: str, input, hx, params, has_biases, num_layers, bidirectional, batch_first) -> tuple:
    """`torch.lstm` / `torch.gru` / `torch.rnn_*` (their `input` overload, without dropout) as one
    `ndfunc::rnn`: (output, *final states)."""
    hx = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    flags = (has_biases, num_layers, bidirectional, batch_first)
    return _RNN.apply(mode, len(hx), flags, input, *hx, *params)


def batch_dims(node: torch.fx.Node) -> tuple[list, list]:
    """For a node of `ndfunc::rnn` or its backward: (the batch dim of each tensor output, of each
    tensor input; None for a weight or its gradient)."""
    backward = node.target is rnn_backward_op
    mode, *rest = node.args
    if backward:
        grads, input, hx, params, _, _, _, batch_first = rest
    else:
        input, hx, params, _, _, _, batch_first = rest
    along = 0 if batch_first else 1
    states = [1] * len(hx)
    weights = [None] * len(params)
    made = [along, *states] + (weights if backward else [])
    read = ([along, *states] if backward else []) + [along, *states, *weights]
    return made, read


def flops(node: torch.fx.Node) -> int:
    """A recurrent call's matmuls: per step, sample, layer and direction, 2 flops per weight element
    (the input's projection and the state's); its backward three times that (the forward made
    again, then two products per weight)."""
    backward = node.target is rnn_backward_op
    mode, *rest = node.args
    input, _, params = (rest[1:4] if backward else rest[0:3])
    shape = input.meta["val"].shape
    tokens = shape[0] * shape[1]
    weights = sum(p.meta["val"].numel() for p in params if p.meta["val"].dim() == 2)
    return 2 * tokens * weights * (3 if backward else 1)


# (output, *final states); input, *states, *weights
_ops = opaque_op(
    "rnn", "(str mode, Tensor input, Tensor[] hx, Tensor[] params, bool has_biases, int num_layers, "
                 "bool bidirectional, bool batch_first) -> Tensor[]",
    "(str mode, Tensor[] grads, Tensor input, Tensor[] hx, Tensor[] params, bool has_biases, int num_layers, "
    "bool bidirectional, bool batch_first) -> Tensor[]",
    run=_run, run_backward=_run_backward, fake=_run_fake,
    fake_backward=lambda mode, grads, input, hx, params, *_: [torch.empty_like(t) for t in (input, *hx, *params)],
    dims=batch_dims, flops=flops)
rnn_op, rnn_backward_op = _ops.forward, _ops.backward


def _lstm(input, hx, *rest, **kwargs):
    """`torch.lstm` (`nn.LSTM`'s) over a batch as one `ndfunc::rnn`, as `_recurrent` the others;
    where that cannot be (dropout between layers in training, a transform other than a gradient), as its
    decomposition's cells (matmuls and pointwise ops, which split by the batch), not oneDNN's
    layer kernel, which the decomposition picks on CPU where nothing outside `torch.func` needs a
    gradient: it has no sharding rule, and its backward reads an opaque workspace. A packed
    sequence is torch's own (its decomposition takes no kernel)."""
    if not isinstance(hx, (list, tuple)) or kwargs:
        return torch.lstm(input, hx, *rest, **kwargs)
    if _one_op(input, *rest[3:5]):
        return rnn("lstm", input, hx, *rest[:3], *rest[5:])
    return lstm_cells(input, hx, *rest)


def _recurrent(mode: str, kernel):
    """`torch.gru` / `torch.rnn_tanh` / `torch.rnn_relu` over a batch as one `ndfunc::rnn`: the
    call, not its cells unrolled step by step, split by the batch; where that cannot be (a packed
    sequence, dropout in training, a transform other than a gradient), torch's own."""
    def traced(input, hx, params, *rest, **kwargs):
        if isinstance(params, (list, tuple)) and not kwargs and _one_op(input, *rest[2:4]):
            return rnn(mode, input, hx, params, *rest[:2], *rest[4:])
        return kernel(input, hx, params, *rest, **kwargs)
    return traced


def _one_op(input, dropout: float, train: bool) -> bool:
    """Whether a recurrent call can be one `ndfunc::rnn`: a batch (`nn`'s layers make one of an
    unbatched input), no dropout at work (its masks are drawn between layers, inside), and no
    transform but a gradient (the op has no batching rule, and its backward no gradient)."""
    return input.dim() == 3 and (not train or dropout == 0) and func_transforms() in ([], ["Grad"])


# how the tracer records torch's recurrent calls (`traced_as.TRACED_AS` takes them in)
TRACED_AS = {torch.lstm: _lstm,
             torch.gru: _recurrent("gru", torch.gru),
             torch.rnn_tanh: _recurrent("rnn_tanh", torch.rnn_tanh),
             torch.rnn_relu: _recurrent("rnn_relu", torch.rnn_relu)}
