"""Functions the tracer records as other math: a function mode over the step while it is traced.

ATen's kernels for some functions read their arguments' values (`F.one_hot`'s range check,
`F.gaussian_nll_loss`'s check that no variance is negative), which a trace over fake tensors does
not have; some have no sharding rule where the same math has one (`F.embedding_bag`, its bags
rows of indices or runs from offsets); one gives its gradient through a shape made from values
(`x[mask] = v` with a learned `v`). Each is traced as the same math, `TRACED_AS`. An op family
with a module of its own says there how the tracer records it, in its own `TRACED_AS`, taken in
here: attention as one op of every device (`attention`), a linear layer's product as one
contraction that keeps the batch and sequence dims apart (`dot`), a recurrent call and a CTC loss
each as one opaque op (`rnn`, `ctc_loss`). A function mode, because ATen's composite kernels would
run before any decomposition table is consulted inside `torch.func` transforms.
"""

from __future__ import annotations

import math
import warnings

import torch

from ndfunc._src import attention, ctc_loss, custom_gradients, dot, rnn, torch_compat
from ndfunc._src.writes import fills_rows


def _one_hot(labels: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """`F.one_hot` as a comparison with `arange(num_classes)` (ATen's reads the labels' values to
    check their range). Without `num_classes` the shape comes from the values: ATen's, which says so."""
    if num_classes < 0:
        return torch.nn.functional.one_hot(labels, num_classes)
    return (labels.unsqueeze(-1) == torch.arange(num_classes, device=labels.device)).to(torch.int64)


class TracedAs(torch.overrides.TorchFunctionMode):
    """The mode that traces each function of `TRACED_AS` as its math (see the module's text), and
    a custom op with a registered gradient, under a gradient, through `custom_gradients`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in TRACED_AS:  # (this mode is off while it runs)
            return TRACED_AS[func](*args, **kwargs)
        if (definition := custom_gradients.registered(func)) is not None and torch_compat.func_transforms() == ["Grad"]:
            return custom_gradients.call(func, definition, args, kwargs)  # (torch.func refuses the op's own)
        return func(*args, **kwargs)


def _linear_cross_entropy(input, linear_weight, target, *, options=None, **kwargs):
    """`F.linear_cross_entropy` as its reference, a linear layer and a cross-entropy, whatever
    `options` ask: its chunks are eager's way to hold less (a custom op whose forward makes the
    gradients, which torch.func refuses), where a traced step's memory is the plan's and `nf.remat`'s,
    and the loss traced so splits over the vocabulary."""
    return torch.nn.functional.linear_cross_entropy(input, linear_weight, target, **kwargs)


def _format(x: torch.Tensor, format_spec: str = "") -> str:
    """`format(x, spec)` (an f-string) of a traced tensor: its dtype and shape, as `as_text` writes
    them (`<traced int64[]>`), whatever the spec: a trace has no value to write, where torch reads a
    number's (a library builds a check's message before the check: transformers' image-token count).
    A value known while tracing (a literal, `torch.tensor(2.5)`) is written as torch writes it."""
    known = torch_compat.traced_constant(x)
    if known is not None:
        with torch_compat.no_dispatch_modes():  # (the trace's: a real tensor, unrecorded)
            return torch.Tensor.__format__(known, format_spec)
    return f"<traced {str(x.dtype).removeprefix('torch.')}{list(x.shape)}>"


def _gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """`F.gaussian_nll_loss` without its check that no variance is negative (it reads values; a
    negative variance gives nan through the log here). A float variance is torch's own case."""
    if not isinstance(var, torch.Tensor):
        return torch.nn.functional.gaussian_nll_loss(input, target, var, full, eps, reduction)
    if var.shape != input.shape:
        if var.shape == input.shape[:-1]:
            var = var.unsqueeze(-1)  # one variance per row of the last dim
        elif not (var.shape[:-1] == input.shape[:-1] and var.shape[-1] == 1):
            return torch.nn.functional.gaussian_nll_loss(input, target, var, full, eps, reduction)  # its error
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not valid")
    var = var + (var.clamp(min=eps) - var).detach()  # clamped for stability, its gradient passed through as torch's
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return _reduced(loss, reduction)


