"""Any torch op inside a jitted step: decomposed where PyTorch can, else run whole with a warning;
code that needs a tensor's value is an error that names its line.

The reference for every result is the same step run eagerly on one device (plain tensors, no nf.jit).
"""

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import ndfunc as nf
from ndfunc.sharding import P

B, D, H, C = 8, 6, 8, 4
TOL = dict(rtol=1e-5, atol=1e-6)


def _data():
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(D, H, generator=g) * 0.3, "w2": torch.randn(H, C, generator=g) * 0.3}
    x, y = torch.randn(B, D, generator=g), torch.randn(B, C, generator=g)
    return params, x, y, torch.randint(0, C, (B,), generator=g)


def _net(p, x):
    return torch.tanh(x @ p["w1"]) @ p["w2"]


# every one of these traces to ops with sharding rules (ATen's own, or PyTorch's core decompositions)
LOSSES = {
    "mse_loss": lambda o, y, t: F.mse_loss(o, y),
    "l1_loss": lambda o, y, t: F.l1_loss(o, y),
    "smooth_l1_loss": lambda o, y, t: F.smooth_l1_loss(o, y, beta=0.5),
    "huber_loss": lambda o, y, t: F.huber_loss(o, y, delta=0.7),
    "cross_entropy_label_smoothing": lambda o, y, t: F.cross_entropy(o, t, label_smoothing=0.1),
    "one_hot": lambda o, y, t: ((o - F.one_hot(t, C).to(o.dtype)) ** 2).mean(),
    "kl_div": lambda o, y, t: F.kl_div(F.log_softmax(o, -1), F.softmax(y, -1), reduction="batchmean"),
    "bce_with_logits": lambda o, y, t: F.binary_cross_entropy_with_logits(o, torch.sigmoid(y)),
    # torch's checks that no variance is negative (a value read) are left out when traced
    "gaussian_nll_loss": lambda o, y, t: F.gaussian_nll_loss(o, y, F.softplus(y) + 0.1),
    "gaussian_nll_loss_per_row": lambda o, y, t: F.gaussian_nll_loss(o, y, F.softplus(y[:, 0]) + 0.1, full=True),
    "vector_norm": lambda o, y, t: torch.linalg.vector_norm(o - y, dim=-1).mean(),
    # its backward writes into a slice of zeros it then reads whole (traced as a slice_scatter)
    "rfft": lambda o, y, t: torch.fft.rfft(o, dim=1).abs().mean(),
    "index_add": lambda o, y, t: torch.zeros(C, C).index_add(0, t, o).pow(2).sum(),
    "scatter_add": lambda o, y, t: torch.zeros(C, C).scatter_add(0, t[:, None].expand(B, C), o).pow(2).sum(),
    # ATen's backwards of these have no rule (they ran whole): traced as their math
    "multi_margin_loss": lambda o, y, t: F.multi_margin_loss(o, t, p=2, margin=0.7, weight=torch.linspace(0.5, 1.5, C)),
    # (its targets end at the first -1; PyTorch's decomposition read on past it: a wrong loss)
    "multilabel_margin_loss": lambda o, y, t: F.multilabel_margin_loss(
        o, torch.stack([t, (t + 1) % C, torch.full_like(t, -1), (t + 2) % C], 1)),
    # covariance losses (CORAL's, VICReg's): ATen's cov reads its normalizer's value to warn
    "cov": lambda o, y, t: (torch.cov(o.T) - torch.cov(y.T)).square().sum(),
    "corrcoef": lambda o, y, t: (torch.corrcoef(o.T) - torch.eye(C)).square().sum(),
    # a vision-language model's merge: rows of features written over the rows the mask picks, in
    # order (ATen's masked_scatter had no rule)
    "masked_scatter": lambda o, y, t: (o.masked_scatter((t == 0).unsqueeze(1).expand_as(o), y * 2) - y
                                       ).square().mean(),
    # sliding windows (audio framing): Tensor.unfold and its backward had no rule
    "sliding_windows": lambda o, y, t: (o.unfold(1, 2, 1).prod(-1) - y[:, 1:]).square().mean(),
    "literal_1d": lambda o, y, t: (o * torch.tensor([1.0, 2.0, 3.0, 4.0])).pow(2).mean(),
    "literal_2d": lambda o, y, t: (o @ torch.tensor([[1.0, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0],
                                                     [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.5, 1.0]])).pow(2).mean(),
    "literal_3d": lambda o, y, t: (o.view(B, 2, 2) * torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])).pow(2).mean(),
}

# mesh axes, parameter specs, batch spec
STRATEGIES = {
    "dp": (dict(dp=2), {"w1": P(), "w2": P()}, P("dp")),
    "fsdp": (dict(dp=2), {"w1": P("dp"), "w2": P("dp")}, P("dp")),
    "tp": (dict(tp=2), {"w1": P(None, "tp"), "w2": P("tp")}, P()),
}


def _sgd_step(loss):
    def step(p, x, y, t):
        value, g = nf.value_and_grad(lambda p: loss(_net(p, x), y, t))(p)
        return {k: v - 0.1 * g[k] for k, v in p.items()}, value

    return step


def _jitted(step, strategy):
    axes, pspec, bspec = STRATEGIES[strategy]
    mesh = nf.make_mesh(**axes)
    return nf.jit(step, mesh=mesh, in_shardings=(pspec, bspec, bspec, bspec), out_shardings=(pspec, P()))


def _trains_equal_to_one_device(loss, strategy):
    """One SGD step of `loss` jitted on 2 simulated ranks with `strategy` against eager on one device."""
    params, x, y, t = _data()
    step = _sgd_step(loss)
    want_params, want_loss = step(params, x, y, t)  # eager, one device
    with nf.simulate(2):
        got_params, got_loss = _jitted(step, strategy)(params, x, y, t)
        torch.testing.assert_close(nf.device_get(got_loss), want_loss, **TOL)
        for k in want_params:
            torch.testing.assert_close(nf.device_get(got_params[k]), want_params[k], **TOL)


def _split_by_the_batch_equals_eager(loss, params, x):
    """`loss`'s value and gradient jitted on dp=2 (`x` split by its first dim) against eager; the
    program's text."""
    want_grads, want_loss = torch.func.grad_and_value(loss)(params, x)
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                      out_shardings=(P(), P()))
        got_loss, got_grads = nf.device_get(step(params, x))
        program = step.lower(params, x).as_text()
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)
    return program


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_loss_without_an_aten_sharding_rule_trains_equal_to_one_device(loss, strategy):
    _trains_equal_to_one_device(LOSSES[loss], strategy)  # no ShardingWarning: an error here


def _fill_a_column(o, y, t):  # a write into a view of a tensor autograd tracks (its backward too)
    z = o * 1.0
    z[:, 0] = -1.0
    return F.mse_loss(z, y)


def _add_into_a_column(o, y, t):  # `+=` into a view: an add in place, then a copy into the view
    z = o * 1.0
    z[:, -1] += y[:, 0]
    return z.pow(2).mean()


def _copy_into_zeros(o, y, t):
    z = torch.zeros(B, C)
    z[:, 1] = o[:, 0]
    return F.mse_loss(z + o, y)


