"""The tracer: one functional graph over global shapes, checked against running the step eagerly."""

import re

import pytest
import torch

import ndfunc as nf
from models import llama
from ndfunc import random
from ndfunc._src.constraints import sharding_constraint_op
from ndfunc._src.trace import trace
from ndfunc.sharding import NamedSharding, P, RankError, logical_to_mesh

CFG = llama.LlamaConfig.tiny()
OPT = nf.optim.adamw(1e-3, weight_decay=0.1)


def step(params, opt_state, batch, cfg):
    loss, grads = nf.value_and_grad(llama.loss)(params, batch, cfg)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return nf.optim.apply_updates(params, updates), opt_state, loss


def inputs():
    params = llama.init(CFG, random.key(0))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return params, OPT.init(params), {"tokens": tokens, "targets": tokens.roll(-1, 1)}


def leaves(tree):
    return [x for _, x in nf.tree.tree_flatten_with_path(tree)[0]]


def targets(traced):
    return [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]


def test_train_step_is_one_graph_equal_to_the_eager_step():
    params, state, batch = inputs()
    traced = trace(step, (params, state, batch, CFG), static_argnums=(3,))
    assert len(traced.in_specs) == len(leaves((params, state, batch)))
    assert traced.input_paths[0] == "0.embed" and traced.in_specs[0].shape == (256, 64)
    got, expected = traced(params, state, batch, CFG), step(params, state, batch, CFG)
    # The same aten ops in the same order as eager execution: equal up to float32 reassociation
    # in kernels that may pick another blocking (none did here, but it is not promised).
    for a, b in zip(leaves(got), leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_attention_stays_one_node_and_no_autograd_is_left():
    traced = trace(step, (*inputs(), CFG), static_argnums=(3,))
    ops = targets(traced)
    assert ops.count("ndfunc.attention.default") == CFG.n_layers
    assert ops.count("ndfunc.attention_backward.default") == CFG.n_layers
    assert not [t for t in ops if "scaled_dot_product" in t]  # torch's kernels come in at lowering
    assert not [t for t in ops if "_local_scalar_dense" in t or "autograd" in t]


def test_dtensor_inputs_are_traced_at_their_global_shape():
    params, state, batch = inputs()
    config = nf.ParallelConfig(dp_shard_size=2, tp_size=2)
    with nf.simulate(4):
        mesh = config.build_mesh()
        specs = logical_to_mesh(llama.param_axes(CFG), config.rules)
        sharded = nf.device_put(params, nf.tree.tree_map_with_path(lambda p, s: NamedSharding(mesh, s), specs))
        traced = trace(llama.loss, (sharded, batch, CFG), static_argnums=(2,))
    assert traced.in_specs[0].shape == (256, 64)  # embed, whole, though each rank holds a quarter
    torch.testing.assert_close(traced(params, batch, CFG), llama.loss(params, batch, CFG), rtol=1e-6, atol=1e-7)


def test_sharding_constraints_are_nodes_and_their_gradients_are_constrained_too():
    def loss(w, x):
        h = nf.with_sharding_constraint(x @ w, P("dp", ("tp", "cp")))
        return (h * h).sum()

    w, x = torch.randn(8, 4), torch.randn(6, 8)
    traced = trace(lambda w, x: nf.value_and_grad(loss)(w, x), (w, x))
    assert [spec for _, spec in traced.constraints()] == [P("dp", ("tp", "cp"))] * 2  # forward and its transpose
    assert sum(1 for n in traced.graph.nodes if n.target is sharding_constraint_op) == 2
    value, grad = traced(w, x)
    expected = torch.func.grad(lambda w: ((x @ w) ** 2).sum())(w)
    torch.testing.assert_close(grad, expected)


def test_sharding_constraint_eagerly():
    x = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(nf.with_sharding_constraint(x, P("dp")), x)  # a plain tensor is global already
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        d = nf.device_put(x, NamedSharding(mesh, P("dp")))
        y = nf.with_sharding_constraint(d, NamedSharding(mesh, P(None, "tp")))
        assert nf.sharding_of(y).spec == P(None, "tp") and torch.equal(nf.device_get(y), x)
    with pytest.raises(RankError, match=r"with_sharding_constraint got P\('dp', None, 'tp'\) for a value of rank 2"):
        nf.with_sharding_constraint(x, P("dp", None, "tp"))
    with pytest.raises(TypeError, match="with_sharding_constraint expects a PartitionSpec or NamedSharding, got 'dp'"):
        nf.with_sharding_constraint(x, "dp")


def test_keywords_and_static_arguments():
    traced = trace(lambda x, scale, *, bias: x * scale + bias, (torch.ones(3), 2.0), {"bias": torch.ones(3)},
                   static_argnums=(1,))
    assert traced.input_paths == ("0", "bias")
    assert torch.equal(traced(torch.ones(3), 2.0, bias=torch.zeros(3)), torch.full((3,), 2.0))


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"argument leaf '1.lr' is a float \(0.1\); traced arguments are tensors. "
                                        r"Make it a tensor, or mark its argument static"):
        trace(lambda x, cfg: x * cfg["lr"], (torch.ones(2), {"lr": 0.1}))
    with pytest.raises(TypeError, match=r"returned a str \('done'\) at output leaf 1; a traced step returns tensors only"):
        trace(lambda x: (x, "done"), (torch.ones(2),))


