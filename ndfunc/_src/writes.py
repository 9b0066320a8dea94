"""In-place writes of a traced step, rewritten as the functional ops the partitioner lays out.

The partitioner gives every value a layout by where it is read, and moves a value where a reader
wants another. A write in place lands in the copy the write was handed: where the plan moves the
written value for the write, the value itself is never written (lowering refuses that case,
`lower._check_write_in_place`). Two kinds of write are common in user code and in torch's own
backward formulas, and both have a functional form that says what they mean:

- A write into a view of a tensor the step made, read afterwards as the whole
  (`z = x.new_zeros(...); z[:, :k] = g`: the backward of `torch.fft.rfft`; `z[:, 0] = t`;
  `z[..., :2] = 0`; `s.diagonal().fill_(0)`) is the view's scatter op (`slice_scatter`,
  `select_scatter`, `diagonal_scatter`) whose result the later reads take (`views_as_scatters`).
- An update in place of such a view (`z[:, -1] += y`: an `add_` into the view, then a `copy_` of
  it into the same view) is the out-of-place op, written by that scatter (`updates_as_values`);
  a view taken before the write and read after it is taken again of the scatter's result. Any
  other in-place op into such a view (`z[:, :k] *= s`) is its out-of-place op, then a copy into
  the view (`updates_into_views`), which is the scatter.
- A change of shape in place (`unsqueeze_`) is the view (`reshapes_as_views`).
- A write of one value (or one row) where a boolean mask holds (`z[mask] = 0`, its backward's
  `index_put(grad, [mask], 0)`) is a `where` (`masked_as_where`). ATen's `index_put` reads a mask
  as one index per masked dim; the sharding rule it gets takes each index for one dim, so a mask
  over dims that the plan splits met the whole mask on each rank's block.

Autograd's backward of a write into a view is first brought to these forms (`copy_slices`). What is
left in place (a write into an input, or into a tensor written through another view before) lowers
as it is where the plan does not move it, and is refused where it does.
"""

from __future__ import annotations

import functools

import torch

from ndfunc._src import view_ops, write_ops
from ndfunc._src.copy_slices import copies_as_broadcasts, fresh_copies, strided_views
from ndfunc._src.graph_edits import annotate, call, is_view, moved, owned, writes_into
from ndfunc._src.view_ops import arguments

aten = torch.ops.aten


def as_functional(gm: torch.fx.GraphModule) -> None:
    """`gm`'s in-place writes that have a functional form, rewritten so (see the module's text)."""
    if (copies_as_broadcasts(gm) | fresh_copies(gm) | strided_views(gm) | updates_as_values(gm)
            | updates_into_views(gm) | views_as_scatters(gm) | masked_as_where(gm) | reshapes_as_views(gm)):
        gm.recompile()


def reshapes_as_views(gm: torch.fx.GraphModule) -> bool:
    """Each op that changes a tensor's shape in place (`unsqueeze_`: GroupNorm's backward under
    torch.func), which no sharding rule lays out, as its view (`unsqueeze`), where nothing reads
    the tensor afterwards but through the op's result. Whether any was rewritten."""
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    nodes = [n for op in ops if write_ops.reshapes_in_place(op) for n in gm.graph.find_nodes(op="call_function", target=op)]
    if not nodes:
        return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in nodes:
        x = node.args[0]
        if not isinstance(x, torch.fx.Node) or any(u is not node and order[u] > order[node] for u in x.users):
            continue  # read afterwards as it was: its shape changed under that read
        node.target = write_ops.functional(node.target)
        annotate([node], node)
        changed = True
    return changed