def _halves_of_an_empty_tensor(o, y, t):  # two writes into one tensor
    z = torch.empty(B, 2 * C)
    z[:, :C] = o
    z[:, C:] = y * o
    return z.pow(2).mean()


def _masked_write(o, y, t):
    z = o.clone()
    z[y > 0] = 0.0
    return F.mse_loss(z, y)


def _masked_add(o, y, t):
    z = o.clone()
    z.index_put_((y > 0,), torch.tensor(0.5), accumulate=True)
    return z.pow(2).mean()


def _rows_masked(o, y, t):  # a mask over the leading dim only
    z = o * 1.0
    z[t == 0] = 2.0
    return F.mse_loss(z, y)


def _masked_with_a_learned_value(o, y, t):  # the value's gradient: a sum over the masked positions
    z = o * 1.0
    z[y > 0] = o.sum() * 0.01
    return F.mse_loss(z, y)


def _masked_rows_get_a_learned_row(o, y, t):  # one row for every masked position (a mask embedding)
    z = o * 1.0
    z[t == 0] = o.mean(0)
    return F.mse_loss(z, y)


def _a_view_read_after_the_write(o, y, t):  # taken before the write, it sees the write
    z = torch.zeros(B, C)
    first = z[:, :2]
    z[:, :2] = o[:, :2] * 3
    return F.mse_loss(z + first.sum(-1, keepdim=True) + o, y)


def _a_view_of_the_written_view(o, y, t):  # taken of the column before it is written: sees the write
    z = o * 1.0
    column = z[:, 0]
    kept = column.unsqueeze(1)
    column.fill_(-1.0)
    return F.mse_loss(z + kept, y)


def _a_read_between_an_update_and_its_copy(o, y, t):  # the sum sees the column's update
    z = o * 1.0
    column = z[:, 0]
    column += 1.0
    total = z.sum()
    z[:, 0] = column
    return F.mse_loss(z * total, y)


def _diagonal_filled(o, y, t):
    s = (o.T @ o).clone()
    s.diagonal().fill_(0.0)
    return s.pow(2).mean()


def _scaled_through_a_transpose(o, y, t):  # autograd's backward writes through a permuted as_strided
    z = o * 1.0
    z.transpose(0, 1).mul_(torch.arange(1.0, z.shape[1] + 1).unsqueeze(1))
    return F.mse_loss(z, y)


def _a_row_of_a_transpose_filled(o, y, t):  # a select of a permuted view: as_strided, select, permute
    z = o * 1.0
    z.t()[1].fill_(2.0)
    return F.mse_loss(z, y)


def _a_row_of_an_unsqueezed_view_filled(o, y, t):  # left in place: a fill of what tp leaves a pending sum
    z = o * 1.0
    z.unsqueeze(0)[0, 1].fill_(2.0)
    return F.mse_loss(z, y)


def _a_slice_of_a_flattened_view_filled(o, y, t):  # a write through a reshape: autograd's as_strided, a window
    z = o * 1.0
    z.view(-1)[1:3].fill_(2.0)
    return F.mse_loss(z, y)


def _a_relative_shift_masked(o, y, t):  # Funnel's: a slice of the scores reshaped, scaled in place; its rows
    # step by 2S - 1, no dim's stride: autograd writes through an as_strided that is no slice of a dim
    s = o.shape[1]
    scores = torch.cat([o, o.flip(-1)], -1).unsqueeze(-1) * o.unsqueeze(-2)  # (B, 2S, S)
    shifted = scores[:, 1:].reshape(-1, s, 2 * s - 1)[..., :s]
    shifted *= torch.tril(torch.ones(s, s))
    return F.mse_loss(shifted.sum(-1), y)


def _a_column_scaled_then_rows_filled(o, y, t):  # an update in place through one view, then a write
    z = o * 1.0  # through another: each made functional in turn
    z[:, 0].mul_(2.0)
    z[1:3].fill_(2.0)
    return F.mse_loss(z, y)


def _a_scan_into_zeros_like_a_transpose(o, y, t):  # RecurrentGemma's: `zeros_like` keeps the transpose's
    # strides, and autograd reads each written step back by an as_strided of them (it ran whole,
    # over a gathered copy laid out otherwise: the gradients were wrong under dp)
    h = (o.unsqueeze(-1) * torch.arange(1.0, 4.0)).transpose(1, 2)  # (B, 3, C), stored (B, C, 3)
    out, s = torch.zeros_like(h), 0.0
    for step in range(h.shape[1]):
        s = 0.5 * s + h[:, step]
        out[:, step] = s
    return F.mse_loss(out.sum(1), y)


def _a_column_zeroed(o, y, t):  # zero_ is a write of zeros (as an update it became aten.zero: no rule)
    z = o * 1.0
    z[:, 0].zero_()
    return F.mse_loss(z, y)


def _every_other_element_clamped(o, y, t):  # through a reshape: autograd reads elements a step apart
    z = o * 1.0
    z.view(-1, 2)[:, 0].clamp_(min=0.0)
    return F.mse_loss(z, y)


IN_PLACE = {f.__name__[1:]: f for f in (_fill_a_column, _a_column_zeroed, _every_other_element_clamped,
                                        _a_scan_into_zeros_like_a_transpose,
                                        _scaled_through_a_transpose, _a_row_of_a_transpose_filled,
                                        _a_row_of_an_unsqueezed_view_filled, _a_slice_of_a_flattened_view_filled,
                                        _a_relative_shift_masked, _a_column_scaled_then_rows_filled,
                                        _add_into_a_column, _copy_into_zeros,
                                        _halves_of_an_empty_tensor, _masked_write, _masked_add, _rows_masked,
                                        _masked_with_a_learned_value, _masked_rows_get_a_learned_row,
                                        _a_view_read_after_the_write, _a_view_of_the_written_view,
                                        _a_read_between_an_update_and_its_copy, _diagonal_filled)}
# the columns of the output split too: a write or a mask over a dim the plan splits
WRITE_STRATEGIES = {**STRATEGIES, "tp_columns": (dict(tp=2), {"w1": P(), "w2": P(None, "tp")}, P())}


@pytest.mark.parametrize("strategy", list(WRITE_STRATEGIES))
@pytest.mark.parametrize("write", list(IN_PLACE))
def test_a_write_in_place_trains_equal_to_one_device(write, strategy, monkeypatch):
    # each is traced as the functional op it means (a view's scatter, a where), so the plan lays
    # it out as any other op; written in place, it was refused (or raised) on some of these
    monkeypatch.setitem(STRATEGIES, "tp_columns", WRITE_STRATEGIES["tp_columns"])
    _trains_equal_to_one_device(IN_PLACE[write], strategy)


