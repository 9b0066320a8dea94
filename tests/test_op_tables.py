"""The op tables (`view_ops`, `write_ops`, `cast_ops`) against torch's own account of each op (its
schema, its kernel on small tensors) and against the consumers that do not read the tables: DTensor's
rules, torch's flop counter, `nf.remat`'s policy and the replay's prices."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map_only

from ndfunc._src import cast_ops, view_ops, write_ops
from ndfunc._src.partition.planning.flops import node_flops
from ndfunc._src.partition.planning.ops import has_rule, saved_by_remat
from ndfunc._src.partition.planning.strategies import AXIS_BY_AXIS
from ndfunc._src.planner.cluster import device
from ndfunc._src.replay.timeline import KERNELS, op_seconds
from ndfunc._src.torch_compat import view_rule
from ndfunc._src.trace import trace

aten = torch.ops.aten
H100 = device("h100")

# a view op -> (its input's shape, its arguments after `self`): one example of each table entry
VIEW_EXAMPLES = {
    aten.view.default: ((2, 3, 4), ([6, 4],)),
    aten.reshape.default: ((2, 3, 4), ([6, 4],)),
    aten._unsafe_view.default: ((2, 3, 4), ([6, 4],)),
    aten.permute.default: ((2, 3, 4), ([2, 0, 1],)),
    aten.transpose.int: ((2, 3, 4), (0, 2)),
    aten.t.default: ((3, 4), ()),
    aten.unsqueeze.default: ((2, 3, 4), (1,)),
    aten.squeeze.dim: ((2, 1, 4), (1,)),
    aten.squeeze.dims: ((2, 1, 4), ([1],)),
    aten.clone.default: ((2, 3, 4), ()),
    aten.contiguous.default: ((2, 3, 4), ()),
    aten.slice.Tensor: ((2, 3, 4), (1, 1, 3)),
    aten.select.int: ((2, 3, 4), (2, 1)),
    aten.diagonal.default: ((3, 3, 4), (1, 0, 1)),
    aten.split.Tensor: ((4, 3), (3,)),
    aten.split_with_sizes.default: ((4, 3), ([1, 3],)),
    aten.alias.default: ((2, 3), ()),
    aten.detach.default: ((2, 3), ()),
    aten.as_strided.default: ((2, 3, 4), ([3, 4], [4, 1], 4)),
}


def _node(op, *args, **kwargs) -> torch.fx.Node:
    """A node calling `op` on placeholders holding the tensors of `args`, its value computed."""
    graph = torch.fx.Graph()

    def placeholder(t):
        node = graph.placeholder(f"x{len(graph.nodes)}")
        node.meta["val"] = t
        return node
    node = graph.call_function(op, tree_map_only(torch.Tensor, placeholder, args), kwargs)
    node.meta["val"] = op(*args, **kwargs)
    return node


def _eager(op, *args, **kwargs):
    """`call` for a table's functions that add ops: the op run on the nodes' values."""
    return op(*torch.fx.node.map_arg(args, lambda n: n.meta["val"]), **kwargs)


def _free(node: torch.fx.Node) -> None:
    """No arithmetic, as the flop counter and remat see it."""
    assert node_flops(node) == 0 and not saved_by_remat(node.target), node.target


def _pieces(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("op", list(view_ops.VIEWS), ids=str)
def test_each_view_is_what_its_schema_kernel_and_rules_say(op):
    assert set(VIEW_EXAMPLES) == set(view_ops.VIEWS), "an example for each entry of the views table"
    view = view_ops.VIEWS[op]
    shape, args = VIEW_EXAMPLES[op]
    x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    out = _pieces(op(x, *args))
    # memory: the schema's aliasing, but where the table says torch's schema leaves it out
    assert view.aliases == (view_ops.returns_view(op) or op in view_ops.UNDECLARED_ALIASES)
    assert not (op in view_ops.UNDECLARED_ALIASES and view_ops.returns_view(op)), f"{op}'s schema declares it now"
    assert all((o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) == view.aliases for o in out)
    # elements: what its kind says of them
    flat = torch.cat([o.reshape(-1) for o in out])
    if view.kind in ("reshape", "copy", "alias", "pieces"):
        assert torch.equal(flat, x.reshape(-1)) and (view.kind != "alias" or torch.equal(out[0], x))
    elif view.kind == "reorder":
        assert torch.equal(flat.sort().values, x.reshape(-1))
    else:  # a part, or what strides name
        assert flat.numel() < x.numel() and bool(torch.isin(flat, x).all())
    # strides: a reader of them refuses, or reads other elements, where the same values lie otherwise
    restrided = x.permute(*reversed(range(x.dim()))).contiguous().permute(*reversed(range(x.dim())))
    try:
        same = all(torch.equal(a, b) for a, b in zip(_pieces(op(restrided, *args)), out))
    except RuntimeError:
        same = False
    assert same != view.reads_strides
    # layouts: the rule the table names is DTensor's (a reshape's dim map is read for contiguous blocks)
    assert (view.layouts == "view rule") == (view_rule(op) is not None)
    assert (view.layouts == "by axis") == (op in AXIS_BY_AXIS)
    assert (view.layouts == "whole") == (not has_rule(op))
    if view.on_blocks is not None:  # the same view, where a block allows it
        assert torch.equal(view.on_blocks(x, *args), out[0]) and view_rule(view.on_blocks) is not None
    # written back: a source written into the view is the base with it written
    if view.written_back is not None:
        source = torch.randn(out[0].shape)
        written = x.clone()
        op(written, *args).copy_(source)
        put = view.written_back(_eager, _node(op, x, *args), source)
        assert torch.equal(put, written), op
    assert (view.kind == "part") == (op in view_ops.PARTS) and (op not in view_ops.PARTS or view.written_back)
    # no arithmetic; a view of its input's memory costs nothing in the replay
    node = _node(op, x, *args)
    _free(node)
    assert (op_seconds(node, H100, KERNELS)[0] == 0) == view.aliases


# an op that overwrites -> its arguments: one example of each
OVERWRITE_EXAMPLES = {
    aten.copy_.default: lambda x: (x, torch.full_like(x, 7.0)),
    aten.fill_.Scalar: lambda x: (x, 7.0),
    aten.fill_.Tensor: lambda x: (x, torch.tensor(7.0)),
    aten.zero_.default: lambda x: (x,),
}


def _types(schema, leave_out=()) -> list:
    return [(a.name, str(a.type)) for a in schema.arguments if a.name not in leave_out]


@pytest.mark.parametrize("op", list(write_ops.WRITES), ids=str)
def test_each_write_is_what_its_schema_and_kernel_say(op):
    write = write_ops.WRITES[op]
    schema = op._schema
    arguments = {a.name: a for a in schema.arguments}
    for name in write.writes:  # the table's arguments: the ones its schema marks written, or none is
        marked = arguments[name].alias_info is not None and arguments[name].alias_info.is_write
        assert marked == write.declared, (op, name)
    assert write.declared == bool(write_ops.written(op))
    assert write.when is None or str(arguments[write.when].type) == "bool"
    if write.functional is not None:  # the same arguments, but the one an `out=` form writes into
        assert _types(write.functional._schema) == _types(schema, leave_out=("out",))
        assert write_ops.functional(op) is write.functional
        if write.writes == ("self",):
            assert write_ops._by_name(op) is write.functional, "ATen's names agree"
    if write.reuse:  # elementwise
        assert torch.Tag.pointwise in write.functional.tags and write.writes in (("self",), ("out",))
    assert (op in OVERWRITE_EXAMPLES) == write.overwrites, "an example of each op that overwrites"
    if write.overwrites:  # nothing of what was there is left
        results = [op(*OVERWRITE_EXAMPLES[op](torch.randn(2, 3))) for _ in range(2)]
        assert torch.equal(*results)
        assert torch.equal(write.functional(*OVERWRITE_EXAMPLES[op](torch.randn(2, 3))), results[0])


@pytest.mark.parametrize("op", list(write_ops.OVERWRITES), ids=str)
def test_a_write_into_a_slice_of_a_made_tensor_is_traced_functional(op):
    def step(x):
        z = x * 2
        op(*OVERWRITE_EXAMPLES[op](z[:, 1:]))
        return z

    x = torch.randn(2, 3)
    traced = trace(step, (x,), {})
    assert not any(write_ops.written(n.target) for n in traced.graph_module.graph.nodes if n.op == "call_function")
    assert torch.equal(traced.graph_module(x)[0], step(x))


def test_an_update_in_place_of_a_view_is_traced_as_its_functional_op():
    def step(x):  # (`pow_.Scalar` is no `pow.Scalar`: that one takes a number to a tensor's powers)
        z = x * 1
        z[:, :2].pow_(2)
        return z

    x = torch.randn(3, 4)
    traced = trace(step, (x,), {})
    assert aten.pow.Tensor_Scalar in {n.target for n in traced.graph_module.graph.nodes}
    assert torch.equal(traced.graph_module(x)[0], step(x))


@pytest.mark.parametrize("op", list(cast_ops.CASTS), ids=str)
def test_each_cast_is_what_its_schema_and_kernel_say(op):
    cast = cast_ops.CASTS[op]
    arguments = op._schema.arguments
    given = next(a for i, a in enumerate(arguments) if cast.dtype in (i, a.name))
    assert str(given.real_type) in ("ScalarType", "Optional[ScalarType]") and cast.also <= {a.name for a in arguments if a.kwarg_only}
    x = torch.randn(2, 3)
    node = _node(op, x, torch.bfloat16) if isinstance(cast.dtype, int) else _node(op, x, dtype=torch.bfloat16)
    assert node.meta["val"].dtype == cast_ops.new_dtype(node) == torch.bfloat16
    assert cast_ops.dtype_only(node) and has_rule(op)
    # no arithmetic, but its bytes are read and written
    _free(node)
    assert op_seconds(node, H100, KERNELS)[0] > 0
    assert cast_ops.CAST in cast_ops.CASTS
