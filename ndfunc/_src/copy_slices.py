"""The forms autograd's backward of a write into a view traces to, brought to plain views and copies.

A write into a view of a tensor that autograd tracks (`z[:, 0] = -1` where `z` needs a gradient)
is recorded as `CopySlices`, whose backward copies the gradient into an empty tensor and names the
view as `as_strided`; `fill_`'s decomposition makes a functional `copy`. None of these has a
sharding rule or a functional form the rewrites of `writes` read. Here the copy into an empty
tensor is a copy of its source (`fresh_copies`), an `as_strided` that is one select, slice or
diagonal of a contiguous tensor (or slices of it permuted, or it reshaped, or windows of its
elements viewed as rows: a slice reshaped) is those views (`strided_views`), an `as_strided_` that
moves no element is dropped, and a functional `copy` is its source broadcast
(`copies_as_broadcasts`); `writes` then makes the write itself functional.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from ndfunc._src.graph_edits import aliases, annotate, call, is_view, moved
from ndfunc._src.view_ops import READS_STRIDES, inverse_permutation

aten = torch.ops.aten
_EMPTY = (aten.new_empty.default, aten.new_empty_strided.default, aten.empty.memory_format,
          aten.empty_like.default, aten.empty_strided.default)


def copies_as_broadcasts(gm: torch.fx.GraphModule) -> bool:
    """Each functional `copy(x, src)` (`fill_`'s decomposition: a tensor like `x` holding `src`),
    which no sharding rule lays out, as `src` broadcast to `x`'s shape, on its device, of its dtype,
    laid out as the copy is (a copy of a view with gaps: contiguous, unless a view reads it).
    Whether any was rewritten."""
    changed = False
    for copy in list(gm.graph.find_nodes(op="call_function", target=aten.copy.default)):
        like, src = copy.args[:2]
        if not (isinstance(like, torch.fx.Node) and isinstance(src, torch.fx.Node)):
            continue
        into = like.meta["val"]
        # the copy is laid out as `x` where `x` is dense (a transpose's order), else contiguous
        order = sorted(range(into.dim()), key=lambda d: -into.stride(d))
        if _strides_in(order, list(into.shape)) != list(into.stride()):
            order = list(range(into.dim()))
        made = []
        with gm.graph.inserting_before(copy):
            out = call(gm, made, aten.expand.default, moved(gm, made, src, into), list(into.shape))
            out = call(gm, made, aten.permute.default, out, order)
            out = call(gm, made, aten.clone.default, out, memory_format=torch.contiguous_format)
            out = call(gm, made, aten.permute.default, out, inverse_permutation(order))
        annotate(made, copy)
        if out.meta["val"].stride() != copy.meta["val"].stride() and any(
                u.target in READS_STRIDES for u in copy.users):
            for node in reversed(made):
                gm.graph.erase_node(node)
            continue  # (strides this does not reproduce, which a reader's view depends on: left as it is)
        copy.replace_all_uses_with(out)
        gm.graph.erase_node(copy)
        if not like.users and like.op == "call_function" and is_view(like):
            gm.graph.erase_node(like)
        changed = True
    return changed


def _strides_in(order: list, shape: list) -> list:
    """The strides of a tensor of `shape` laid out densely with its dims in `order` (outermost first)."""
    strides = [0] * len(shape)
    for d, s in zip(order, contiguous_strides([shape[d] for d in order])):
        strides[d] = s
    return strides


def fresh_copies(gm: torch.fx.GraphModule) -> bool:
    """Each `copy_` into an empty tensor of its source's shape that nothing else reads, its elements
    filling its storage (`CopySlices`' copy of the gradient, before it writes into a view of it;
    laid out as the tensor written was, a transpose's order too), as a copy of the source laid out
    so. Whether any was rewritten."""
    changed = False
    for copy in list(gm.graph.find_nodes(op="call_function", target=aten.copy_.default)):
        empty, src = copy.args[:2]
        if not (isinstance(empty, torch.fx.Node) and empty.target in _EMPTY and len(empty.users) == 1
                and isinstance(src, torch.fx.Node)):
            continue
        into = empty.meta["val"]
        order = dense_order(into)
        if into.shape != src.meta["val"].shape or order is None:
            continue
        made = []
        with gm.graph.inserting_before(copy):  # laid out as the empty tensor was: its dims in `order`
            out = copied_in_order(functools.partial(call, gm, made), moved(gm, made, src, into), order)
        annotate(made, copy)
        copy.replace_all_uses_with(out)
        gm.graph.erase_node(copy)
        gm.graph.erase_node(empty)
        changed = True
    return changed


def strided_views(gm: torch.fx.GraphModule) -> bool:
    """Each `as_strided` of a tensor whose elements fill its storage (contiguous, or a transpose of
    such: RecurrentGemma's scan writes into `zeros_like` of one) that is one select or diagonal of
    it, or slices of it, ... (`_as_view`, of its dims in memory order; `CopySlices` names the view
    it writes into so), as those ops. Whether any was rewritten."""
    changed = _shaped_flat_buffers(gm) | _restrides_in_place(gm)
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.as_strided.default)):
        base = node.args[0]
        if not isinstance(base, torch.fx.Node):
            continue
        size, stride, offset = _strided(node)
        whole = base.meta["val"]
        order = dense_order(whole)
        if order is None or whole.storage_offset() != 0:
            continue
        # (its dims in memory order: then it is contiguous, the views are of that)
        in_memory = [whole.shape[d] for d in order]
        found = _as_view(in_memory, contiguous_strides(in_memory), size, stride, offset)
        if found is None:
            continue
        if order != sorted(order):
            found = [(aten.permute.default, order), *found]
        made = []
        with gm.graph.inserting_before(node):
            view = base
            for op, *args in found:
                view = call(gm, made, op, view, *args)
        annotate(made, node)
        got = view.meta["val"]
        if list(got.shape) != size or list(got.stride()) != stride or got.storage_offset() != offset:
            for made_node in reversed(made):
                gm.graph.erase_node(made_node)  # (`_as_view` read size-1 dims or strides ambiguously)
            continue
        node.replace_all_uses_with(view)
        gm.graph.erase_node(node)
        changed = True
    return changed


def _restrides_in_place(gm: torch.fx.GraphModule) -> bool:
    """Each `as_strided_` that gives a tensor the shape and offset it has, and strides that differ
    only on dims of size 1 (an adaptive pooling's result made channels-last: no element moves), as
    the tensor itself. Whether any was dropped."""
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.as_strided_.default)):
        x = node.args[0]
        if not isinstance(x, torch.fx.Node):
            continue
        was, (size, stride, offset) = x.meta["val"], _strided(node)
        if list(was.shape) != size or offset != was.storage_offset() or any(
                n != 1 and st != old for n, st, old in zip(size, stride, was.stride())):
            continue
        node.replace_all_uses_with(x)
        gm.graph.erase_node(node)
        changed = True
    return changed


def dense_order(t: torch.Tensor) -> list[int] | None:
    """The order of `t`'s dims in memory, outermost first, where its elements fill its storage with
    no gap (contiguous, or a permute of a contiguous tensor); else None."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    dense = all(t.stride(d) == want for d, want in zip(order, contiguous_strides([t.shape[d] for d in order]))
                if t.shape[d] != 1)
    return order if dense else None


def copied_in_order(call, x, order: list[int]):
    """`x` copied into fresh memory whose dims run in `order`, outermost first (`dense_order`'s), by
    `call(op, *args, **kwargs)` (a graph's, or a local program's emitter)."""
    permuted = order != sorted(order)
    x = call(aten.permute.default, x, order) if permuted else x
    x = call(aten.clone.default, x, memory_format=torch.contiguous_format)
    return call(aten.permute.default, x, inverse_permutation(order)) if permuted else x


def _strided(node: torch.fx.Node) -> tuple[list, list, int]:
    """An `as_strided`'s (or `as_strided_`'s) size, stride and storage offset."""
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0)
    return list(node.args[1]), list(node.args[2]), offset or 0


def _shaped_flat_buffers(gm: torch.fx.GraphModule) -> bool:
    """A 1-dim tensor the step made, read only by `as_strided`s one of which views it whole in a
    contiguous shape (the backward of an in-place op on a view: a flat buffer of zeros, the view
    written, the whole read), viewed in that shape once, which the others then view: so each is a
    select, slice or diagonal of it (`strided_views`)."""
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.as_strided.default)):
        flat = node.args[0]
        if not (isinstance(flat, torch.fx.Node) and flat.op == "call_function" and not aliases(flat)):
            continue
        buffer = flat.meta["val"]
        if buffer.dim() != 1 or not all(u.target is aten.as_strided.default and u.args[0] is flat for u in flat.users):
            continue
        shape, stride, offset = _strided(node)
        if offset or stride != contiguous_strides(shape) or math.prod(shape) != buffer.numel():
            continue
        made = []
        with gm.graph.inserting_after(flat):
            whole = call(gm, made, aten.view.default, flat, shape)
        annotate(made, node)
        for u in list(flat.users):
            if u is not whole:
                u.replace_input_with(flat, whole)
        changed = True
    return changed