def views_as_scatters(gm: torch.fx.GraphModule) -> bool:
    """Each `copy_` or `fill_` into a slice, select, diagonal, permute, transpose, (un)squeeze or
    reshape (or such a view of such a view) of a tensor the step made (not an input's, not a view
    of another), as the views' scatter ops (through a reordering or a reshape: the source put back;
    each view's `written_back` in `view_ops`), innermost first. Later reads of the tensor read the
    result; later reads of a view of it taken before the write (the written one too, and views of
    views) read that view taken again of the result. Left in place where one of those views was
    written through before. Whether any was rewritten."""
    writes = [n for target in write_ops.OVERWRITES for n in gm.graph.find_nodes(op="call_function", target=target)]
    if not writes:
        return False
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for write in sorted(writes, key=order.__getitem__):
        view = write.args[0]
        chain = _chain(view)
        if chain is None:
            continue  # an input's, or a view of a tensor read elsewhere: left as it is
        base = chain[-1].args[0]
        seen = _views_before(base, write, order)  # (the written view among them)
        if any(order[r] < order[write] and writes_into(r, a) for a in [base, *seen] for r in a.users):
            continue  # written through another view before: left as it is
        readers = {a: [r for r in a.users if r is not write and order[r] > order[write]] for a in [base, *seen]}
        into, src = view.meta["val"], write.args[1] if len(write.args) > 1 else 0  # (zero_: zeros)
        made = []
        with gm.graph.inserting_before(write):
            if not isinstance(src, torch.fx.Node):  # a fill with a number
                written = call(gm, made, aten.full.default, list(into.shape), src, dtype=into.dtype,
                               device=into.device)
            else:  # a copy, or a fill with a 0-d tensor: on the view's device, of its dtype, broadcast
                written = call(gm, made, aten.expand.default, moved(gm, made, src, into), list(into.shape))
            for link in chain:  # scattered into each view in turn, out to the tensor
                written = view_ops.written_back(link.target)(functools.partial(call, gm, made), link, written)
            again = {base: written}

            def taken_again(a: torch.fx.Node) -> torch.fx.Node:
                if a not in again:
                    again[a] = call(gm, made, a.target, taken_again(a.args[0]), *a.args[1:], **a.kwargs)
                return again[a]

            for a in [a for a in readers if readers[a]] + ([view] if write.users else []):
                taken_again(a)
        annotate(made, write, order)
        for a, later in readers.items():
            for r in later:
                r.replace_input_with(a, again[a])
        if write.users:
            write.replace_all_uses_with(again[view])
        gm.graph.erase_node(write)
        for a in reversed(seen):
            if not a.users:
                gm.graph.erase_node(a)
        changed = True
    return changed


def _chain(view) -> list[torch.fx.Node] | None:
    """The views from `view` out to a tensor the step made (a view of a view ..., each a slice,
    select, diagonal, reordering or reshape), innermost first; None if it is no such view."""
    chain, base = [], view
    while isinstance(base, torch.fx.Node) and (not chain or not owned(base)) and (
            view_ops.written_back(base.target) is not None):
        chain.append(base)
        base = base.args[0]
    return chain if chain and isinstance(base, torch.fx.Node) and owned(base) else None