def test_init_traces_to_one_random_node_per_matrix_and_one_hash_per_key():
    from ndfunc.random._op import random_block_op, threefry_op

    key = random.key(5)
    traced = trace(llama.init, (CFG, key), static_argnums=(0,))
    samplers = [n for n in traced.graph.nodes if n.target is random_block_op]
    matrices = [x for x in leaves(llama.param_shapes(CFG)) if len(x) > 1]
    assert len(samplers) == len(matrices)
    # each matrix's key is folded in by one node, not threefry's ~150 ops
    assert sum(n.target is threefry_op for n in traced.graph.nodes) == len(matrices)
    assert sum(n.op == "call_function" for n in traced.graph.nodes) < 16 * len(matrices)
    for a, b in zip(leaves(traced(CFG, key)), leaves(llama.init(CFG, key))):
        assert torch.equal(a, b)


def test_a_tensor_made_under_simulate_cannot_be_closed_over():
    with nf.simulate(4):
        per_rank = torch.randn(4)
        with pytest.raises(TypeError, match=r"^<lambda> closes over a tensor made under nf\.simulate: it holds a "
                           r"value per simulated rank, and a tensor a step closes over is a constant, the same on "
                           r"every rank\. Pass it to the step as an argument \(with the sharding its values have\)\.$"):
            trace(lambda x: x * per_rank, (torch.randn(4),))


def _embedded(table, x):
    return torch.nn.functional.embedding(x, table).sum()


def test_a_sharded_tensor_cannot_be_closed_over_and_the_error_says_to_pass_it():
    # a frozen base laid out by nf.device_put, closed over: DTensor's own refusal was raw torch
    with nf.simulate(2):
        table = nf.device_put(torch.randn(8, 4), nf.sharding.NamedSharding(nf.make_mesh(dp=2), nf.sharding.P("dp")))
        with pytest.raises(TypeError, match=re.escape(
                f"<lambda> closes over a sharded tensor (a DTensor, as nf.device_put makes) at {__file__}:"
                f"{_embedded.__code__.co_firstlineno + 1} (return torch.nn.functional.embedding(x, table).sum()): a "
                f"tensor a step closes over is a constant of the program, whole on every rank. Pass it to the step as "
                f"an argument; its sharding comes with it")):
            trace(lambda x: _embedded(table, x), (torch.zeros(3, dtype=torch.long),))


def test_a_step_that_writes_into_a_tensor_it_closes_over_is_refused():
    scale = torch.ones(4)
    with pytest.raises(TypeError, match=r"^<lambda> writes in place \(aten\.mul_\.Tensor\) into a tensor it closes "
                       r"over \(shape \[4\]\); tracing has applied that write to it once\. A traced step is a "
                       r"function of its arguments: pass the tensor as an argument and return its new value "
                       r"\(donate_argnums lets the result reuse its memory\)\.$"):
        trace(lambda x: x * scale.mul_(2), (torch.randn(4),))