@pytest.mark.parametrize("shape,size,stride,offset", [
    ([4, 64, 32], [4, 4, 16, 16], [512, 2048, 31, 1], 16),  # Funnel's relative shift, heads outermost
    ([4, 30], [4, 5, 5], [30, 6, 1], 0),  # rows of 6 of each row, 5 taken
    ([4, 30], [5, 4, 5], [6, 30, 1], 0),  # the same, its dims reordered
    ([8, 8], [7, 2], [9, 1], 1),  # a band above the diagonal
    ([6, 10], [6, 5], [10, 1], 3),  # a slice of a dim: as before, one slice
])
def test_an_as_strided_of_rows_is_views_taking_the_elements_torch_takes(shape, size, stride, offset):
    # autograd names the view a write goes through as an as_strided, which no rule lays out; read
    # as views (a grid over the elements, windows sliced and viewed as rows) it is laid out as they are
    from ndfunc._src.copy_slices import _as_view, contiguous_strides

    x = torch.arange(float(math.prod(shape))).view(shape)
    views = _as_view(shape, contiguous_strides(shape), size, stride, offset)
    got = x
    for op, *args in views:
        got = op(got, *args)
    want = x.as_strided(size, stride, offset)
    assert torch.equal(got, want) and got.stride() == want.stride() and got.storage_offset() == offset
    assert _as_view(shape, contiguous_strides(shape), [7, 8], [7, 1], 0) is None  # rows that overlap: no view
    first = torch.arange(6.0).view(2, 3)  # the diagonal's first element (not the diagonal: its length)
    for op, *args in _as_view([2, 3], [3, 1], [1], [4], 0):
        first = op(first, *args)
    assert first.tolist() == [0.0] and first.stride() == (4,)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_write_left_in_place_is_right_or_refused_never_wrong(strategy, monkeypatch):
    # written in place (no scatter: as a write into an input's view is left), dp splits z by rows
    # and the flattening takes it whole: the write would land in that copy, which nothing reads
    # (refused: it ran, silently wrong). tp leaves z a pending sum: a fill of each rank's part
    # made the sum twice the number (a fill now never writes into a pending sum)
    from ndfunc._src import writes

    monkeypatch.setattr(writes, "views_as_scatters", lambda gm: False)
    if strategy == "tp":
        _trains_equal_to_one_device(_a_slice_of_a_flattened_view_filled, strategy)
        return
    params, x, y, t = _data()
    with nf.simulate(2), pytest.raises(NotImplementedError, match=r"^aten\.fill_\.Scalar writes in place into slice_1, "
                                       r"a view of view, which the partitioner lays out otherwise for the view "
                                       r"\(\(Shard\(dim=0\),\) there, \(Replicate\(\),\) here\), and sub reads it"):
        _jitted(_sgd_step(_a_slice_of_a_flattened_view_filled), strategy)(params, x, y, t)


def test_a_block_that_reshapes_in_place_trains_split_by_the_batch():
    # GroupNorm's backward under torch.func reshapes its statistics in place (`unsqueeze_`), which
    # no rule lays out: traced as the view, nothing runs whole (a ShardingWarning would be an
    # error here)
    torch.manual_seed(0)
    params, buffers, apply = nf.nn.functional(torch.nn.GroupNorm(4, 8))
    x = torch.randn(4, 8, 16)
    _split_by_the_batch_equals_eager(lambda p, x: apply(p, buffers, x).square().mean(), params, x)


RECURRENT = {  # a layer, whether it reads (batch, steps, features), and initial states it is given
    "lstm": (lambda: torch.nn.LSTM(16, 64, batch_first=True), None),
    "lstm_2_layers_bidirectional": (lambda: torch.nn.LSTM(16, 64, num_layers=2, bidirectional=True,
                                                          batch_first=True), None),
    "lstm_projected_steps_first_with_states": (lambda: torch.nn.LSTM(16, 64, proj_size=32),
                                               lambda b: (torch.full((1, b, 32), 0.1), torch.full((1, b, 64), -0.2))),
    "gru_2_layers": (lambda: torch.nn.GRU(16, 64, num_layers=2, batch_first=True), None),
    "rnn_relu_bidirectional": (lambda: torch.nn.RNN(16, 64, nonlinearity="relu", bidirectional=True,
                                                    batch_first=True), None),
    "rnn_tanh_steps_first_with_states": (lambda: torch.nn.RNN(16, 64), lambda b: torch.full((1, b, 64), 0.3)),
}


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")  # (torch's, eager too)
@pytest.mark.parametrize("layer", list(RECURRENT))
def test_a_recurrent_layer_is_one_op_split_by_the_batch(layer):
    # traced op by op, a recurrent layer was its cells unrolled, dozens of ops per step (an LSTM of
    # 256 steps took 18 s to lower), and on CPU torch's LSTM picked oneDNN's layer kernel, which
    # has no rule (whole on every rank). Now one ndfunc::rnn per call and one for its gradient,
    # split by the batch, at 16 steps as at 64 (unrolled, 64 steps were thousands of ops)
    make, states = RECURRENT[layer]
    torch.manual_seed(0)
    module = make()
    params, buffers, apply = nf.nn.functional(module)

    def loss(p, x):
        x = x if module.batch_first else x.transpose(0, 1)
        made = apply(p, buffers, x) if states is None else apply(p, buffers, x, states(x.shape[1]))
        return made[0].square().mean()

    for steps in (16, 64):
        program = _split_by_the_batch_equals_eager(loss, params, torch.randn(8, steps, 16))
        calls = [line for line in program.splitlines() if "ndfunc.rnn" in line]
        assert len(calls) == 2 and "ndfunc.rnn_backward(" in calls[1]
        local = f"float32[4, {steps}," if module.batch_first else f"float32[{steps}, 4,"  # 4 samples a rank
        assert local in calls[0]
        assert len(program.splitlines()) < 256


def test_a_gradient_of_a_gradient_through_an_lstm_is_its_cells_op_by_op():
    # ndfunc::rnn's backward has no gradient of its own: under a second gradient the layer is its
    # cells, as torch's decomposition writes them, split by the batch as any ops
    torch.manual_seed(0)
    params, buffers, apply = nf.nn.functional(torch.nn.LSTM(16, 64, batch_first=True))

    def squared_gradient(p, x):
        grads = torch.func.grad(lambda p: apply(p, buffers, x)[0].square().mean())(p)
        return sum((g ** 2).sum() for g in grads.values())

    program = _split_by_the_batch_equals_eager(squared_gradient, params, torch.randn(8, 6, 16))
    assert "ndfunc.rnn" not in program and "mkldnn" not in program


@pytest.mark.parametrize("reduction,zero_infinity", [("mean", False), ("sum", False), ("none", False),
                                                   ("mean", True)])
