"""Every private torch API ndfunc uses (`ndfunc._src.torch_compat`), exercised against what it stands
for: after a torch upgrade this file says which entry point moved."""

import contextlib
import operator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ndfunc as nf
from ndfunc._src import swaps
from ndfunc._src import torch_compat as compat


def test_every_entry_point_is_tested_here():
    # each name (case and underscores aside) is in the name of a test below
    tested = [name.replace("_", "") for name in globals() if name.startswith("test_")]
    covered = {n for n in compat.__all__ if any(n.lower().replace("_", "") in t for t in tested)}
    assert covered == set(compat.__all__), sorted(set(compat.__all__) - covered)


def test_sharding_propagator_and_opschema_dtensorspec_tensormeta_opspec_opstrategy_tuplestrategy():
    p = compat.sharding_propagator()
    mm = torch.ops.aten.mm.default
    assert mm in p.op_strategy_funcs or mm in p.op_single_dim_strategy_funcs
    mesh = compat.shape_only_device_mesh((2, 2))
    meta = compat.TensorMeta(torch.Size([4, 4]), (4, 1), torch.float32)
    spec = compat.DTensorSpec(mesh, (Shard(0), Replicate()), tensor_meta=meta)
    strategy = compat.OpStrategy([compat.OpSpec(spec)])
    schema = compat.OpSchema(torch.ops.aten.cat.default, (compat.TupleStrategy((strategy, strategy)),), {})
    assert schema.op is torch.ops.aten.cat.default and spec.placements == (Shard(0), Replicate())


def test_shape_only_device_mesh_has_a_shape_and_no_process_group():
    mesh = compat.shape_only_device_mesh((2, 4))
    assert tuple(mesh.mesh.shape) == (2, 4) and not dist.is_initialized()


def test_localtensor_localtensormode_local_tensor_mode_local_blocks_fake_store_random_rng_tracker_set_random_rng_tracker():
    assert compat.local_tensor_mode() is None
    tracker = compat.random_rng_tracker()
    with nf.simulate(2):
        mode = compat.local_tensor_mode()
        assert isinstance(mode, compat.LocalTensorMode) and dist.get_backend() == "fake"
        x = mode.rank_map(lambda r: torch.full((2,), float(r)))
        assert isinstance(x, compat.LocalTensor)
        assert {r: t.tolist() for r, t in compat.local_blocks(x).items()} == {0: [0.0, 0.0], 1: [1.0, 1.0]}
    compat.set_random_rng_tracker(compat.random_rng_tracker())
    assert compat.random_rng_tracker() is tracker
    store = compat.fake_store()
    assert store is not None


def test_local_of_and_dtensor_of_local_group_size_group_backend_flattened_functional_collectives():
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh.device_mesh, [Shard(0), Replicate()])
        local = compat.local_of(x)
        y = compat.dtensor_of_local(local, x._spec)
        assert isinstance(y, DTensor) and torch.equal(y.full_tensor(), x.full_tensor())
        group = mesh.device_mesh.get_group(0).group_name
        assert compat.group_size(group) == 2 and compat.group_backend(group) == "fake"
        flat = compat.flattened(mesh.device_mesh[("dp", "tp")])
        assert flat.size() == 4
        funcol = compat.functional_collectives()
        summed = funcol.wait_tensor(funcol.all_reduce(local, "sum", (mesh.device_mesh, 0)))  # over dp
        whole = torch.arange(8.0).reshape(4, 2)
        assert all(torch.equal(t, whole[:2] + whole[2:]) for t in compat.local_blocks(summed).values())


def test_process_group_ranks_and_local_reduce_are_the_simulated_modes_groups_and_sums():
    with nf.simulate(8):
        mesh = nf.make_mesh(dp=2, cp=2, tp=2)
        cp = mesh.device_mesh.get_group(1).group_name  # ranks {0, 2}, {1, 3}, {4, 6}, {5, 7}
        members, offsets = compat.process_group_ranks(cp)
        assert members == [0, 2] and sorted(offsets) == [0, 1, 4, 5]
    ts = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]
    assert compat.local_reduce("sum", ts).item() == 0.0  # (1e8 + 1) - 1e8 in fp32: rank order, left to right
    assert compat.local_reduce("avg", [torch.tensor([1.0]), torch.tensor([3.0])]).item() == 2.0