def contiguous_strides(shape: list) -> list:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def _as_view(shape: list, strides: list, size: list, stride: list, offset: int) -> list | None:
    """The views taking the elements `as_strided(size, stride, offset)` takes of a contiguous
    tensor of `shape` (`strides`), in turn: [(select, dim, index)], [(diagonal, offset, dim1,
    dim2)] or a (slice, dim, start, end, step) per dim it cuts, then (permute, dims) where it
    orders them otherwise (a write into a transposed view, or a select of one); [(view, size)] for
    every element in order with dims of size 1 added or dropped; else windows of the elements
    viewed as rows (`_windows`), permuted as those; None if no such views do."""
    found = _in_order(shape, strides, size, stride, offset)
    if found is not None:
        return found
    order = sorted(range(len(size)), key=lambda d: -stride[d])  # its dims, outermost first
    in_order = ([size[d] for d in order], [stride[d] for d in order])
    found = _in_order(shape, strides, *in_order, offset) if order != sorted(order) else None
    if found is None or found[0][0] is aten.view.default:
        found = _windows(shape, *in_order, offset)
    if found is None and in_order[1] and in_order[1][-1] > 1:  # elements a step apart: rows of one, the rest cut
        found = _windows(shape, [*in_order[0], 1], [*in_order[1], 1], offset)
        found = None if found is None else [*found, (aten.squeeze.dim, len(size))]
    if found is None or order == sorted(order):
        return found
    return [*found, (aten.permute.default, inverse_permutation(order))]