@pytest.mark.parametrize("mesh", [dict(dp=2), dict(dp=2, tp=2)])
def test_a_ctc_loss_over_padded_targets_trains_split_by_the_samples(reduction, zero_infinity, mesh):
    # ATen's CTC kernel sizes its work by the longest target, a value: the trace raised
    # DataDependentError. Each sample's loss and gradient are ops of their own now, split by the
    # samples; lengths differ per sample, and with zero_infinity one sample cannot be aligned
    # (its input is shorter than its target: an infinite loss, zeroed). In float64: the gradient
    # sums over samples and steps, split here, whole there
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 12, generator=g, dtype=torch.float64)}
    x = torch.randn(4, 20, 16, generator=g, dtype=torch.float64)
    targets = torch.randint(1, 12, (4, 6), generator=g)
    input_lengths = torch.tensor([20, 17, 4 if zero_infinity else 20, 12])
    target_lengths = torch.tensor([6, 3, 5, 6])

    def loss(p, x, targets, input_lengths, target_lengths):
        log_probs = (x @ p["w"]).log_softmax(-1).transpose(0, 1)  # (time, samples, classes)
        losses = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction=reduction,
                            zero_infinity=zero_infinity)
        return losses.square().mean() if reduction == "none" else losses
    args = (params, x, targets, input_lengths, target_lengths)
    want_grads, want_loss = torch.func.grad_and_value(loss)(*args)
    with nf.simulate(math.prod(mesh.values())):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(**mesh),
                      in_shardings=({"w": P(None, "tp") if "tp" in mesh else P()}, P("dp"), P("dp"), P("dp"), P("dp")),
                      out_shardings=(P(), {"w": P()}))
        got_loss, got_grads = nf.device_get(step(*args))
        program = step.lower(*args).as_text()
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)
    assert "ctc_losses" in program and "_ctc_loss" not in program  # split, not run whole


def test_a_ctc_loss_mapped_over_groups_is_one_call_over_their_samples():
    # torch.func.vmap over F.ctc_loss (a loss per group of samples): the mapped dim is folded into
    # the samples; the reference maps by a Python loop on one device
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 12, generator=g, dtype=torch.float64)
    x = torch.randn(4, 2, 20, 16, generator=g, dtype=torch.float64)
    targets, target_lengths = torch.randint(1, 12, (4, 2, 6), generator=g), torch.tensor([[6, 3]] * 4)

    def per_group(w, x, targets, target_lengths):
        return F.ctc_loss((x @ w).log_softmax(-1).transpose(0, 1), targets, torch.tensor([20, 17]), target_lengths)

    def loss(w, x, targets, target_lengths):
        return torch.func.vmap(per_group, in_dims=(None, 0, 0, 0))(w, x, targets, target_lengths).square().sum()
    want_grad, want_loss = torch.func.grad_and_value(
        lambda w: sum(per_group(w, *group).square() for group in zip(x, targets, target_lengths)))(w)
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp"), P("dp"), P("dp")),
                      out_shardings=(P(), P()))
        got_loss, got_grad = nf.device_get(step(w, x, targets, target_lengths))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_an_unbatched_ctc_loss_is_a_batch_of_one_and_float_lengths_are_an_error(reduction):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 12, generator=g, dtype=torch.float64)
    x, targets = torch.randn(20, 16, generator=g, dtype=torch.float64), torch.randint(1, 12, (6,), generator=g)

    def loss(w, x, input_length):
        return F.ctc_loss((x @ w).log_softmax(-1), targets, input_length, torch.tensor(6), reduction=reduction).sum()
    want_grad, want_loss = torch.func.grad_and_value(loss)(w, x, torch.tensor(20))
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), out_shardings=(P(), P()))
        got_loss, got_grad = nf.device_get(step(w, x, torch.tensor(20)))
        with pytest.raises(TypeError) as e:
            step(w, x, torch.tensor(19.5))
    assert str(e.value) == ("F.ctc_loss: input_lengths must be integers, as torch requires; got torch.float32. "
                            "Pass them as an integer tensor (torch.long) or a list of ints.")
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("between", ["rows_and_prototypes", "batched_sets"])
def test_distances_between_rows_train_split_by_the_rows_or_the_batch(between, p):
    # ATen's direct cdist kernel (a few rows; above 25, p=2 is matmuls) and its backward had no
    # rule: they ran whole on every rank (a ShardingWarning, an error here). Split by x1's rows,
    # x2's gradient is a sum over them left pending; float64: summed in another order
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 6, generator=g, dtype=torch.float64),
              "prototypes": torch.randn(5, 6, generator=g, dtype=torch.float64)}
    x = torch.randn(*((12,) if between == "rows_and_prototypes" else (4, 6)), 8, generator=g, dtype=torch.float64)

    def loss(params, x):
        h = x @ params["w"]
        if between == "rows_and_prototypes":
            return torch.cdist(h, params["prototypes"], p=p).square().mean()
        return torch.cdist(h, 2 * h.flip(-2), p=p).mean()
    want_grads, want_loss = torch.func.grad_and_value(loss)(params, x)
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                      out_shardings=(P(), P()))
        got_loss, got_grads = nf.device_get(step(params, x))
        plan = step.lower(params, x).program.plan
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)
    (distances,) = [n for n in plan.strategy if n.target is torch.ops.aten._cdist_forward.default]
    assert plan.strategy[distances].outs == ((Shard(0),),)  # rows, or sets, split as the batch is


@pytest.mark.parametrize("mode", ["replicate", "reflect", "circular"])
@pytest.mark.parametrize("dims", [1, 2])
def test_a_padded_convolution_trains_split_by_the_batch(mode, dims):
    # replication padding's backward has neither a rule nor a decomposition (now a rule: any split
    # of the samples and channels); circular padding writes into views of views of an empty tensor
    # (traced as nested scatters). Nothing runs whole (a ShardingWarning would be an error here)
    torch.manual_seed(0)
    conv = (torch.nn.Conv1d if dims == 1 else torch.nn.Conv2d)(3, 4, 3, padding=1, padding_mode=mode)
    params, buffers, apply = nf.nn.functional(conv)
    x = torch.randn(4, 3, *[8] * dims)
    loss = lambda p, x: apply(p, buffers, x).square().mean()  # noqa: E731
    want_grads, want_loss = torch.func.grad_and_value(loss, argnums=(0, 1))(params, x)  # the padding's too
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss, argnums=(0, 1)), mesh=nf.make_mesh(dp=2),
                      in_shardings=(P(), P("dp")), out_shardings=(P(), (P(), P("dp"))))
        got_loss, got_grads = nf.device_get(step(params, x))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)


POOLS = {
    "avg_2d_ceil": (2, lambda x: F.avg_pool2d(x, (2, 1), stride=(2, 1), ceil_mode=True)),  # Funnel's
    "avg_3d": (3, lambda x: F.avg_pool3d(x, 2)),
    "max_3d": (3, lambda x: F.max_pool3d(x, 2)),
    "adaptive_avg_3d": (3, lambda x: F.adaptive_avg_pool3d(x, 3)),
    "adaptive_max_2d": (2, lambda x: F.adaptive_max_pool2d(x, 3)),
    "adaptive_max_3d": (3, lambda x: F.adaptive_max_pool3d(x, 3)),
    # Swin's pooler: ATen restrides the result in place (as_strided_), its backward views a flat
    # buffer with size-1 dims added (as_strided): neither had a rule
    "adaptive_avg_1d_transposed": (1, lambda x: F.adaptive_avg_pool1d(x.transpose(1, 2), 1)),
}


@pytest.mark.parametrize("pool", list(POOLS))
def test_a_pooling_trains_split_by_the_batch(pool):
    # DTensor splits these forwards by samples and channels, not their backwards: those ran whole
    # (a ShardingWarning, an error here); a rule now splits them alike
    dims, fn = POOLS[pool]
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(6, 6, generator=g), torch.randn(4, 2, *[6] * dims, generator=g)
    _split_by_the_batch_equals_eager(lambda w, x: fn(x @ w).square().mean(), w, x)