def _setitem(x, key, value):
    """`x[mask] = value`, a boolean mask over `x`'s leading dims and a tensor value (one value, or one
    row for every masked position: `hidden[mask] = mask_embedding`), as `x.copy_(where(mask, value,
    x))`: ATen's `index_put` gives the value's gradient by gathering the masked positions
    (`nonzero`: a shape known only when run). Any other key or value as torch's."""
    mask = key[0] if isinstance(key, tuple) and len(key) == 1 else key
    if isinstance(mask, torch.Tensor) and isinstance(value, torch.Tensor) and fills_rows(mask, x, value):
        where = mask.to(x.device).reshape(*mask.shape, *([1] * (x.dim() - mask.dim())))
        value = value.reshape(()) if value.numel() == 1 else value
        x.copy_(torch.where(where, value.to(x.device, x.dtype), x))
        return
    torch.Tensor.__setitem__(x, key, value)


def _cov(input, *, correction=1, fweights=None, aweights=None):
    """`torch.cov` without weights as its math, the observations' count a shape: ATen's reads the
    normalizer's value to warn where it is not positive (a covariance loss raised
    DataDependentError). With weights (values), torch's own."""
    if fweights is not None or aweights is not None or input.dim() > 2 or not (
            input.is_floating_point() or input.is_complex()):
        return torch.cov(input, correction=correction, fweights=fweights, aweights=aweights)
    x = input.reshape(1, -1) if input.dim() < 2 else input
    dof = x.shape[1] - correction
    if dof <= 0:
        warnings.warn("cov(): degrees of freedom is <= 0. Correction should be strictly less than the number of "
                      "observations.", stacklevel=2)
    centered = x - x.mean(1, keepdim=True)
    return (centered @ centered.t().conj() / max(dof, 0)).squeeze()


def _corrcoef(input):
    """`torch.corrcoef` as its math over `_cov`'s (ATen's calls its own cov)."""
    if input.dim() > 2 or input.is_complex() or not input.is_floating_point():
        return torch.corrcoef(input)
    c = _cov(input)
    if c.dim() == 0:
        return c / c
    spread = c.diagonal().sqrt()
    return (c / spread.unsqueeze(1) / spread.unsqueeze(0)).clip(-1, 1)


def _masked_scatter(input, mask, source):
    """`masked_scatter` (a vision-language model's image features written over its image tokens'
    embeddings) as its math: the k-th masked element, in order, takes the source's k-th element,
    found by a running count of the mask (ATen's has no sharding rule: it ran whole on every
    rank, its inputs gathered). An empty source is torch's own."""
    if not (isinstance(source, torch.Tensor) and source.numel() and source.dtype == input.dtype):
        return torch.Tensor.masked_scatter(input, mask, source)  # (torch's checks)
    input, mask = torch.broadcast_tensors(input, mask)
    taken = mask.reshape(-1).to(torch.int64).cumsum(0) - 1  # which source element each takes
    values = source.reshape(-1).index_select(0, taken.clamp(min=0)).view(input.shape)
    return torch.where(mask, values, input)


def _bilinear(input1, input2, weight, bias=None):
    """`F.bilinear` as an einsum (ATen's `_trilinear` has no sharding rule: it ran whole)."""
    if input1.dim() < 1 or weight.dim() != 3 or input1.shape[:-1] != input2.shape[:-1]:
        return torch.nn.functional.bilinear(input1, input2, weight, bias)  # (torch's checks)
    out = torch.einsum("...i,oij,...j->...o", input1, weight, input2)
    return out if bias is None else out + bias


def _repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    """`torch.repeat_interleave` by a tensor of repeats with the `output_size` given (a mixture of
    experts' routing: each expert's rows repeated by its count) as an index made of a running count
    of where each item's run starts, then `index_select` (ATen's op has no sharding rule: it ran
    whole). Without `output_size` the shape comes from the values: torch's own, which says so."""
    only_repeats = repeats is None
    counts = input if only_repeats else repeats
    items = None if only_repeats or not isinstance(input, torch.Tensor) else \
        input.numel() if dim is None else input.shape[dim]
    if not (isinstance(counts, torch.Tensor) and counts.dim() == 1 and isinstance(output_size, int)
            and (items is None or counts.numel() == items)):  # (one count for every item: torch broadcasts it)
        return torch.repeat_interleave(input, repeats, dim, output_size=output_size) if not only_repeats else \
            torch.repeat_interleave(input, output_size=output_size)
    index = _run_of_each(counts.cumsum(0) - counts, output_size)
    if only_repeats:
        return index
    x = input.reshape(-1) if dim is None else input
    return x.index_select(0 if dim is None else dim, index)