def updates_into_views(gm: torch.fx.GraphModule) -> bool:
    """Each in-place op but a copy or a fill (`mul_`, `add_`, `clamp_`) into a view of a tensor the
    step made (`z[:, :k] *= s`, Funnel's `scores[..., :S] *= mask` on a slice reshaped), as its
    out-of-place op and a copy of the result into the view, which `views_as_scatters` then makes
    the view's scatter. Whether any was rewritten."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target in write_ops.OVERWRITES or not node.args:
            continue
        view = node.args[0]
        if not (isinstance(view, torch.fx.Node) and writes_into(node, view) and _chain(view) is not None):
            continue
        functional = write_ops.functional(node.target)
        was, into = node.meta.get("val"), view.meta.get("val")
        if functional is None or view_ops.returns_view(functional) or not (
                isinstance(was, torch.Tensor) and was.shape == into.shape and was.dtype == into.dtype):
            continue
        made = []
        with gm.graph.inserting_before(node):
            out = call(gm, made, functional, *node.args, **node.kwargs)
            write = call(gm, made, aten.copy_.default, view, out)
        annotate(made, node)
        node.replace_all_uses_with(write)
        gm.graph.erase_node(node)
        changed = True
    return changed


def _views_before(base: torch.fx.Node, write: torch.fx.Node, order: dict) -> list[torch.fx.Node]:
    """Every view of `base`, and view of such a view, taken before `write`, in graph order."""
    found, todo = [], [base]
    while todo:
        node = todo.pop()
        for u in node.users:
            if u is not write and order[u] < order[write] and is_view(u) and u.args[0] is node:
                found.append(u)
                todo.append(u)
    return sorted(found, key=order.__getitem__)


def updates_as_values(gm: torch.fx.GraphModule) -> bool:
    """Each op updating a view in place (`add_`) whose result only a `copy_` into the same view of
    the same tensor reads, with nothing reading the tensor in between (`z[:, -1] += y`: autograd's
    form of it), as its out-of-place form: the copy then writes the whole update
    (`views_as_scatters`). Whether any was rewritten."""
    changed = False
    for copy in list(gm.graph.find_nodes(op="call_function", target=aten.copy_.default)):
        into, update = copy.args[:2]
        if not (isinstance(into, torch.fx.Node) and isinstance(update, torch.fx.Node) and update.op == "call_function"
                and into.target in view_ops.PARTS and list(update.users) == [copy] and update.args
                and isinstance(update.args[0], torch.fx.Node)):
            continue
        updated, base = update.args[0], into.args[0]
        if not (writes_into(update, updated) and updated.target is into.target and updated.args[0] is base
                and arguments(updated) == arguments(into) and list(updated.users) == [update]):
            continue
        functional = write_ops.functional(update.target)
        if functional is None or _read_between(update, copy, base, into):
            continue
        update.target = functional
        annotate([update], update)
        changed = True
    return changed


def _read_between(first: torch.fx.Node, last: torch.fx.Node, base: torch.fx.Node, into: torch.fx.Node) -> bool:
    """Whether a node after `first` and before `last` reads `base` (or a view of it) other than as
    `into`, the view `last` writes."""
    node = first.next
    while node is not last:
        if node is not into and any(a is base or (is_view(a) and a.args[0] is base) for a in node.all_input_nodes):
            return True
        node = node.next
    return False


def fills_rows(mask: torch.Tensor, x: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `x[mask] = value` is `where(mask, value, x)`: `mask` boolean over `x`'s leading dims,
    `value` one value or one row for every masked position (broadcast to `x`'s other dims)."""
    rows = tuple(x.shape[mask.dim():])
    return (mask.dtype == torch.bool and 0 < mask.dim() <= x.dim() and tuple(mask.shape) == tuple(x.shape[:mask.dim()])
            and (value.numel() == 1 or (value.dim() <= len(rows) and all(
                a in (1, b) for a, b in zip(reversed(value.shape), reversed(rows))))))


def masked_as_where(gm: torch.fx.GraphModule) -> bool:
    """Each `index_put` (or an `index_put_` into a tensor the step made, viewed before by nothing
    else) at a boolean mask over the leading dims of one value, or of one row for every masked
    position (`hidden[mask] = mask_embedding`), as `where(mask, value, x)` (with `accumulate`,
    `x + value` where the mask holds); later reads of an `index_put_`'s tensor read the `where`.
    Whether any was rewritten."""
    puts = [n for target in (aten.index_put.default, aten.index_put_.default)
            for n in gm.graph.find_nodes(op="call_function", target=target)]
    if not puts:
        return False
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for put in sorted(puts, key=order.__getitem__):
        x, indices, value = put.args[:3]
        accumulate = put.args[3] if len(put.args) > 3 else put.kwargs.get("accumulate", False)
        if not (isinstance(x, torch.fx.Node) and isinstance(value, torch.fx.Node) and len(indices) == 1
                and isinstance(indices[0], torch.fx.Node)):
            continue
        mask, xv, vv = indices[0], x.meta["val"], value.meta["val"]
        mv = mask.meta["val"]
        if not fills_rows(mv, xv, vv):
            continue  # (a value per masked position: as many as the mask holds, known only when run)
        in_place = put.target is aten.index_put_.default
        if in_place and (not owned(x) or any(u is not put and order[u] < order[put] and is_view(u) for u in x.users)):
            continue  # an input's, a view of a tensor read elsewhere, or viewed before: left as it is
        made = []
        with gm.graph.inserting_before(put):
            where = call(gm, made, aten.view.default, moved(gm, made, mask, xv, dtype=False),
                         [*mv.shape] + [1] * (xv.dim() - mv.dim()))
            one = call(gm, made, aten.view.default, value, []) if vv.numel() == 1 else value
            one = moved(gm, made, one, xv, dtype=True) if vv.numel() > 1 or vv.dtype != xv.dtype else one
            if accumulate:
                one = call(gm, made, aten.add.Tensor, x, one)
            out = call(gm, made, aten.where.self, where, one, x)
        annotate(made, put, order)
        if in_place:
            for u in [u for u in x.users if u is not put and u not in made and order.get(u, -1) > order[put]]:
                u.replace_input_with(x, out)
        put.replace_all_uses_with(out)
        gm.graph.erase_node(put)
        changed = True
    return changed