@pytest.mark.parametrize("mode,weighted,padding_idx", [("sum", False, None), ("mean", False, None), ("max", False, None),
                                                       ("sum", True, None), ("mean", False, 0), ("max", False, 0)])
@pytest.mark.parametrize("strategy", ["dp", "tp"])
def test_an_embedding_bag_of_rows_trains_split_by_bags_or_by_the_vocabulary(mode, weighted, padding_idx, strategy):
    # ATen's bag kernel has no sharding rule: a bag per row is traced as the embedding's rows
    # reduced, which lays out as any embedding (nothing runs whole: a ShardingWarning would be an
    # error here). Row 1 is all padding (an empty bag: zeros), row 2 partly.
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(20, 8, mode=mode, padding_idx=padding_idx)
    params, buffers, apply = nf.nn.functional(bag)
    g = torch.Generator().manual_seed(0)
    x, w, y = torch.randint(0, 20, (4, 5), generator=g), torch.rand(4, 5, generator=g), torch.randn(4, 8, generator=g)
    x[1, :], x[2, :2] = 0, 0

    def loss(p, x, w, y):
        return (apply(p, buffers, x, per_sample_weights=w if weighted else None) - y).square().mean()

    want_grads, want_loss = torch.func.grad_and_value(loss)(params, x, w, y)
    axes, pspec, split = {"dp": (dict(dp=2), P(), P("dp")), "tp": (dict(tp=2), {"weight": P("tp")}, P())}[strategy]
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(**axes), in_shardings=(pspec, split, split, split),
                      out_shardings=(P(), pspec))
        got_loss, got_grads = nf.device_get(step(params, x, w, y))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)


@pytest.mark.parametrize("mode,weighted,padding_idx,last", [("sum", False, None, False), ("sum", True, None, True),
                                                            ("mean", False, 0, False), ("max", False, None, True),
                                                            ("max", False, 0, False)])
@pytest.mark.parametrize("strategy", ["dp", "tp"])
def test_an_embedding_bag_by_offsets_trains_with_nothing_run_whole(mode, weighted, padding_idx, last, strategy):
    # bags as runs of 1-dim indices from each offset (their sizes are values) ran in ATen's bag
    # kernel, whole on every rank; traced as the rows summed (index_add) or maxed (scatter_reduce)
    # into their bags, nothing runs whole (a ShardingWarning would be an error here). Bag 1 is
    # empty, bag 2 all padding (both zeros), bag 0 partly padding.
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(20, 8, mode=mode, padding_idx=padding_idx, include_last_offset=last)
    params, buffers, apply = nf.nn.functional(bag)
    g = torch.Generator().manual_seed(0)
    x, w, y = torch.randint(1, 20, (12,), generator=g), torch.rand(12, generator=g), torch.randn(4, 8, generator=g)
    x[1], x[4:6] = 0, 0
    offsets = torch.tensor([0, 4, 4, 6] + ([12] if last else []))

    def loss(p, x, o, w, y):
        return (apply(p, buffers, x, o, per_sample_weights=w if weighted else None) - y).square().mean()

    want_grads, want_loss = torch.func.grad_and_value(loss)(params, x, offsets, w, y)
    axes, pspec, split = {"dp": (dict(dp=2), P(), P("dp")), "tp": (dict(tp=2), {"weight": P("tp")}, P())}[strategy]
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(**axes),
                      in_shardings=(pspec, split, P(), split, split), out_shardings=(P(), pspec))
        got_loss, got_grads = nf.device_get(step(params, x, offsets, w, y))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)


@pytest.mark.parametrize("reduce", ["amax", "sum", "mean"])
def test_a_scatter_reduce_stays_split_along_the_dims_it_does_not_scatter_over(reduce):
    # ATen's scatter_reduce had no rule (it ran whole); a maximum of hidden units per class keeps
    # tp's split of the hidden units, as its backward's gathers and scatters do
    g = torch.Generator().manual_seed(0)
    hidden = 512
    params = {"w1": torch.randn(D, hidden, generator=g) * 0.3, "w2": torch.randn(hidden, C, generator=g) * 0.1}
    x, t = torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)

    def loss(p, x, t):
        h = torch.tanh(x @ p["w1"])
        per_class = h.new_zeros(C, hidden).scatter_reduce(0, t[:, None].expand_as(h), h, reduce, include_self=False)
        return (per_class @ p["w2"]).pow(2).mean()

    want_grads, want_loss = torch.func.grad_and_value(loss)(params, x, t)
    spec = {"w1": P(None, "tp"), "w2": P("tp")}
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(tp=2), in_shardings=(spec, P(), P()),
                      out_shardings=(P(), spec))
        got_loss, got_grads = nf.device_get(step(params, x, t))
        plan = step.lower(params, x, t).program.plan
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)
    assert [s.outs for n, s in plan.strategy.items() if n.target is torch.ops.aten.scatter_reduce.two] == [(
        (Shard(1),),)]


def test_an_embedding_scaled_by_frequency_counts_each_token_over_every_rank():
    # its backward divides each row's gradient by its token's count in the batch: DTensor's rule
    # split the indices, and each rank counted its own block (row 1's gradient came out twice)
    g = torch.Generator().manual_seed(0)
    w, idx = torch.randn(6, 4, generator=g), torch.tensor([[1, 1, 2], [0, 5, 1]])
    loss = lambda w, idx: F.embedding(idx, w, scale_grad_by_freq=True).square().sum()  # noqa: E731
    want_grad, want_loss = torch.func.grad_and_value(loss)(w, idx)
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                      out_shardings=(P(), P()))
        got_loss, got_grad = nf.device_get(step(w, idx))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)


@pytest.mark.parametrize("matrices", [(2, 3, 3), (3, 3)])
def test_a_triangular_solve_splits_the_right_hand_sides_by_a_batch_the_matrices_broadcast_over(matrices):
    # DTensor's rule split B's batch with A whole, as if A broadcast over it: with a matrix per
    # sample each rank solved its block of B against every matrix (a wrong loss, or a raise)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(*matrices, generator=g).triu() + 3 * torch.eye(3)
    b = torch.randn(2, 3, 4, generator=g)

    def loss(a, b):
        return torch.linalg.solve_triangular(a, b, upper=True).square().sum()

    want_grads, want_loss = torch.func.grad_and_value(loss, argnums=(0, 1))(a, b)
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss, argnums=(0, 1)), mesh=nf.make_mesh(dp=2),
                      in_shardings=(P(), P("dp")), out_shardings=(P(), (P(), P())))
        got_loss, got_grads = nf.device_get(step(a, b))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)


