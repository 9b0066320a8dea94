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
  a view taken before the write and read after it is taken again of the scatter's result.
- A write of one value (or one row) where a boolean mask holds (`z[mask] = 0`, its backward's
  `index_put(grad, [mask], 0)`) is a `where` (`masked_as_where`). ATen's `index_put` reads a mask
  as one index per masked dim; the sharding rule it gets takes each index for one dim, so a mask
  over dims that the plan splits met the whole mask on each rank's block.

What is left in place (a write into an input, into a view of a view, or into a tensor viewed and
written through that view before) lowers as it is where the plan does not move it, and is refused
where it does.
"""

from __future__ import annotations

import itertools
import math

import torch

aten = torch.ops.aten

# a view op -> the op writing a source into that view of a tensor, functionally; both take the
# view's arguments after `self` (the scatter's after `src`), in the same order
_SCATTERS = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default,
             aten.diagonal.default: aten.diagonal_scatter.default}
_WRITES = (aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor)


def as_functional(gm: torch.fx.GraphModule) -> None:
    """`gm`'s in-place writes that have a functional form, rewritten so (see the module's text)."""
    if (copies_as_broadcasts(gm) | fresh_copies(gm) | strided_views(gm) | updates_as_values(gm)
            | views_as_scatters(gm) | masked_as_where(gm)):
        gm.recompile()


def copies_as_broadcasts(gm: torch.fx.GraphModule) -> bool:
    """Each functional `copy(x, src)` (`fill_`'s decomposition: a tensor like `x` holding `src`),
    which no sharding rule lays out, as `src` broadcast to `x`'s shape (and cast to its dtype). Whether
    any was rewritten."""
    changed = False
    for copy in list(gm.graph.find_nodes(op="call_function", target=aten.copy.default)):
        like, src = copy.args[:2]
        if not (isinstance(like, torch.fx.Node) and isinstance(src, torch.fx.Node)):
            continue
        into = like.meta["val"]
        made = []
        with gm.graph.inserting_before(copy):
            out = _call(gm, made, aten.expand.default, src, list(into.shape))
            if src.meta["val"].dtype != into.dtype:
                out = _call(gm, made, aten._to_copy.default, out, dtype=into.dtype)
            out = _call(gm, made, aten.clone.default, out, memory_format=torch.contiguous_format)
        _annotate(made, copy)
        copy.replace_all_uses_with(out)
        gm.graph.erase_node(copy)
        if not like.users and like.op == "call_function" and _is_view(like):
            gm.graph.erase_node(like)
        changed = True
    return changed


_EMPTY = (aten.new_empty.default, aten.new_empty_strided.default, aten.empty.memory_format,
          aten.empty_like.default, aten.empty_strided.default)


def fresh_copies(gm: torch.fx.GraphModule) -> bool:
    """Each `copy_` into an empty tensor of its own shape, contiguous, that nothing else reads (autograd's
    way to copy a gradient before writing into a view of it: `CopySlices`), as a copy of the source.
    Whether any was rewritten."""
    changed = False
    for copy in list(gm.graph.find_nodes(op="call_function", target=aten.copy_.default)):
        empty, src = copy.args[:2]
        if not (isinstance(empty, torch.fx.Node) and empty.target in _EMPTY and len(empty.users) == 1
                and isinstance(src, torch.fx.Node)):
            continue
        into, source = empty.meta["val"], src.meta["val"]
        if into.shape != source.shape or not into.is_contiguous():
            continue
        made = []
        with gm.graph.inserting_before(copy):
            if into.dtype == source.dtype:
                out = _call(gm, made, aten.clone.default, src, memory_format=torch.contiguous_format)
            else:
                out = _call(gm, made, aten._to_copy.default, src, dtype=into.dtype,
                            memory_format=torch.contiguous_format)
        _annotate(made, copy)
        copy.replace_all_uses_with(out)
        gm.graph.erase_node(copy)
        gm.graph.erase_node(empty)
        changed = True
    return changed


def strided_views(gm: torch.fx.GraphModule) -> bool:
    """Each `as_strided` of a contiguous tensor that is one select or one slice of it (autograd's
    `CopySlices` names the view it writes into so), as that op. Whether any was rewritten."""
    changed = _shaped_flat_buffers(gm)
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.as_strided.default)):
        base = node.args[0]
        if not isinstance(base, torch.fx.Node):
            continue
        size, stride = list(node.args[1]), list(node.args[2])
        offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0) or 0
        whole = base.meta["val"]
        if not whole.is_contiguous() or whole.storage_offset() != 0:
            continue
        found = _as_view(list(whole.shape), list(whole.stride()), size, stride, offset)
        if found is None:
            continue
        made = []
        with gm.graph.inserting_before(node):
            view = _call(gm, made, found[0], base, *found[1:])
        _annotate(made, node)
        got = view.meta["val"]
        if list(got.shape) != size or list(got.stride()) != stride or got.storage_offset() != offset:
            gm.graph.erase_node(view)  # (`_as_view` read size-1 dims or strides ambiguously)
            continue
        node.replace_all_uses_with(view)
        gm.graph.erase_node(node)
        changed = True
    return changed


def _shaped_flat_buffers(gm: torch.fx.GraphModule) -> bool:
    """A 1-dim tensor the step made, read only by `as_strided`s one of which views it whole in a
    contiguous shape (autograd's backward of an in-place op on a view: a flat buffer of zeros, the
    view written, the whole read), viewed in that shape once, which the others then view: so each
    is a select or a slice of it (`strided_views`)."""
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.as_strided.default)):
        flat = node.args[0]
        if not (isinstance(flat, torch.fx.Node) and flat.op == "call_function" and not _aliases(flat)):
            continue
        buffer = flat.meta["val"]
        if buffer.dim() != 1 or not all(u.target is aten.as_strided.default and u.args[0] is flat for u in flat.users):
            continue
        shape = list(node.args[1])
        offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0) or 0
        if offset or list(node.args[2]) != _contiguous_strides(shape) or math.prod(shape) != buffer.numel():
            continue
        made = []
        with gm.graph.inserting_after(flat):
            whole = _call(gm, made, aten.view.default, flat, shape)
        _annotate(made, node)
        for u in list(flat.users):
            if u is not whole:
                u.replace_input_with(flat, whole)
        changed = True
    return changed


def _contiguous_strides(shape: list) -> list:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def _as_view(shape: list, strides: list, size: list, stride: list, offset: int) -> tuple | None:
    """(select, dim, index) or (slice, dim, start, end, step) taking the elements `as_strided(size,
    stride, offset)` takes of a contiguous tensor of `shape` (`strides`); None if neither does."""
    k = len(shape)
    if len(size) == k - 1:
        for d in range(k):
            if size == shape[:d] + shape[d + 1:] and stride == strides[:d] + strides[d + 1:] \
                    and offset % strides[d] == 0 and 0 <= offset // strides[d] < shape[d]:
                return aten.select.int, d, offset // strides[d]
        for d1, d2 in itertools.combinations(range(k), 2):  # a diagonal: the last dim steps along both
            rest = [d for d in range(k) if d not in (d1, d2)]
            if size[:-1] != [shape[d] for d in rest] or stride != [strides[d] for d in rest] + [strides[d1] + strides[d2]]:
                continue
            for diagonal in (offset // strides[d2], -(offset // strides[d1])):
                if (diagonal >= 0 and diagonal * strides[d2] == offset) or (diagonal < 0 and -diagonal * strides[d1] == offset):
                    return aten.diagonal.default, diagonal, d1, d2
        return None
    if len(size) != k:
        return None
    moved = [d for d in range(k) if size[d] != shape[d] or stride[d] != strides[d]]
    if len(moved) > 1 or (not moved and offset):
        return None
    d = moved[0] if moved else 0
    if offset % strides[d] or stride[d] % strides[d] or stride[d] <= 0:
        return None
    start, step, n = offset // strides[d], stride[d] // strides[d], size[d]
    end = start + step * (n - 1) + 1 if n else start
    if end > shape[d]:
        return None
    return aten.slice.Tensor, d, start, end, step


def views_as_scatters(gm: torch.fx.GraphModule) -> bool:
    """Each `copy_` or `fill_` into a slice, select or diagonal of a tensor the step made (not an
    input's, not a view of another), as the view's scatter op; later reads of the tensor read the
    scatter's result, later reads of its views (the written one, or one taken before and not
    written through) views of that result. Whether any was rewritten."""
    writes = [n for target in _WRITES for n in gm.graph.find_nodes(op="call_function", target=target)]
    if not writes:
        return False
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for write in sorted(writes, key=order.__getitem__):
        view = write.args[0]
        if not (isinstance(view, torch.fx.Node) and view.target in _SCATTERS):
            continue
        base = view.args[0]
        seen = [u for u in base.users if u is not view and order[u] < order[write] and _aliases(u)]
        if not (isinstance(base, torch.fx.Node) and _owned(base)) or not all(
                _is_view(u) and u.args[0] is base and not any(_writes_into(r, u) for r in u.users) for u in seen):
            continue  # an input's, a view of a tensor read elsewhere, or viewed and written: left as it is
        into = view.meta["val"]
        view_args = _arguments(view)
        made = []
        with gm.graph.inserting_before(write):
            src = write.args[1]
            if not isinstance(src, torch.fx.Node):  # a fill with a number
                written = _call(gm, made, aten.full.default, list(into.shape), src, dtype=into.dtype,
                                device=into.device)
            else:  # a copy, or a fill with a 0-d tensor: broadcast and cast
                written = _call(gm, made, aten.expand.default, src, list(into.shape))
                if src.meta["val"].dtype != into.dtype:
                    written = _call(gm, made, aten._to_copy.default, written, dtype=into.dtype)
            scattered = _call(gm, made, _SCATTERS[view.target], base, written, *view_args)
            later = [u for u in view.users if u is not write and order[u] > order[write]]
            result = _call(gm, made, view.target, scattered, *view_args) if write.users or later else None
        _annotate(made, write, order)
        for u in [u for u in base.users if u is not view and u not in made and order[u] > order[write]]:
            u.replace_input_with(base, scattered)
        for u in later:
            u.replace_input_with(view, result)
        for alias in seen:  # a view taken before the write and read after: taken again of the result
            readers = [r for r in alias.users if order[r] > order[write]]
            if readers:
                again = []
                with gm.graph.inserting_after(scattered):
                    remade = _call(gm, again, alias.target, scattered, *alias.args[1:], **alias.kwargs)
                _annotate(again, write, order)
                for r in readers:
                    r.replace_input_with(alias, remade)
        if result is not None:
            write.replace_all_uses_with(result)
        gm.graph.erase_node(write)
        if not view.users:
            gm.graph.erase_node(view)
        changed = True
    return changed


def updates_as_values(gm: torch.fx.GraphModule) -> bool:
    """Each op updating a view in place (`add_`) whose result only a `copy_` into the same view of
    the same tensor reads (`z[:, -1] += y`: autograd's form of it), as its out-of-place form: the
    copy then writes the whole update (`views_as_scatters`). Whether any was rewritten."""
    changed = False
    for copy in list(gm.graph.find_nodes(op="call_function", target=aten.copy_.default)):
        into, update = copy.args[:2]
        if not (isinstance(into, torch.fx.Node) and isinstance(update, torch.fx.Node) and update.op == "call_function"
                and into.target in _SCATTERS and list(update.users) == [copy] and update.args
                and isinstance(update.args[0], torch.fx.Node)):
            continue
        updated = update.args[0]
        if not (_writes_into(update, updated) and updated.target is into.target and updated.args[0] is into.args[0]
                and _arguments(updated) == _arguments(into) and list(updated.users) == [update]):
            continue
        functional = _out_of_place(update.target)
        if functional is None:
            continue
        update.target = functional
        _fake(update)
        changed = True
    return changed


def _writes_into(node: torch.fx.Node, tensor: torch.fx.Node) -> bool:
    """Whether `node` writes in place into its first argument, `tensor`."""
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and bool(schema.arguments) and bool(node.args) and node.args[0] is tensor
            and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write)


def _out_of_place(op) -> torch._ops.OpOverload | None:
    """`aten.add_.Tensor` -> `aten.add.Tensor`: an in-place op's functional overload, if ATen has it."""
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    overload = getattr(packet, op._overloadname, None) if packet is not None else None
    return overload if isinstance(overload, torch._ops.OpOverload) else None


def masked_as_where(gm: torch.fx.GraphModule) -> bool:
    """Each `index_put` (or an `index_put_` into a tensor the step made, read before by nothing
    else) at a boolean mask over the leading dims of one value, or of one row for every masked
    position (`hidden[mask] = mask_embedding`), as `where(mask, value, x)` (with
    `accumulate`, `x + value` where the mask holds); later reads of an `index_put_`'s tensor read the
    `where`. Whether any was rewritten."""
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
        rows = tuple(xv.shape[mv.dim():])  # what each masked position holds
        if mv.dtype != torch.bool or tuple(mv.shape) != tuple(xv.shape[:mv.dim()]) or not (
                vv.numel() == 1 or (vv.dim() <= len(rows) and all(
                    a in (1, b) for a, b in zip(reversed(vv.shape), reversed(rows))))):
            continue  # (a value per masked position: as many as the mask holds, known only when run)
        in_place = put.target is aten.index_put_.default
        if in_place and (not _owned(x) or any(u is not put and order[u] < order[put] and _aliases(u)
                                              for u in x.users)):
            continue  # an input's, a view of a tensor read elsewhere, or viewed before: left as it is
        made = []
        with gm.graph.inserting_before(put):
            where = _call(gm, made, aten.view.default, mask, [*mv.shape] + [1] * (xv.dim() - mv.dim()))
            one = _call(gm, made, aten.view.default, value, []) if vv.numel() == 1 else value
            if vv.dtype != xv.dtype:
                one = _call(gm, made, aten._to_copy.default, one, dtype=xv.dtype)
            if accumulate:
                one = _call(gm, made, aten.add.Tensor, x, one)
            out = _call(gm, made, aten.where.self, where, one, x)
        _annotate(made, put, order)
        if in_place:
            for u in [u for u in x.users if u is not put and u not in made and order.get(u, -1) > order[put]]:
                u.replace_input_with(x, out)
        put.replace_all_uses_with(out)
        gm.graph.erase_node(put)
        changed = True
    return changed


def _owned(node: torch.fx.Node) -> bool:
    """Whether `node` is a tensor the step made and reads only through `node`: made by an op that
    returns new memory, or a view of such a tensor that nothing else reads (`mm`'s result as
    `_unsafe_view` gives it its shape)."""
    while node.op == "call_function" and _aliases(node):
        source = node.args[0] if node.args else None
        if not (_is_view(node) and isinstance(source, torch.fx.Node) and len(source.users) == 1):
            return False
        node = source
    return node.op == "call_function"


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None \
        and not schema.returns[0].alias_info.is_write


def _aliases(node: torch.fx.Node) -> bool:
    """Whether `node`'s result may share memory with an input (a view, an in-place op's result)."""
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _arguments(view: torch.fx.Node) -> list:
    """`view`'s arguments after `self`, every one (defaults filled in), in its schema's order."""
    out = []
    for i, arg in enumerate(view.target._schema.arguments[1:], start=1):
        if i < len(view.args):
            out.append(view.args[i])
        elif arg.name in view.kwargs:
            out.append(view.kwargs[arg.name])
        else:
            out.append(arg.default_value)
    return out


def _call(gm: torch.fx.GraphModule, made: list, target, *args, **kwargs) -> torch.fx.Node:
    node = gm.graph.call_function(target, args, kwargs)
    made.append(node)
    return node


def _annotate(made: list, like: torch.fx.Node, order: dict | None = None) -> None:
    """Give the nodes `made` in place of `like` its annotations (a backward's, a remat region's),
    their values on fake tensors and, in `order`, places between `like` and the node before it."""
    for i, node in enumerate(made, start=1):
        if order is not None:
            order[node] = order[like] - 1 + i / (len(made) + 1)
        node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
        _fake(node)


def _fake(node: torch.fx.Node) -> None:
    """`node`'s value on the fake tensors its arguments hold."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
    node.meta["val"] = node.target(*args, **kwargs)