def _in_order(shape: list, strides: list, size: list, stride: list, offset: int) -> list | None:
    """`_as_view` without the permute."""
    k = len(shape)
    if len(size) == k - 1:
        for d in range(k):
            if size == shape[:d] + shape[d + 1:] and stride == strides[:d] + strides[d + 1:] \
                    and offset % strides[d] == 0 and 0 <= offset // strides[d] < shape[d]:
                return [(aten.select.int, d, offset // strides[d])]
        for d1, d2 in itertools.combinations(range(k), 2):  # a diagonal: the last dim steps along both
            rest = [d for d in range(k) if d not in (d1, d2)]
            if size[:-1] != [shape[d] for d in rest] or stride != [strides[d] for d in rest] + [strides[d1] + strides[d2]]:
                continue
            for diagonal in (offset // strides[d2], -(offset // strides[d1])):
                length = min(shape[d1] - max(-diagonal, 0), shape[d2] - max(diagonal, 0))
                if size[-1] == length and ((diagonal >= 0 and diagonal * strides[d2] == offset)
                                           or (diagonal < 0 and -diagonal * strides[d1] == offset)):
                    return [(aten.diagonal.default, diagonal, d1, d2)]
        return None
    if len(size) != k:
        if offset == 0 and math.prod(size) == math.prod(shape) and all(
                n == 1 or st == want for n, st, want in zip(size, stride, contiguous_strides(size))):
            return [(aten.view.default, size)]  # every element in order, in another shape (size-1 dims added)
        return None
    slices, rest = [], offset  # a slice per dim, its start read off the offset (mixed radix)
    for d in range(k):
        step, uneven = divmod(stride[d], strides[d])
        if uneven or step <= 0:
            return None
        start = rest // strides[d]
        rest -= start * strides[d]
        end = start + step * (size[d] - 1) + 1 if size[d] else start
        if end > shape[d]:
            return None
        if (start, end, step) != (0, shape[d], 1):
            slices.append((aten.slice.Tensor, d, start, end, step))
    if rest:
        return None
    return slices or [(aten.slice.Tensor, 0, 0, shape[0], 1)]


def _windows(shape: list, size: list, stride: list, offset: int) -> list | None:
    """`_in_order` of an `as_strided` whose rows step by a stride that is no dim's (Transformer-XL's
    and Funnel's relative shift: `[S, 2S - 1]` rows of each `[2S, S]` block of scores, a slice
    reshaped), its dims outermost first, as windows of the tensor's elements. The dims are grouped
    into levels, each stride within a level a whole number of the next's that holds that dim. The
    elements are viewed as a grid with one dim per level (its step there the level's innermost
    stride); from each grid dim a window is sliced, viewed as the level's dims, and each dim cut.
    [(view, grid), then per level (slice, ...), (view, ...), (slice, ...), ...]; None where no
    window fits."""
    if not size or stride[-1] != 1 or min(size) < 1:
        return None
    levels = [[0]]
    for i in range(1, len(size)):
        if stride[i - 1] % stride[i] == 0 and stride[i - 1] // stride[i] >= size[i]:
            levels[-1].append(i)
        else:
            levels.append([i])
    units = [stride[level[-1]] for level in levels]  # each level's step, in elements
    spans = [math.prod(shape), *units[:-1]]
    if any(span % unit for span, unit in zip(spans, units)):
        return None
    grid = [span // unit for span, unit in zip(spans, units)]
    found = [] if grid == shape else [(aten.view.default, grid)]
    now, rest = list(grid), offset  # the shape so far; the offset left to place
    d = 0  # the grid dim of this level
    for level, unit in zip(levels, units):
        start, rest = divmod(rest, unit)
        steps = [stride[i] // unit for i in level]
        rows = [size[level[0]], *(a // b for a, b in zip(steps, steps[1:]))]
        end = start + rows[0] * steps[0]
        if end > now[d]:
            return None
        if (start, end) != (0, now[d]):
            found.append((aten.slice.Tensor, d, start, end, 1))
        if len(rows) > 1:
            now[d:d + 1] = rows
            found.append((aten.view.default, list(now)))
        for k, i in enumerate(level):
            if size[i] < now[d + k]:
                found.append((aten.slice.Tensor, d + k, 0, size[i], 1))
                now[d + k] = size[i]
        d += len(level)
    return found if rest == 0 else None