def test_stridedshard_is_dtensors_own():
    p = compat.StridedShard(0, split_factor=2)
    assert type(p).__name__ == "_StridedShard" and (p.dim, p.split_factor) == (0, 2)


def test_faketensor_faketensormode_unset_fake_temporarily_torchdispatchmode_current_dispatch_mode_pop_dispatch_mode():
    with compat.FakeTensorMode():
        t = torch.empty(3)
        assert isinstance(t, compat.FakeTensor)
        with compat.unset_fake_temporarily():
            assert not isinstance(torch.empty(3), compat.FakeTensor)

    class Count(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Count() as mode:
        assert compat.current_dispatch_mode() is mode
        with compat.pop_dispatch_mode() as popped:
            assert popped is mode and compat.current_dispatch_mode() is None


def test_lazygraphmodule_bind_ops_and_pytree():
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.output(g.call_function(torch.ops.aten.add.Tensor, (g.call_function(torch.ops.aten.mul.Tensor, (a, b)), 1)))
    gm = compat.LazyGraphModule(torch.nn.Module(), g)
    run = compat.bind_ops(gm)
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(run(x, x), x * x + 1) and torch.equal(gm(x, x), x * x + 1)
    assert compat.pytree.tree_leaves({"a": [1, 2]}) == [1, 2]


def test_compiled_program_runs_a_lazy_graph_module_through_torch_compile():
    g = torch.fx.Graph()
    a = g.placeholder("a")
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (g.call_function(torch.ops.aten.sin.default, (a,)), 2)))
    gm = compat.LazyGraphModule(torch.nn.Module(), g)  # its forward is not written yet
    x = torch.tensor([0.5, 1.0])
    assert torch.equal(compat.compiled_program(gm, "aot_eager")(x), torch.sin(x) * 2)


def test_sdpa_choice_is_the_kernel_torchs_attention_runs():
    q = torch.zeros(1, 1, 16, 8)
    assert compat.sdpa_choice(q, q, q, None) == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value  # on the CPU
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        assert compat.sdpa_choice(q, q, q, None) == torch.nn.attention.SDPBackend.MATH.value


def test_lazy_graph_modules_defer_the_code_of_a_traced_graph_to_its_first_call():
    from torch.fx.experimental.proxy_tensor import make_fx

    with compat.lazy_graph_modules(True):
        gm = make_fx(lambda x: x * 2 + 1)(torch.ones(2))
    assert isinstance(gm, compat.LazyGraphModule) and gm._needs_recompile()  # no code written yet
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 3.0)) and not gm._needs_recompile()


@pytest.mark.skipif(not compat.onednn_available(), reason="this torch is built without oneDNN")
def test_onednn_available_and_onednn_linear_multiply():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    torch.testing.assert_close(compat.onednn_linear(a, b), a @ b)


def test_redistribute_logger_is_dtensors():
    import logging

    import torch.distributed.tensor._redistribute  # noqa: F401 - the module whose logger it names

    assert compat.REDISTRIBUTE_LOGGER in logging.Logger.manager.loggerDict


def test_traced_as_compiling_sets_what_torch_compiler_is_compiling_reads():
    assert not torch.compiler.is_compiling()
    with swaps.swapped(), compat.traced_as_compiling():  # (as the tracer enters them)
        assert torch.compiler.is_compiling()
        torch._check_tensor_all(torch.tensor([True, False]))  # the hint's values are not read
    assert not torch.compiler.is_compiling()
    for inside in (swaps.swapped, contextlib.nullcontext):  # swapped in, and swapped out again: torch's own
        with inside(), pytest.raises(RuntimeError, match="Expected cond to be True"):
            torch._check_tensor_all(torch.tensor([True, False]))


