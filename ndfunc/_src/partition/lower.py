"""Lowering: a partitioned global program becomes one local program, the same on every rank.

Every node becomes its aten op on local blocks (shape arguments rewritten by DTensor's propagator,
as its dispatcher would); every layout change a consumer needs becomes the steps of
`redistribute.plan`, emitted as `_c10d_functional` collectives (each followed by its
`wait_tensor`) or a local slice. A slice picks this rank's block with `index_select` on an extra
input, `coords` (the rank's position on each partitioned axis), so the program holds no rank
number and one program serves every simulated rank. Each collective node carries its `Comm`
(`ndfunc._src.partition.program.comm`): kind, mesh axes, shapes sent and received, bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Callable, Sequence

import torch

from ndfunc._src.buffers import buffer_of
from ndfunc._src.graph_edits import is_view, writes_into
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.planning import redistribute
from ndfunc._src.partition.planning.layout import EXTREMA, Layout, local_shape
from ndfunc._src.partition.planning.ops import rule_of
from ndfunc._src.partition.planning.solve import Plan
from ndfunc._src.partition.planning.strategies import (
    local_args,
    tensor_inputs,
    value_of,
)
from ndfunc._src.partition.program import Comm, LoweringContext
from ndfunc._src.sharding.mesh import rank_at
from ndfunc._src.torch_compat import LazyGraphModule, eliminate_dead_code, new_node
from ndfunc._src.view_ops import ON_BLOCKS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_MANUAL_COMMS = (c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                 c10d.all_to_all_single.default)


class _Emitter:
    def __init__(self, plan: Plan, axis_names: Sequence[str], group_names: Sequence[str], mesh_sizes: dict[str, int],
                 group_of: Callable[[tuple[str, ...]], str]):
        self.plan = plan
        self.group_of = group_of  # axis names (mesh order) -> the name of their flattened group
        self.mesh_sizes = mesh_sizes  # every mesh axis, size-1 ones too
        self.sizes = plan.sizes
        self.axis_names = tuple(axis_names)
        self.group_names = tuple(group_names)
        self.graph = torch.fx.Graph()
        self.env: dict = {}  # (value, layout) -> local node
        self.produced: dict = {}  # value -> local node in its produced layout
        self.coords = None
        self._steps: dict = {}  # (id(have), id(want), shape) -> (have, want, the steps): `steps`

    def call(self, op, *args, **kwargs) -> torch.fx.Node:
        return new_node(self.graph, "call_function", op, args, kwargs)

    def local(self, v, layout: Layout, val: torch.Tensor) -> torch.fx.Node:
        key = (v, layout)
        node = self.env.get(key)
        if node is None:
            have = self.plan.out_layout(v)
            node = self.produced[v]
            if have is not layout:  # (the same object: nothing to move, as most inputs are)
                steps = self.steps(have, layout, tuple(val.shape))
                if steps is None:  # the solver never picks an impossible change
                    raise AssertionError(f"no way from {have} to {layout} for {v[0].name}")
                for step in redistribute.merged(steps):  # a run over several axes as one collective
                    node = prog.note_local(self.emit(step, node, val), step.out_shape, val.dtype)
            self.env[key] = node
        return node

    def steps(self, have: Layout, want: Layout, shape: tuple[int, ...]) -> list | None:
        """`redistribute.plan(have, want, shape)`, asked once per layouts and shape (identical layers
        ask the same; layouts by identity first: placements compare slowly)."""
        key = (id(have), id(want), shape)
        known = self._steps.get(key)
        if known is None or known[0] is not have or known[1] is not want:
            known = self._steps[key] = (have, want, redistribute.plan(have, want, shape, self.sizes))
        return known[2]

    def axis_index(self, names: Sequence[str]) -> torch.fx.Node:
        """This rank's position along `names` (major to minor), from `coords`."""
        mesh_sizes = self.mesh_sizes
        index = self.call(aten.scalar_tensor.default, 0, dtype=torch.int64)
        for name in names:
            if mesh_sizes[name] > 1:
                coord = self.call(aten.select.int, self.coords, 0, self.axis_names.index(name))
                index = self.call(aten.add.Tensor, self.call(aten.mul.Tensor, index, mesh_sizes[name]), coord)
        return index

    def comm(self, step: redistribute.Step, val: torch.Tensor, sent: tuple[int, ...],
             axis: str | None = None, group: str | None = None) -> Comm:
        """The record of `step` run on a value like `val`, handed a tensor of shape `sent`."""
        itemsize = val.element_size()
        return Comm(step.kind, (axis,) if axis else tuple(self.axis_names[m] for m in step.over), tuple(sent),
                    prog.received_shape(step.kind, sent, step.size), val.dtype, val.device,
                    group or self.group(step), step.value_bytes(itemsize), step.moved_bytes(itemsize))

    def group(self, step: redistribute.Step) -> str:
        """The process group `step` runs over: its axis's, or its axes' flattened (`merged`)."""
        if not step.axes:
            return self.group_names[step.axis]
        return self.group_of(tuple(self.axis_names[m] for m in step.axes))

    def manual_comm(self, node: torch.fx.Node) -> Comm:
        """What a collective the user wrote (nf.lax, in a shard_map) moves."""
        kind = {c10d.all_reduce.default: "all_reduce", c10d.all_gather_into_tensor.default: "all_gather",
                c10d.reduce_scatter_tensor.default: "reduce_scatter",
                c10d.all_to_all_single.default: "all_to_all"}[node.target]
        group = node.args[-1]
        known = group in self.group_names  # else a flattened group over several axes
        axis = self.group_names.index(group) if known else 0
        val, out = node.args[0].meta["val"], node.meta["val"]
        step = redistribute.Step(kind, axis, None, None, tuple(val.shape), tuple(out.shape),
                                 self.sizes[axis] if known else 2)
        c = self.comm(step, val, tuple(val.shape), self.axis_names[axis] if known else "axes of the region", group)
        return dataclasses.replace(c, received=tuple(out.shape))

    def emit(self, step: redistribute.Step, x: torch.fx.Node, val: torch.Tensor) -> torch.fx.Node:
        group, n, d = self.group(step), step.size, step.dim
        if step.kind == "slice":
            index = self.call(aten.view.default, self.call(aten.select.int, self.coords, 0, step.axis), [1])
            split = list(step.in_shape[:d]) + [n, step.out_shape[d]] + list(step.in_shape[d + 1:])
            block = self.call(aten.index_select.default, self.call(aten.reshape.default, x, split), d, index)
            return self.call(aten.reshape.default, block, list(step.out_shape))
        if step.kind == "partition":
            return self.partition(step, x, val)
        if step.kind == "all_to_all":
            return self.all_to_all(step, x, val)
        if step.kind == "permute":
            return self.permute(step, x, val)
        sent = tuple(step.in_shape)
        if not val.is_contiguous() or (step.kind == "reduce_scatter" and d != 0):
            if step.kind == "reduce_scatter" and d != 0:  # blocks along d, stacked on dim 0
                # one copy whatever n (not n slices and a cat: n nodes per collective); splitting
                # one dim is a view of any strides
                shape = list(step.in_shape)
                blocks = self.call(aten.view.default, x, shape[:d] + [n, shape[d] // n] + shape[d + 1:])
                order = list(range(len(shape) + 1))
                sent = (sent[0] * n, *sent[1:d], sent[d] // n, *sent[d + 1:])
                x = self._copied(self.call(aten.permute.default, blocks, [d] + order[:d] + order[d + 1:]), sent)
            else:
                x = self.call(aten.clone.default, x, memory_format=torch.contiguous_format)
        if step.kind == "all_reduce":  # a mean as a sum, divided below
            comm = self.call(c10d.all_reduce.default, x, step.reduce_op if step.reduce_op in EXTREMA else "sum", group)
        elif step.kind == "all_gather":
            comm = self.call(c10d.all_gather_into_tensor.default, x, n, group)
        else:
            comm = self.call(c10d.reduce_scatter_tensor.default, x, "sum", n, group)
        prog.set_comm(comm, self.comm(step, val, sent))
        out = self.call(c10d.wait_tensor.default, comm)
        if step.reduce_op == "avg":
            out = self.call(aten.div.Tensor, out, n)
        if step.kind == "all_gather" and d != 0:  # rank blocks arrive stacked on dim 0: put them along d
            shape = list(step.in_shape)
            blocks = self.call(aten.view.default, out, [n] + shape)
            order = list(range(1, len(shape) + 1))
            out = self._copied(self.call(aten.permute.default, blocks, order[:d] + [0] + order[d:]), step.out_shape)
        return out

    def partition(self, step: redistribute.Step, x: torch.fx.Node, val: torch.Tensor) -> torch.fx.Node:
        """A whole value made a pending reduction over `step.axis`, exactly: a sum (a product) is
        the value on the axis's first rank and zero (one) on the others; a mean or an extremum of
        copies is the value itself."""
        if step.reduce_op not in ("sum", "product"):
            return x
        first = self.call(aten.eq.Scalar, self.call(aten.select.int, self.coords, 0, step.axis), 0)
        rest = self.call(aten.scalar_tensor.default, 0 if step.reduce_op == "sum" else 1, dtype=val.dtype)
        return self.call(aten.where.self, first, x, rest)

    def _copied(self, x: torch.fx.Node, shape) -> torch.fx.Node:
        """`x` copied into a buffer of its own, in its order, and viewed as `shape`."""
        copy = self.call(aten.clone.default, x, memory_format=torch.contiguous_format)
        return self.call(aten.view.default, copy, list(shape))

    def permute(self, step: redistribute.Step, x: torch.fx.Node, val: torch.Tensor) -> torch.fx.Node:
        """Two axes trading their dims. Of one size: the block at (.., i, .., j, ..) goes to
        (.., j, .., i, ..). The first m times the second: m rounds, in round r the rank at
        (.., i, .., j, ..) sends piece (i + r) mod m of its block to (.., j m + (i + r) mod m, .., i // m, ..)
        (`point_to_point.trade_blocks`)."""
        from ndfunc._src.point_to_point import permute_blocks, trade_blocks

        names, sizes = list(self.mesh_sizes), list(self.mesh_sizes.values())
        a, b = names.index(self.axis_names[step.axis]), names.index(self.axis_names[step.joined])
        m = sizes[a] // sizes[b]
        rounds = []
        for r in range(m):
            pairs = []
            for coord in itertools.product(*(range(n) for n in sizes)):
                to = list(coord)
                if m == 1:
                    to[a], to[b] = coord[b], coord[a]
                else:
                    to[a], to[b] = coord[b] * m + (coord[a] % m + r) % m, coord[a] // m
                pairs.append((rank_at(coord, sizes), rank_at(to, sizes)))
            rounds.append(tuple(pairs))
        if m == 1:
            out = self.call(permute_blocks, x, rounds[0])
        else:
            split = next(d for d, (i, o) in enumerate(zip(step.in_shape, step.out_shape)) if o < i)
            join = next(d for d, (i, o) in enumerate(zip(step.in_shape, step.out_shape)) if o > i)
            out = self.call(trade_blocks, x, self.coords, step.axis, m, split, join, tuple(rounds))
        block = math.prod(step.in_shape) * val.element_size()
        prog.set_comm(out, Comm("ppermute", (self.axis_names[step.axis], self.axis_names[step.joined]),
                                tuple(step.in_shape), tuple(step.in_shape), val.dtype, val.device, None,
                                step.value_bytes(val.element_size()), block))
        return out

    def all_to_all(self, step: redistribute.Step, x: torch.fx.Node, val: torch.Tensor) -> torch.fx.Node:
        """Shard(joined) -> Shard(dim): block i of `dim` to rank i, stacked on a new dim 0; what
        arrives from rank i is its block of `joined`, put back in rank order."""
        n, d, a, shape = step.size, step.dim, step.joined, list(step.in_shape)
        split = shape[:d] + [n, shape[d] // n] + shape[d + 1:]
        blocks = self.call(aten.reshape.default, x, split)
        rest = list(range(len(shape) + 1))
        if d != 0:
            blocks = self.call(aten.permute.default, blocks, [d] + rest[:d] + rest[d + 1:])
            blocks = self.call(aten.clone.default, blocks, memory_format=torch.contiguous_format)
        else:  # the local block may be a view even where the whole value is not: a copy only if so
            blocks = self.call(aten.contiguous.default, blocks)
        comm = self.call(c10d.all_to_all_single.default, blocks, [1] * n, [1] * n, self.group_names[step.axis])
        prog.set_comm(comm, self.comm(step, val, tuple(split[d:d + 1] + split[:d] + split[d + 1:])))
        arrived = self.call(c10d.wait_tensor.default, comm)
        if a != 0:  # the rank blocks next to `joined`'s
            arrived = self.call(aten.permute.default, arrived, rest[1:a + 1] + [0] + rest[a + 1:])
        return self.call(aten.reshape.default, arrived, list(step.out_shape))


def _carry_marks(since: torch.fx.Node, traced: torch.fx.Node) -> None:
    """Mark the local nodes after `since` (those lowered from `traced`) with its annotations."""
    node = since.next
    while node.op != "root":
        prog.carry_marks(node, traced)
        node = node.next


def lower(graph: torch.fx.Graph, plan: Plan, axis_names: Sequence[str], group_names: Sequence[str],
          group_of: Callable[[tuple[str, ...]], str], mesh_sizes: dict[str, int] | None = None) -> torch.fx.GraphModule:
    """The local program of `graph` under `plan`: inputs are the local blocks of the original
    inputs, then `coords`; outputs are local blocks in `plan.outputs`' layouts. A layout change's
    collectives over several axes run as one over those axes flattened (`redistribute.merged`),
    on the group `group_of(axis names)` names. `mesh_sizes` (every mesh axis, size-1 ones too)
    places `nf.lax.axis_index` over several axes."""
    mesh_sizes = dict(mesh_sizes or dict(zip(axis_names, plan.sizes)))
    e = _Emitter(plan, axis_names, group_names, mesh_sizes, group_of)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        e.produced[(node, 0)] = ph = e.graph.placeholder(node.name)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and node in plan.strategy:
            prog.note_local(ph, local_shape(tuple(val.shape), plan.strategy[node].outs[0], plan.sizes), val.dtype)
    e.coords = e.graph.placeholder("coords")
    constants = torch.nn.Module()  # the tensors the step closed over, whole on every rank
    for node in graph.find_nodes(op="get_attr"):
        if node in plan.strategy:
            setattr(constants, node.target, getattr(graph.owning_module, node.target))
            e.produced[(node, 0)] = got = e.graph.get_attr(node.target)
            prog.note_local(got, node.meta["val"].shape, node.meta["val"].dtype)
    for node in graph.nodes:
        if node.op != "call_function" or node not in plan.strategy:
            continue
        s = plan.strategy[node]
        args = tensor_inputs(node)
        _check_write_in_place(node, args, s, plan)
        locals_ = [e.local(value_of(a), lay, a.meta["val"]) for a, lay in zip(args, s.ins)]
        since = next(iter(reversed(e.graph.nodes)))  # what comes after it is `node`'s own
        rule = rule_of(node.target)
        if rule is not None and rule.lower is not None:  # not the op on blocks (ndfunc._src.partition.planning.ops)
            e.produced[(node, 0)] = rule.lower(e, node, locals_)
            _carry_marks(since, node)
            continue
        if prog.is_manual(node):  # already per rank, as the user wrote it
            op, a, kw = node.target, node.args, node.kwargs
        else:
            op, a, kw = local_args(node, s.ins, plan.sizes, s.outs[0] if len(s.outs) == 1 else None)
            if rule is not None and rule.local is not None:
                a = rule.local(node, a)
            op = ON_BLOCKS.get(op, op)  # (a block of a view need not be viewable: `view_ops`)
        own_comm = None
        if (own := prog.local_op(node)) is not None:  # a transform's own local op (nf.ring_attention)
            op, a, kw, own_comm = own(LoweringContext(e.coords, e.axis_names, e.sizes), node, s, op, a, kw)
        mapping = iter(locals_)
        a, kw = torch.fx.node.map_arg(  # fx's own walk over arguments: a pytree's costs more than the op
            (a, kw), lambda x: next(mapping) if isinstance(x.meta.get("val"), torch.Tensor) else x)
        out = new_node(e.graph, "call_function", op, tuple(a), dict(kw))
        if own_comm is not None:
            prog.set_comm(out, own_comm)
        if op in _MANUAL_COMMS:
            prog.set_comm(out, e.manual_comm(node))
        if isinstance(node.meta.get("val"), (tuple, list)):
            for j, lay in enumerate(s.outs):
                if lay is not None:
                    e.produced[(node, j)] = e.call(operator.getitem, out, j)
        else:
            e.produced[(node, 0)] = out
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):  # shape and dtype here, for passes before metadata
                shape = tuple(val.shape) if prog.is_manual(node) else local_shape(tuple(val.shape), s.outs[0], plan.sizes)
                prog.note_local(out, shape, val.dtype)
        _carry_marks(since, node)
    results = [e.local(v, lay, _val(v)) for v, lay in plan.outputs]
    # a constant the step returns (or a block of one) leaves as a copy: the caller may write into
    # a result, or donate it, and the constant serves every later call
    for i, r in enumerate(results):
        if buffer_of(r).op == "get_attr":
            results[i] = e.call(aten.clone.default, r)
            if (note := prog.local_note(r)) is not None:
                prog.note_local(results[i], *note)
    e.graph.output(results)
    eliminate_dead_code(e.graph)
    # passes rewrite it and recompile; its code is made only if read or called (the step runs
    # ops bound by `torch_compat.bind_ops`), not once per pass
    return LazyGraphModule(constants, e.graph)


def _val(v) -> torch.Tensor:
    val = v[0].meta["val"]
    return val[v[1]] if isinstance(val, (tuple, list)) else val


def _check_write_in_place(node: torch.fx.Node, args: list, strategy, plan) -> None:
    """An op writing into its first argument where the plan moves that argument writes into the
    moved copy: whatever reads the argument afterwards would not see the write. So does one writing
    into a view (or a view of a view) of a tensor the plan moved for the view. Refused, not run
    (the tracer makes the common writes functional ops: `writes`)."""
    if not args or args[0] is not (node.args[0] if node.args else None) or not writes_into(node, args[0]):
        return
    written = value_of(args[0])
    chain = [written[0]]  # what it writes into, and what that is a view of
    while is_view(chain[-1]) and isinstance(chain[-1].args[0], torch.fx.Node):
        chain.append(chain[-1].args[0])
    # where the layouts differ: at the write, or between a view and what it views
    pairs = [(written, strategy.ins[0], node)] + [
        (value_of(v.args[0]), plan.strategy[v].ins[0], v) for v in chain[:-1] if v in plan.strategy]
    moved = [(w, want, at) for w, want, at in pairs if plan.strategy[w[0]].outs[w[1]] != want]
    if not moved:
        return
    (w, want, at), *_ = moved
    later = [u for v in chain for u in v.users if u is not node and u not in chain and _after(u, node)]
    if at is not node:  # a view of a moved copy: what reads that copy (the value moved once) sees the write
        later = [u for u in later if not (w[0] in u.args and _reads_as(plan, u, w, want))]
    reader = "the caller" if chain[-1].op == "placeholder" else later[0].name if later else None  # (an argument)
    if reader is not None:
        raise NotImplementedError(
            f"{node.target} writes in place into {written[0].name}"
            + ("" if at is node else f", a view of {w[0].name}")
            + f", which the partitioner lays out otherwise for the {'write' if at is node else 'view'} "
            f"({plan.strategy[w[0]].outs[w[1]]} there, {want} here), and {reader} reads it (or what it views) "
            f"afterwards: it would not see the write. "
            f"Write it without the in-place op (x = x.index_put(...), torch.slice_scatter) or run it inside "
            f"nf.shard_map.")


def _reads_as(plan, u: torch.fx.Node, value: tuple, layout) -> bool:
    """Whether `u` reads `value` (node, output) in `layout` wherever it reads it."""
    if u not in plan.strategy:
        return False
    slots = [i for i, a in enumerate(tensor_inputs(u)) if value_of(a) == value]
    return bool(slots) and all(plan.strategy[u].ins[i] == layout for i in slots)


def _after(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether `a` comes after `b` in their graph."""
    n = b.next
    while n.op != "root":
        if n is a:
            return True
        n = n.next
    return False