def _run_of_each(starts: torch.Tensor, n: int) -> torch.Tensor:
    """For each of `n` positions, the run it falls in, runs starting at `starts` (ascending; a run
    starting where the next does is empty, one at `n` or past it too): how many runs start at or
    before it, less one. Shapes from shapes, where `searchsorted` has no rule."""
    begun = torch.zeros(n + 1, dtype=torch.int64, device=starts.device)
    starts = starts.clamp(max=n)
    return begun.index_add(0, starts, torch.ones_like(starts, dtype=torch.int64)).cumsum(0)[:n] - 1


def _reduced(losses: torch.Tensor, reduction: str) -> torch.Tensor:
    return losses if reduction == "none" else losses.sum() if reduction == "sum" else losses.mean()


def _multi_margin_loss(input, target, p=1, margin=1.0, weight=None, size_average=None, reduce=None,
                       reduction="mean"):
    """`F.multi_margin_loss` as its math: per sample, the sum over the other classes of
    max(0, margin - x[y] + x[i])^p (times the target's weight), over the number of classes. ATen's
    backward has no sharding rule (it ran whole); these ops split by the samples. Legacy
    arguments, or a `p` other than 1 and 2, as torch's (which checks them)."""
    if size_average is not None or reduce is not None or p not in (1, 2) or input.dim() not in (1, 2):
        return torch.nn.functional.multi_margin_loss(input, target, p, margin, weight, size_average, reduce, reduction)
    x = input if input.dim() == 2 else input.unsqueeze(0)
    y = target.reshape(-1, 1)
    gaps = (margin - x.gather(1, y) + x).clamp(min=0) ** p  # (samples, classes); the target's own: margin^p
    gaps = gaps.masked_fill(torch.arange(x.shape[1], device=x.device) == y, 0.0)
    if weight is not None:
        gaps = gaps * weight[y]
    losses = gaps.sum(1) / x.shape[1]
    return _reduced(losses if input.dim() == 2 else losses.view(target.shape), reduction)


def _multilabel_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    """`F.multilabel_margin_loss` as its math: per sample, its targets (the leading entries of its
    target row up to the first -1) each against every class that is no target, max(0, 1 - x[t] +
    x[i]), summed, over the number of classes. ATen's backward has no sharding rule, and PyTorch's
    decomposition of its forward masks no entry after the first -1 (a wrong loss)."""
    if size_average is not None or reduce is not None or input.dim() not in (1, 2):
        return torch.nn.functional.multilabel_margin_loss(input, target, size_average, reduce, reduction)
    x = input if input.dim() == 2 else input.unsqueeze(0)
    t = target if target.dim() == 2 else target.unsqueeze(0)
    listed = torch.cumprod((t >= 0).to(torch.int64), 1).bool()  # up to the first -1
    classes = torch.arange(x.shape[1], device=x.device)
    is_target = ((t.unsqueeze(-1) == classes) & listed.unsqueeze(-1)).any(1)  # (samples, classes)
    scores = x.gather(1, t.clamp(min=0))  # (samples, listed entries)
    gaps = (1 - scores.unsqueeze(-1) + x.unsqueeze(1)).clamp(min=0)  # (samples, entries, classes)
    gaps = gaps * (listed.unsqueeze(-1) & ~is_target.unsqueeze(1))
    losses = gaps.sum((1, 2)) / x.shape[1]
    return _reduced(losses if input.dim() == 2 else losses[0], reduction)


