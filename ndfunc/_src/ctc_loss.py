"""`F.ctc_loss` over padded targets as ops whose shapes come from shapes: each sample's loss, and
its gradient.

ATen's CTC kernel sizes its forward variables by the longest target, a value, so a trace over
fake tensors cannot make it (a speech model's loss raised `nf.DataDependentError`). Its result is
one loss per sample, each sample's work its own: `ndfunc::ctc_losses` gives those losses, and
`ndfunc::ctc_losses_backward` their gradient (the forward variables made again inside: nothing of
a value-made shape crosses between the two). Both split by the batch. The reduction is the
traced math around them, as ATen writes it.
"""

from __future__ import annotations

import torch

from ndfunc._src.opaque import opaque_op

aten = torch.ops.aten


def _losses(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return aten.ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, 0, zero_infinity)


def _losses_backward(grad, log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    nll, log_alpha = aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    return aten._ctc_loss_backward.Tensor(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha,
                                          blank, zero_infinity)


def _samples_dims(node: torch.fx.Node) -> tuple[list, list]:
    """Each tensor's samples dim, outputs then inputs: the losses (or the log-probabilities'
    gradient); (the losses' gradient,) log-probabilities (time, samples, classes), targets, lengths."""
    if node.target is ctc_losses_backward_op:
        return [1], [0, 1, 0, 0, 0]
    return [0], [1, 0, 0, 0]


def _flops(node: torch.fx.Node) -> int:
    """CTC's forward variables: a few operations per time step, sample and extended label, with the
    gradient's backward variables as many again."""
    backward = node.target is ctc_losses_backward_op
    log_probs, targets = (a.meta["val"] for a in node.args[int(backward):][:2])
    steps, samples, _ = log_probs.shape
    return 8 * steps * samples * (2 * targets.shape[1] + 1) * (2 if backward else 1)


_ops = opaque_op(
    "ctc_losses", "(Tensor log_probs, Tensor targets, Tensor input_lengths, Tensor target_lengths, int blank, "
                        "bool zero_infinity) -> Tensor",
    "(Tensor grad, Tensor log_probs, Tensor targets, Tensor input_lengths, Tensor target_lengths, int blank, "
    "bool zero_infinity) -> Tensor",
    run=_losses, run_backward=_losses_backward, fake=lambda log_probs, *_: log_probs.new_empty(log_probs.shape[1]),
    fake_backward=lambda grad, log_probs, *_: torch.empty_like(log_probs), dims=_samples_dims, flops=_flops)
ctc_losses_op, ctc_losses_backward_op = _ops.forward, _ops.backward


class _CTCLosses(torch.autograd.Function):
    """`ndfunc::ctc_losses` with `ndfunc::ctc_losses_backward` as its gradient (a Function:
    torch.func's transforms trace through it; only the log-probabilities get a gradient)."""

    @staticmethod
    def forward(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
        return ctc_losses_op(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, ctx.blank, ctx.zero_infinity = inputs
        ctx.save_for_backward(*tensors)

    @staticmethod
    def vmap(info, in_dims, log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
        """Mapped (`torch.func.vmap`): the mapped dim folded into the samples, one call."""
        def folded(x, mapped, samples):  # the mapped dim next to the samples' dim, merged with it
            x = x.unsqueeze(samples).expand(*x.shape[:samples], info.batch_size, *x.shape[samples:]) \
                if mapped is None else x.movedim(mapped, samples)
            return x.flatten(samples, samples + 1)
        tensors = [folded(x, d, samples) for x, d, samples in
                   zip((log_probs, targets, input_lengths, target_lengths), in_dims, (1, 0, 0, 0))]
        losses = _CTCLosses.apply(*tensors, blank, zero_infinity)
        return losses.unflatten(0, (info.batch_size, -1)), 0

    @staticmethod
    def backward(ctx, grad):
        log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
        grad = ctc_losses_backward_op(grad, log_probs, targets, input_lengths, target_lengths, ctx.blank,
                                      ctx.zero_infinity)
        return grad, None, None, None, None, None


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
    """`F.ctc_loss` as the tracer records it: batched log-probabilities (T, N, C) and padded
    targets (N, S) as `ndfunc::ctc_losses`, reduced as ATen reduces them (a mean divides each loss
    by its target's length first); an unbatched sample (T, C) as a batch of one (its targets read
    as padded). Targets concatenated in one dim (their bounds are values) are torch's own; lengths
    that are not integers an error, as torch's."""
    lengths = [torch.as_tensor(n, device=log_probs.device) if isinstance(log_probs, torch.Tensor) else None
               for n in (input_lengths, target_lengths)]
    batched = isinstance(log_probs, torch.Tensor) and isinstance(targets, torch.Tensor) and (
        (log_probs.dim(), targets.dim()) in ((3, 2), (2, 1)))
    for name, n in zip(("input_lengths", "target_lengths"), lengths):
        if n is not None and (n.is_floating_point() or n.is_complex()):
            raise TypeError(f"F.ctc_loss: {name} must be integers, as torch requires; got {n.dtype}. Pass them as "
                            f"an integer tensor (torch.long) or a list of ints.")
    if not batched or reduction not in ("none", "mean", "sum"):
        return torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                                            zero_infinity)
    one = log_probs.dim() == 2
    if one:
        log_probs, targets = log_probs.unsqueeze(1), targets.unsqueeze(0)
    input_lengths, target_lengths = (n.to(torch.long).reshape(-1) for n in lengths)
    losses = _CTCLosses.apply(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    if reduction == "none":
        return losses.squeeze(0) if one else losses
    if reduction == "sum":
        return losses.sum()
    return (losses / target_lengths.to(losses.dtype).clamp(min=1)).mean()


# how the tracer records torch's CTC loss (`traced_as.TRACED_AS` takes it in)
TRACED_AS = {torch.nn.functional.ctc_loss: ctc_loss}