def test_core_aten_decompositions_decomposition_table_datadependentoutputexception_dynamicoutputshapeexception():
    assert torch.ops.aten.native_batch_norm.default in compat.decomposition_table
    table = compat.core_aten_decompositions()
    x = torch.randn(4, 3)
    y = torch.randn(4, 3)
    torch.testing.assert_close(table[torch.ops.aten.mse_loss.default](x, y, 1), torch.nn.functional.mse_loss(x, y))
    with compat.FakeTensorMode():
        fake = torch.empty(4)
        with pytest.raises(compat.DataDependentOutputException):
            fake.sum().item()
        with pytest.raises(compat.DynamicOutputShapeException):
            torch.nonzero(fake)


def test_view_rule_gives_dtensors_strategies_per_input_layout_and_renames_dims_only_which_go_axis_by_axis():
    """The view path of the partitioner's candidates (`view_rule`) against asking DTensor's rule
    itself, one layout at a time, on every view-like node of a small program and three meshes. They
    differ only where a reshape takes a split DTensor's rule would move (or leave strided) as it is."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ndfunc._src.partition.planning import strategies
    from ndfunc._src.partition.planning.layout import fits

    gm = make_fx(lambda x: x.view(4, 6, 2).permute(2, 0, 1).unsqueeze(0).expand(3, 2, 4, 6).squeeze(0)
                 .transpose(1, 2).reshape(3, 12, 4))(torch.ones(48))
    # flattening and splitting sharded dims (the rule's _StridedShard cases), on four axes too
    split = make_fx(lambda x: x.reshape(2, 8, 4, 6).flatten(1, 2).unflatten(2, (2, 3)).movedim(1, 3)
                    .reshape(-1))(torch.ones(16, 24))
    views = [n for g in (gm, split) for n in g.graph.nodes
             if n.op == "call_function" and compat.view_rule(n.target) is not None]
    assert {n.target for n in views} >= {torch.ops.aten.view.default, torch.ops.aten.permute.default,
                                         torch.ops.aten.unsqueeze.default, torch.ops.aten.expand.default}
    assert compat.view_rule(torch.ops.aten.mm.default) is None
    # the rules answered axis by axis (`strategies._by_axis`) and those asked whole are both here
    renames = {n.target: compat.renames_dims_only(compat.view_rule(n.target)[0](
        *compat.pytree.tree_map_only(torch.fx.Node, lambda a: a.meta["val"], n.args))) for n in views}
    assert renames[torch.ops.aten.permute.default] and renames[torch.ops.aten.unsqueeze.default]
    assert not renames[torch.ops.aten.view.default] and not renames[torch.ops.aten.expand.default]
    contiguous = 0
    for sizes in [(2, 2, 2), (2, 4), (2, 2, 2, 2)]:
        for node in views:
            ins, outs = strategies.tensor_inputs(node), strategies.tensor_outputs(node)
            asked = strategies.from_op_strategy(node, ins, outs, sizes)
            ours = strategies._from_view_rule(node, outs, sizes, *compat.view_rule(node.target))
            # the strategies told apart are a reshape's, of blocks that stay contiguous
            # (tests/test_views.py): taken as they are, where DTensor's rule moves a split
            # (which it also offers for the layout it moves to) or leaves a strided one (which a
            # program cannot hold)
            extra, dropped = set(ours) - set(asked), set(asked) - set(ours)
            assert not (extra or dropped) or node.target in strategies.RESHAPES
            assert all(fits(s.outs[0], tuple(outs[0].shape), sizes) for s in extra)
            assert not any(fits(s.outs[0], tuple(outs[0].shape), sizes) for s in dropped), dropped
            contiguous += len(extra)
    assert contiguous > 0


def test_view_dim_map_builds_dtensors_dim_maps_with_the_commands_views_reads():
    # the commands `partition.planning.views` reads: a flatten of input dims, a split of one
    dims = compat.view_dim_map()
    flatten = dims.view_groups((4, 8, 6), (32, 6))
    assert [type(c) for c in flatten] == [dims.Flatten, dims.InputDim]
    assert [d.input_dim for d in flatten[0].input_dims] == [0, 1] and flatten[1].input_dim == 2
    split = dims.view_groups((32, 6), (4, 8, 6))
    assert [type(c) for c in split] == [dims.Split, dims.Split, dims.InputDim]
    assert [(c.input_dim.input_dim, tuple(c.group_shape), c.split_id) for c in split[:2]] == [(0, (4, 8), 0), (0, (4, 8), 1)]
    assert [type(c) for c in dims.view_groups((4, 6), (4, 1, 6))] == [dims.InputDim, dims.Singleton, dims.InputDim]


def test_rules_without_costs_zeroes_dtensors_redistribute_cost_on_this_thread_only():
    import threading

    from torch.distributed.tensor._ops import utils

    mesh = compat.shape_only_device_mesh((4,))
    meta = compat.TensorMeta(torch.Size([64, 64]), (64, 1), torch.float32)
    src = compat.DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
    dst = compat.DTensorSpec(mesh, (Replicate(),), tensor_meta=meta)
    dtensors = utils.redistribute_cost
    before = utils.redistribute_cost(src, dst)
    assert before > 0
    elsewhere = []
    with compat.rules_without_costs():
        with compat.rules_without_costs():  # (nested: one swap)
            assert utils.redistribute_cost(src, dst) == 0.0
        assert utils.redistribute_cost(src, dst) == 0.0
        t = threading.Thread(target=lambda: elsewhere.append(utils.redistribute_cost(src, dst)))
        t.start()
        t.join()
    assert elsewhere == [before] and utils.redistribute_cost(src, dst) == before
    assert utils.redistribute_cost is dtensors  # DTensor's own outside


def test_no_dispatch_modes_runs_ops_on_plain_tensors_inside_a_simulation():
    with nf.simulate(2):
        x = torch.ones(3)
        assert isinstance(x, compat.LocalTensor)
        with compat.no_dispatch_modes():
            y = torch.ones(3) + 1
        assert type(y) is torch.Tensor and y.tolist() == [2.0, 2.0, 2.0]
        assert isinstance(torch.ones(3), compat.LocalTensor)


def test_no_python_dispatch_hides_ops_from_every_mode_and_reads_a_fake_tensors_metadata():
    with compat.FakeTensorMode():
        x = torch.empty(4, 6)[:, 1:]
    with compat.no_python_dispatch():
        assert (tuple(x.shape), x.stride(), x.storage_offset()) == ((4, 5), (6, 1), 1)
        assert type(torch.ones(2) + 1) is torch.Tensor
    with nf.simulate(2):
        with compat.no_python_dispatch():
            y = torch.ones(3) + 1
        assert type(y) is torch.Tensor and y.tolist() == [2.0, 2.0, 2.0]
        assert isinstance(torch.ones(3), compat.LocalTensor)


def test_route_nested_compile_regions_func_transforms_function_modes_current_tracer_current_graph_outside_the_trace_trace_nested_node_of_tracked_fake_like():
    from torch.fx.experimental.proxy_tensor import make_fx

    calls, seen, route, mine = [], {}, [], swaps.Swaps()
    compat.route_nested_compile_regions(lambda: route[-1] if route else None, mine)

    @torch.compiler.nested_compile_region
    def region(x):
        return x.sin()

    def fn(x):
        route.append(lambda f, args, kwargs: calls.append(f) or f(*args, **kwargs))
        y = region(x)
        route.pop()
        def note(name, value):
            seen[name] = compat.func_transforms()
            return value

        seen["none"] = compat.func_transforms()
        torch.func.grad(lambda x: note("under grad", x.sum()))(x)
        torch.func.vmap(lambda r: note("under vmap", r))(x)
        graph, tracer = compat.current_graph(), compat.current_tracer()
        seen["graph"] = graph is tracer.graph
        with compat.outside_the_trace():
            before = len(graph.nodes)
            x.cos()  # not recorded
            seen["outside"] = len(graph.nodes) == before
        sub = compat.trace_nested(lambda a: a * 2, [compat.fake_like(compat.node_of(x, tracer).meta["val"])])
        seen["nested"] = [n.target for n in sub.graph.nodes if n.op == "call_function"]
        node = graph.call_function(torch.ops.aten.neg.default, (compat.node_of(y, tracer),))
        z = compat.tracked(compat.fake_like(compat.node_of(y, tracer).meta["val"]), node, tracer)
        return z + 1

    with mine.swapped():
        gm = make_fx(fn, tracing_mode="fake")(torch.randn(3))
    with torch.overrides.TorchFunctionMode() as mode:
        assert compat.function_modes()[-1] is mode
    assert calls == [region.__marked_compile_region_fn__]
    assert region(torch.zeros(1)).item() == 0  # routed nowhere: torch's own (eager: the call)
    assert seen == {"none": [], "under grad": ["Grad"], "under vmap": ["Vmap"], "graph": True,
                    "outside": True,
                    "nested": [torch.ops.aten.mul.Tensor]}
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops[0] is torch.ops.aten.sin.default and ops[-2:] == [torch.ops.aten.neg.default, torch.ops.aten.add.Tensor]


def test_new_node_is_the_node_create_node_makes():
    """Names (a target's twice, an explicit one), arguments, users, the insertion point and
    `find_nodes`' table, as `Graph.create_node` leaves them."""
    aten = torch.ops.aten

    def build(make):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        made = [make(g, "call_function", aten.view.default, (x, [2, 3])),
                make(g, "call_function", aten.sum.dim_IntList, (x, [0]), {"keepdim": True}),
                make(g, "call_function", aten.relu.default, (x,), name="relu_7"),
                make(g, "call_function", aten.view.default, (x, [3, 2]))]
        with g.inserting_before(made[1]):
            made.append(make(g, "call_function", operator.getitem, (x, 0)))
        g.output(made[-1])
        return g, x, made

    def create(g, op, target, args, kwargs=None, name=None):
        return g.create_node(op, target, args, kwargs, name=name)

    g, x, made = build(compat.new_node)
    h, y, want = build(create)
    for a, b in zip(made, want):
        assert (a.name, a.op, a.target, a.kwargs) == (b.name, b.op, b.target, b.kwargs)
        assert a.args[0] is x and b.args[0] is y and a.args[1:] == b.args[1:]
    assert [n.name for n in made] == ["view_default", "sum_dim_int_list", "relu_7", "view_default_1", "getitem"]
    assert list(x.users) == made and g.python_code("self").src == h.python_code("self").src
    assert [n.name for n in g.nodes] == [n.name for n in h.nodes] and len(g.nodes) == len(h.nodes) == 7
    assert g.find_nodes(op="call_function", target=aten.view.default) == [made[0], made[3]]
    g.lint()


def test_eliminate_dead_code_removes_what_torchs_own_removes():
    """Dead pure ops go (a chain of them too), a dead write in place and a dead random draw stay, as
    `Graph.eliminate_dead_code` decides."""
    def build():
        g = torch.fx.Graph()
        x = g.placeholder("x")
        a = g.call_function(torch.ops.aten.relu.default, (x,))
        g.call_function(torch.ops.aten.neg.default, (g.call_function(torch.ops.aten.sin.default, (x,)),))  # dead
        g.call_function(torch.ops.aten.add_.Tensor, (x, a))  # dead, but writes into x
        g.call_function(torch.ops.aten.rand.default, ([2],))  # dead, but draws
        g.output((a,))
        return g
    ours, theirs = build(), build()
    assert compat.eliminate_dead_code(ours) == theirs.eliminate_dead_code() is True
    assert [(n.op, n.target) for n in ours.nodes] == [(n.op, n.target) for n in theirs.nodes]
    assert [n.target for n in ours.nodes][1:4] == [torch.ops.aten.relu.default, torch.ops.aten.add_.Tensor,
                                                  torch.ops.aten.rand.default]
    assert compat.eliminate_dead_code(ours) is False  # nothing left to remove

    # a module holding a subgraph: its dead code goes too, as torch's own does
    sub = torch.fx.GraphModule(torch.nn.Module(), build())
    outer = torch.fx.Graph()
    outer.output((outer.get_attr("sub"),))
    root = torch.nn.Module()
    root.sub = sub
    gm = torch.fx.GraphModule(root, outer)
    assert compat.eliminate_dead_code(gm.graph) is True
    assert [(n.op, n.target) for n in gm.sub.graph.nodes] == [(n.op, n.target) for n in theirs.nodes]


def test_runs_hooks_sees_a_modules_own_hooks_those_inside_it_and_global_ones():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    assert not compat.runs_hooks(model)
    for register in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                     "register_full_backward_pre_hook"):
        for module in (model, model[1][0]):
            handle = getattr(module, register)(lambda *args: None)
            assert compat.runs_hooks(model) and compat.runs_hooks(module)
            assert not compat.runs_hooks(model[0])
            handle.remove()
    for register in ("register_module_forward_hook", "register_module_forward_pre_hook",
                     "register_module_full_backward_hook", "register_module_full_backward_pre_hook"):
        handle = getattr(torch.nn.modules.module, register)(lambda *args: None)
        assert compat.runs_hooks(model[0])
        handle.remove()
    assert not compat.runs_hooks(model)