NO_RULE = {  # ops (or their backwards) without a sharding rule, traced as ops that have one; x (8, 3), y (8, 2)
    "bilinear": lambda x, y: F.bilinear(x, y, torch.linspace(-1.0, 1.0, 30).view(5, 3, 2)).square().sum(),
    "hardshrink": lambda x, y: F.hardshrink(x, 0.3).square().sum(),
    "softshrink": lambda x, y: F.softshrink(x, 0.3).square().sum(),
    "dist": lambda x, y: torch.dist(x[:, :2], y, 3),
    "addmv": lambda x, y: torch.addmv(x[:, 0], x, torch.linspace(0.5, 1.5, 3), beta=0.5, alpha=2.0).square().sum(),
    "polar": lambda x, y: torch.view_as_real(torch.polar(x[:, :2].abs(), y)).square().sum(),
    "complex": lambda x, y: torch.view_as_real(torch.complex(x[:, 1:], y)).square().sum(),
    # a mixture of experts' routing: rows repeated by counts, the output's size given
    "repeat_interleave": lambda x, y: (torch.repeat_interleave(x, torch.tensor([1, 2, 0, 3, 1, 1, 2, 2]), dim=0,
                                                               output_size=12) * torch.arange(12.0)[:, None]).sum(),
}


@pytest.mark.parametrize("op", list(NO_RULE))
def test_an_op_without_a_rule_of_its_own_splits_by_the_batch(op):
    # each ran whole on every rank (a ShardingWarning, an error here)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
    want_grad, want_loss = torch.func.grad_and_value(NO_RULE[op])(x, y)
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(NO_RULE[op]), mesh=nf.make_mesh(dp=2), in_shardings=(P("dp"), P("dp")),
                      out_shardings=(P(), P("dp")))
        got_loss, got_grad = nf.device_get(step(x, y))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)


def test_transformers_grouped_matmul_of_experts_splits_its_weights_as_megatron_does():
    # transformers' float32 mixture of experts calls its custom op (its gradient registered: see
    # `_src/custom_gradients.py`); with no rule it ran whole, the experts' weights gathered. Its rule
    # splits the first matmul's columns and the second's rows: the pending sum is reduced once
    import transformers.integrations.moe  # noqa: F401 (defines transformers::grouped_mm_fallback)

    if not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        pytest.skip("this transformers (before 5) has no grouped_mm_fallback op")
    fallback = torch.ops.transformers.grouped_mm_fallback

    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(4, 16, 32, generator=g) * 0.2, "w2": torch.randn(4, 32, 16, generator=g) * 0.2}
    x, offs = torch.randn(12, 16, generator=g), torch.tensor([3, 6, 6, 12], dtype=torch.int32)

    def loss(p, x):
        h = fallback(x, p["w1"], offs=offs).relu()
        return fallback(h, p["w2"], offs=offs).square().mean()

    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    want_loss = loss(leaves, x)
    want_grads = dict(zip(leaves, torch.autograd.grad(want_loss, list(leaves.values()))))
    spec = {"w1": P(None, None, "tp"), "w2": P(None, "tp", None)}
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(tp=2), in_shardings=(spec, P()),
                      out_shardings=(P(), spec))
        got_loss, got_grads = nf.device_get(step(params, x))
        plan = step.lower(params, x).program.plan
    torch.testing.assert_close(got_loss, want_loss.detach(), **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)
    made = [s.outs[0] for n, s in plan.strategy.items() if n.target is fallback.default]
    assert made == [(Shard(1),), (Partial(),)]


def test_an_as_strided_over_a_gathered_transpose_reads_the_memory_it_was_traced_over():
    # as_strided (no rule: whole) reads memory, not elements: over z.t().clone(), split by dp and
    # gathered for it (contiguous), it read other elements (a wrong loss); the gathered copy is
    # now laid out as the trace's first
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(6, 6, generator=g), torch.randn(8, 6, generator=g)
    windows = lambda z: torch.as_strided(z.t().clone(), (5, 2, 4), (1, 1, 6))  # noqa: E731 (overlapping)
    loss = lambda w, x: windows(torch.tanh(x @ w)).square().sum()  # noqa: E731
    want_grad, want_loss = torch.func.grad_and_value(loss)(w, x)
    with nf.simulate(2), pytest.warns(nf.sharding.ShardingWarning, match="no sharding rule for aten.as_strided"):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                      out_shardings=(P(), P()))
        got_loss, got_grad = nf.device_get(step(w, x))
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)


def test_an_as_strided_over_a_gathered_value_with_gaps_is_refused_not_read_wrong():
    # a slice of columns has gaps in its memory: no copy the plan gathers for it is laid out so,
    # and the strides would read other elements. The partitioner gathers before such a view (the
    # end-to-end cases never move it), so the lowering is asked here with a plan that moves it
    from types import SimpleNamespace

    from ndfunc._src.partition.planning import ops
    from ndfunc._src.partition.planning.strategies import Strategy

    graph = torch.fx.Graph()
    x = graph.placeholder("columns")
    x.meta["val"] = torch.empty(4, 6)[:, 1:]
    node = graph.call_function(torch.ops.aten.as_strided.default, (x, [2, 2], [1, 1], 1))
    node.meta["val"] = torch.empty(2, 2)
    whole = (Replicate(),)
    plan = SimpleNamespace(strategy={x: Strategy(outs=((Shard(0),),), ins=()),
                                     node: Strategy(outs=(whole,), ins=(whole,))})
    with pytest.raises(NotImplementedError, match=re.escape(
            "aten.as_strided.default views columns by its strides, which the partitioner moves for it ((Shard(dim=0),) "
            "there, (Replicate(),) here) and whose elements do not fill their storage: the moved copy's memory is laid "
            "out otherwise. Write the view with slices, transposes and reshapes (x.unfold for sliding windows), or run "
            "it inside nf.shard_map.")):
        ops._as_strided(SimpleNamespace(plan=plan), node, [x])


@torch.library.custom_op("ndfunc_tests::scaled_mm", mutates_args=())
def _scaled_mm(x: torch.Tensor, w: torch.Tensor, *, scale: float) -> torch.Tensor:
    return x @ w * scale


_scaled_mm.register_fake(lambda x, w, *, scale: x.new_empty(x.shape[0], w.shape[1]))


def _scaled_mm_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.scale = keyword_only_inputs["scale"]


def _scaled_mm_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w.T * ctx.scale if ctx.needs_input_grad[0] else None, x.T @ grad * ctx.scale


torch.library.register_autograd("ndfunc_tests::scaled_mm", _scaled_mm_backward, setup_context=_scaled_mm_context)


def test_a_custom_op_with_a_registered_gradient_trains_under_jit():
    # torch.func refuses the Function torch makes of a custom op's registered gradient (no
    # setup_context), so nf.value_and_grad raised (transformers' grouped matmul of a mixture of
    # experts, in float32 under a compiler); called through one that has it, it runs whole (no rule)
    params, x, y, t = _data()
    loss = lambda p, x: (_scaled_mm(torch.tanh(x @ p["w1"]), p["w2"], scale=0.5) - y).square().mean()  # noqa: E731
    want_loss = loss(params, x)
    want_grads = dict(zip(params, torch.autograd.grad(loss({k: v.requires_grad_() for k, v in params.items()}, x),
                                                      list(params.values()))))
    params = {k: v.detach() for k, v in params.items()}
    with nf.simulate(2), pytest.warns(nf.sharding.ShardingWarning, match="no sharding rule for ndfunc_tests.scaled_mm"):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                      out_shardings=(P(), P()))
        got_loss, got_grads = nf.device_get(step(params, x))
    torch.testing.assert_close(got_loss, want_loss.detach(), **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)