def _embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2, scale_grad_by_freq=False, mode="mean",
                   sparse=False, per_sample_weights=None, include_last_offset=False, padding_idx=None):
    """`F.embedding_bag` as the embedding's rows reduced over each bag, which lay out as
    `F.embedding` does (split by bags or tokens, or by the vocabulary); ATen's bag kernel has no
    sharding rule. Bags are the rows of 2-dim indices, or runs of 1-dim ones from each offset (the
    rows summed into their bags by `index_add`, a maximum by `scatter_reduce`; their sizes are
    values, but no shape is). `max_norm` (it renormalizes the weight in place),
    `scale_grad_by_freq` and `sparse` as torch's."""
    if input.dim() not in (1, 2) or (offsets is None) == (input.dim() == 1) or max_norm is not None \
            or scale_grad_by_freq or sparse or mode not in ("sum", "mean", "max") \
            or (per_sample_weights is not None and mode != "sum"):
        return torch.nn.functional.embedding_bag(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq,
                                                 mode, sparse, per_sample_weights, include_last_offset, padding_idx)
    rows = torch.nn.functional.embedding(input, weight)  # (bags, bag size, dim) or (indices, dim)
    kept = None if padding_idx is None else (input != padding_idx % weight.shape[0]).unsqueeze(-1)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(-1).to(rows.dtype)
    if offsets is not None:
        return _bags_by_offsets(input, rows, kept, offsets[:-1] if include_last_offset else offsets, mode)
    if mode == "max":
        if kept is not None:
            rows = rows.masked_fill(~kept, float("-inf"))
        best = rows.amax(1)
        return best if kept is None else torch.where(kept.any(1), best, 0.0)  # an empty bag: zeros, as torch's
    if kept is not None:
        rows = rows * kept
    total = rows.sum(1)
    if mode == "sum":
        return total
    count = input.shape[1] if kept is None else kept.sum(1).clamp(min=1)  # an empty bag: zeros, as torch's
    return total / count


def _bags_by_offsets(input, rows, kept, starts, mode):
    """`_embedding_bag`'s bags of 1-dim indices, bag `b` from `starts[b]` to the next start: each
    row's bag is how many bags start at or before it, less one (an empty bag starts where the next
    does), and the rows are summed, averaged or maxed into their bags; an empty bag (or one of
    padding only) is zeros, as torch's."""
    n, bags = input.shape[0], starts.shape[0]
    bag = _run_of_each(starts, n)
    zeros = rows.new_zeros(bags, rows.shape[-1])
    if mode == "max":
        if kept is not None:
            rows = rows.masked_fill(~kept, float("-inf"))
        best = zeros.scatter_reduce(0, bag.unsqueeze(-1).expand_as(rows), rows, "amax", include_self=False)
        if kept is None:
            return best
        return torch.where(zeros[:, 0].index_add(0, bag, kept[:, 0].to(rows.dtype)).unsqueeze(-1) > 0, best, 0.0)
    if kept is not None:
        rows = rows * kept
    total = zeros.index_add(0, bag, rows)
    if mode == "sum":
        return total
    ones = torch.ones(n, dtype=rows.dtype, device=rows.device) if kept is None else kept[:, 0].to(rows.dtype)
    return total / zeros[:, 0].index_add(0, bag, ones).clamp(min=1).unsqueeze(-1)


TRACED_AS = {torch.nn.functional.one_hot: _one_hot,
             torch.nn.functional.embedding_bag: _embedding_bag,
             torch.Tensor.masked_scatter: _masked_scatter,
             torch.masked_scatter: _masked_scatter,
             torch.nn.functional.bilinear: _bilinear,
             torch.repeat_interleave: _repeat_interleave,
             torch.Tensor.repeat_interleave: _repeat_interleave,
             torch.cov: _cov,
             torch.corrcoef: _corrcoef,
             torch.nn.functional.multi_margin_loss: _multi_margin_loss,
             torch.nn.functional.multilabel_margin_loss: _multilabel_margin_loss,
             torch.Tensor.__setitem__: _setitem,
             torch.nn.functional.gaussian_nll_loss: _gaussian_nll_loss,
             torch.Tensor.__format__: _format,
             torch.nn.functional.linear_cross_entropy: _linear_cross_entropy,
             **attention.TRACED_AS, **ctc_loss.TRACED_AS, **dot.TRACED_AS, **rnn.TRACED_AS}