def test_known_fakes_are_taken_as_they_are():
    # make_fx asks the inputs' fake mode for a fake of each input (`from_tensor`); one the mode
    # knows is given back as it is, where any other is made again field by field
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = compat.FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(2, 3), torch.empty(4)]
    compat.known_fakes(mode, fakes[:1])
    assert mode.from_tensor(fakes[0]) is fakes[0]
    assert mode.from_tensor(fakes[1]) is not fakes[1]
    gm = make_fx(lambda a, b: (a * 2, b + 1), tracing_mode="fake")(*fakes)
    assert [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"] == [(2, 3), (4,)]


def test_lstm_cells_is_torchs_lstm_as_its_decomposition_computes_it_off_the_cpu():
    torch.manual_seed(0)
    module = torch.nn.LSTM(6, 4, num_layers=2, bidirectional=True, batch_first=True)
    x, state = torch.randn(3, 5, 6), (torch.randn(4, 3, 4), torch.randn(4, 3, 4))
    args = (x, state, module._flat_weights, True, 2, 0.0, False, True, True)
    for got, want in zip(compat.lstm_cells(*args), torch.lstm(*args)):
        torch.testing.assert_close(got, want)


@torch.library.custom_op("ndfunc_compat_tests::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


torch.library.register_autograd("ndfunc_compat_tests::double", lambda ctx, g: g * 2)


class _OldStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def test_registered_gradient_has_setup_context_func_transforms_active():
    schema, backward, setup = compat.registered_gradient("ndfunc_compat_tests::double")
    assert [a.name for a in schema.arguments] == ["x"] and setup is None
    assert torch.equal(backward(None, torch.ones(2)), torch.full((2,), 2.0))
    assert compat.registered_gradient("aten::add") is None
    assert not compat.has_setup_context(_OldStyle)
    assert compat.has_setup_context(torch.autograd.Function) is False  # (the base class defines none)
    seen = []
    torch.func.grad(lambda x: seen.append(compat.func_transforms_active()) or x.sum())(torch.ones(2))
    assert seen == [True] and not compat.func_transforms_active()


def test_traced_constant_is_what_the_trace_knows_of_a_value_under_torch_func_too():
    seen = []

    def f(x):
        seen.append((compat.traced_constant(torch.tensor(2.5)), compat.traced_constant(x)))
        return x * 2

    with nf.simulate(2):
        nf.jit(nf.grad(lambda x: f(x).sum()), mesh=nf.make_mesh(dp=2), in_shardings=nf.sharding.P("dp"))(torch.ones(4))
    (literal, traced), = seen
    assert torch.equal(literal, torch.tensor(2.5)) and traced is None