class _OldStyleGelu(torch.autograd.Function):  # BLOOM's GeLUFunction: forward(ctx, x), no setup_context
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class _OldStyleScaledExp(torch.autograd.Function):  # saves its output, keeps a number on its context
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        out = torch.exp(x) * ctx.scale  # (read back)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out, None


@pytest.mark.parametrize("function", ["gelu", "scaled_exp"])
def test_an_old_style_autograd_function_trains_under_jit_and_torch_func_is_left_as_it_is(function):
    # torch.func refuses a Function without setup_context (BLOOM's GeLU, RecurrentGemma's square
    # root): every BLOOM raised. Inside a traced step it is applied as one with setup_context
    params, x, y, t = _data()
    act = _OldStyleGelu.apply if function == "gelu" else lambda z: _OldStyleScaledExp.apply(z * 0.1, 0.5)
    loss = lambda p, x: (act(x @ p["w1"]) @ p["w2"] - y).square().mean()  # noqa: E731
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    value = loss(leaves, x)
    want_grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                      out_shardings=(P(), P()))
        got_loss, got_grads = nf.device_get(step(params, x))
    torch.testing.assert_close(got_loss, value.detach(), **TOL)
    torch.testing.assert_close(got_grads, want_grads, **TOL)
    with pytest.raises(RuntimeError, match="must override the setup_context staticmethod"):
        torch.func.grad(loss)(params, x)  # outside a traced step, torch's own
    # under a gradient of a gradient what the forward saved would be a constant: torch's refusal
    squared = lambda p, x: sum(g.square().sum() for g in torch.func.grad(loss)(p, x).values())  # noqa: E731
    with nf.simulate(2), pytest.raises(RuntimeError, match="must override the setup_context staticmethod"):
        nf.jit(nf.value_and_grad(squared), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
               out_shardings=(P(), P()))(params, x)


def test_the_math_traced_for_torch_functions_keeps_their_shapes_and_checks():
    from ndfunc._src import traced_as

    x, target = torch.randn(4), torch.tensor([2])
    assert traced_as._multi_margin_loss(x, target, reduction="none").shape == F.multi_margin_loss(
        x, target, reduction="none").shape == (1,)
    ints = torch.arange(12).view(3, 4)
    torch.testing.assert_close(traced_as._cov(ints), torch.cov(ints))  # (torch's own: a mean of integers)
    with pytest.raises(RuntimeError, match="masked_scatter: expected self and source to have same dtypes"):
        traced_as._masked_scatter(torch.zeros(4), torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.float64))
    with pytest.raises(RuntimeError):  # batches that differ: torch's refusal, not a broadcast
        traced_as._bilinear(torch.randn(2, 3), torch.randn(1, 3), torch.randn(5, 3, 3))
    counts = torch.tensor([2])  # one count for every row: torch broadcasts it
    rows = torch.randn(4, 3)
    torch.testing.assert_close(traced_as._repeat_interleave(rows, counts, 0, output_size=8),
                               torch.repeat_interleave(rows, counts, 0, output_size=8))


def _binned(o, y, t):  # ATen's searchsorted has no sharding rule and no decomposition
    return (o * torch.searchsorted(torch.tensor([-1.0, 0.0, 1.0]), o)).pow(2).mean()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_an_op_with_no_rule_runs_whole_with_one_warning_naming_it_and_the_line(strategy):
    params, x, y, t = _data()
    step = _sgd_step(_binned)
    want_params, want_loss = step(params, x, y, t)
    with nf.simulate(2):
        f = _jitted(step, strategy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lowered = f.lower(params, x, y, t)
        assert [str(w.message) for w in caught if w.category is nf.sharding.ShardingWarning] == [
            "step: no sharding rule for aten.searchsorted.Tensor, made at "
            f"{__file__}:{_binned.__code__.co_firstlineno + 1} (return (o * torch.searchsorted(torch.tensor("
            "[-1.0, 0.0, 1.0]), o)).pow(2).mean()). Each runs whole on every rank: its inputs gathered where "
            "they are sharded, its results replicated (the plan prices the gathers). To keep the work sharded, "
            "write it with ops that have rules, run it per block inside nf.shard_map, or add a rule (the op "
            "registry: docs/architecture.md)."]
        assert caught[0].filename == __file__  # the warning points at the user's call
        if strategy != "tp":  # the batch is split: the op's input is gathered for it
            assert lowered.cost_analysis()["collectives"].get("all_gather", 0) >= 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", nf.sharding.ShardingWarning)
            got_params, got_loss = f(params, x, y, t)
        torch.testing.assert_close(nf.device_get(got_loss), want_loss, **TOL)
        for k in want_params:
            torch.testing.assert_close(nf.device_get(got_params[k]), want_params[k], **TOL)


def test_a_user_replicated_op_with_no_rule_does_not_warn():
    x, edges = torch.rand(8), torch.linspace(0, 1, 5)

    def replicated(x, edges):
        return torch.searchsorted(nf.with_sharding_constraint(edges, P()), nf.with_sharding_constraint(x, P()))

    with nf.simulate(2):
        got = nf.jit(replicated, mesh=nf.make_mesh(dp=2), in_shardings=(P("dp"), P()))(x, edges)
    assert torch.equal(nf.device_get(got), torch.searchsorted(edges, x))


# --- code that needs a tensor's value ------------------------------------------------------------

def _branch(x):
    if x.sum() > 0:
        return x * 2
    return x


def _item(x):
    return x * x.max().item()


def _float(x):
    return x / float(x.sum())


def _mask(x):
    return x[x > 0].sum()


def _unique(x):
    return torch.unique(x).sum() + x.sum()


def _ctc_concatenated(x):
    return F.ctc_loss(x.reshape(2, 1, 4).log_softmax(-1), torch.tensor([1, 2]), *[torch.tensor([2])] * 2)


def _split_at(x):
    return sum(part.sum() for part in torch.tensor_split(x, (x[:2] * 0 + 3).long()))


READS = ("reads a tensor's value (aten._local_scalar_dense.default: `.item()`, `float(x)`, `int(x)`, `bool(x)` "
         "or `if x:` on a tensor)")
SHAPES = "makes a shape from a tensor's values ({op}: `x[mask]`, `nonzero`, `unique`, `masked_select`)"
VALUE_CASES = {
    "if": (_branch, READS, "if x.sum() > 0:"),
    "item": (_item, READS, "return x * x.max().item()"),
    "float": (_float, READS, "return x / float(x.sum())"),
    "mask": (_mask, SHAPES.format(op="aten.nonzero.default"), "return x[x > 0].sum()"),
    "unique": (_unique, SHAPES.format(op="aten._unique2.default"), "return torch.unique(x).sum() + x.sum()"),
    "ctc_concatenated": (_ctc_concatenated, "makes a shape from a tensor's values (aten._ctc_loss.Tensor: targets "
                         "concatenated in one dim, bounded by their lengths)",
                         "return F.ctc_loss(x.reshape(2, 1, 4).log_softmax(-1), torch.tensor([1, 2]), "
                         "*[torch.tensor([2])] * 2)"),
    # (ATen's kernel reads the indices' data itself: it raised torch's "data is not allocated yet")
    "tensor_split": (_split_at, "reads a tensor's value (an op given a tensor where it reads numbers: "
                     "`torch.tensor_split` or `torch.narrow` with tensor indices)",
                     "return sum(part.sum() for part in torch.tensor_split(x, (x[:2] * 0 + 3).long()))"),
}


@pytest.mark.parametrize("under_grad", [False, True], ids=["jit", "grad"])
@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_code_that_needs_a_value_is_an_error_naming_the_line_and_what_to_do(case, under_grad):
    fn, what, code = VALUE_CASES[case]
    step = nf.grad(lambda x: fn(x).sum()) if under_grad else fn
    line = fn.__code__.co_firstlineno + 1
    instead = ("pass F.ctc_loss the targets padded to (samples, longest target), with their lengths" if "ctc" in what
               else "torch.where(mask, x, 0) keeps the shape" if "shape" in what else
               "indices as Python ints (static_argnums for those the program depends on)" if "indices" in what else
               "torch.where(cond, a, b) for a choice made per element; a static argument (static_argnums)")
    with nf.simulate(2):
        f = nf.jit(step, mesh=nf.make_mesh(dp=2), in_shardings=P("dp"))
        with pytest.raises(nf.DataDependentError) as e:
            f(torch.randn(8))
    message = str(e.value)
    assert message.startswith(f"{'<lambda>' if under_grad else fn.__name__} {what} at {__file__}:{line} ({code}). "
                              "A traced step sees shapes and dtypes, not values: nf.jit makes one program for every "
                              "value of its inputs, so Python cannot branch on a value or make a shape from one. "
                              f"Instead: {instead}"), message
    assert "DataDependentOutputException" not in message and "DynamicOutputShapeException" not in message


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("axes,specs", [(dict(dp=2), (P("dp"), P(), P("dp"))), (dict(tp=2), (P(), P("tp"), P()))],
                         ids=["rows", "vocabulary"])
def test_linear_cross_entropy_in_chunks_is_traced_as_its_reference(reduction, axes, specs):
    # its chunked path (options) is a custom op whose forward makes the gradients; torch.func refuses it
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    options = LinearCrossEntropyOptions(batch_chunk_size=2)
    g = torch.Generator().manual_seed(0)
    x, w, t = torch.randn(8, 6, generator=g), torch.randn(10, 6, generator=g), torch.randint(0, 10, (8,), generator=g)
    t[3] = -100  # ignored

    def loss(x, w, t):
        return F.linear_cross_entropy(x, w, t, reduction=reduction, options=options).square().sum()

    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    want = loss(*leaves, t)
    want.backward()
    with nf.simulate(2):
        f = nf.jit(nf.value_and_grad(loss, argnums=(0, 1)), mesh=nf.make_mesh(**axes), in_shardings=specs)
        got, grads = nf.device_get(f(x, w, t))
    torch.testing.assert_close(got, want.detach())
    for a, b in zip(grads, leaves):
        torch.testing.assert_close(a, b.grad)


def _tolist(x):
    return x * len([v for v in x.tolist() if v > 0])


def test_tolist_under_a_gradient_is_the_same_error_naming_the_line():
    # torch.func's grad wrapper says "tolist() shouldn't be called on a tensor with unallocated
    # storage" (Qwen2-VL's image grid read as numbers); a plain trace names the op
    line = _tolist.__code__.co_firstlineno + 1
    with nf.simulate(2):
        f = nf.jit(nf.grad(lambda x: _tolist(x).sum()), mesh=nf.make_mesh(dp=2), in_shardings=P("dp"))
        with pytest.raises(nf.DataDependentError, match=re.escape(
                f"<lambda> reads a tensor's value (`.tolist()`: `.item()`, `float(x)`, `int(x)`, `bool(x)` or `if "
                f"x:` on a tensor) at {__file__}:{line} (return x * len([v for v in x.tolist() if v > 0])). A traced "
                f"step sees shapes and dtypes, not values")):
            f(torch.randn(8))


@pytest.mark.parametrize("under_grad", [False, True], ids=["jit", "grad"])
def test_a_libraries_value_check_and_its_message_trace_without_reading_values(under_grad):
    # transformers' image-token check of a vision-language model, under a compiler: the message an
    # f-string of a traced count (torch reads a number's value to format it), the check
    # torch._check_tensor_all(cond), a compiler's hint
    messages = []

    def loss(w, ids, x):
        n = (ids == 3).sum()
        messages.append(f"tokens: {n}, {n:d}, features: {x.shape[0]}, rows: {x[0]}, mean: {x.mean():.2f}, "
                        f"scale: {torch.tensor(0.5):.2f}")  # a literal: its value is known
        torch._check_tensor_all(n * x.shape[1] >= 0, lambda: messages[-1])
        return (x @ w).square().sum()

    g = torch.Generator().manual_seed(0)
    w, ids, x = torch.randn(4, 2, generator=g), torch.randint(0, 5, (8,), generator=g), torch.randn(8, 4, generator=g)
    step = nf.value_and_grad(loss) if under_grad else loss
    expected = step(w, ids, x)
    with nf.simulate(2):
        f = nf.jit(step, mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp"), P("dp")))
        got = nf.device_get(f(w, ids, x))
        with pytest.raises(TypeError, match=r"^cond tensor must have dtype torch.bool, but got torch.int64$"):
            nf.jit(lambda x: torch._check_tensor_all(x.sum()) or x, mesh=nf.make_mesh(dp=2), in_shardings=P("dp"))(ids)
    torch.testing.assert_close(got, expected)
    assert messages[-1] == ("tokens: <traced int64[]>, <traced int64[]>, features: 8, rows: <traced float32[4]>, "
                            "mean: <traced float32[]>, scale: 0.50")


def test_a_draw_from_torchs_generator_is_an_error_and_dropout_off_is_fine():
    def noisy(x):
        return x + torch.rand_like(x)

    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        with pytest.raises(nf.DataDependentError, match=re.escape(
                f"noisy draws random numbers from torch's global generator (aten.rand_like.default) at "
                f"{__file__}:{noisy.__code__.co_firstlineno + 1} (return x + torch.rand_like(x)). A traced step "
                f"holds no generator state")):
            nf.jit(noisy, mesh=mesh, in_shardings=P("dp"))(torch.ones(8))
        off = nf.jit(lambda x: F.dropout(x, 0.0, training=True) * 2, mesh=mesh, in_shardings=P("dp"))
        assert torch.equal(nf.device_get(off(torch.ones(8))), torch.full((8,), 2.0))


def test_libraries_see_that_they_are_being_compiled_inside_jit_and_grad():
    seen = []

    def loss(x):
        seen.append(torch.compiler.is_compiling())
        return (x * x).sum()

    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        nf.jit(loss, mesh=mesh, in_shardings=P("dp"))(torch.ones(8))
        nf.jit(nf.grad(loss), mesh=mesh, in_shardings=P("dp"))(torch.ones(8))
    assert seen == [True, True]
    assert not torch.compiler.is_compiling()  # and not after
