"""ndfunc._src.autodiff against torch.autograd on the same functions, and JAX's return conventions."""

import optree
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ndfunc._src.autodiff import grad, value_and_grad, vmap

# grad and autograd run the same backward kernels in the same order: exact in float64.
EXACT = {"rtol": 0, "atol": 0}


def mlp_params() -> dict:
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    return {"layers": [{"w": r(4, 8), "b": r(8)}, {"w": r(8, 3), "b": r(3)}], "scale": r(())}


def batch() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(5, 4, generator=gen, dtype=torch.float64),
            "y": torch.randn(5, 3, generator=gen, dtype=torch.float64)}


def mlp_loss(params, batch):
    h = batch["x"]
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"] + layer["b"]
        if i < len(params["layers"]) - 1:
            h = torch.tanh(h)
    return ((params["scale"] * h - batch["y"]) ** 2).mean()


def autograd_grads(fn, *trees):
    """The reference: torch.autograd.grad on leaves that require grad."""
    leaves = [[x.detach().requires_grad_() for x in optree.tree_leaves(t)] for t in trees]
    rebuilt = [optree.tree_unflatten(optree.tree_structure(t), l) for t, l in zip(trees, leaves)]
    value = fn(*rebuilt)
    flat = torch.autograd.grad(value, [x for l in leaves for x in l])
    out, i = [], 0
    for t, l in zip(trees, leaves):
        out.append(optree.tree_unflatten(optree.tree_structure(t), list(flat[i:i + len(l)])))
        i += len(l)
    return value.detach(), out


def assert_trees_equal(a, b, **tol):
    assert optree.tree_structure(a) == optree.tree_structure(b)
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        torch.testing.assert_close(x, y, **(tol or EXACT))


def test_grad_of_pytree_params_matches_autograd():
    params, b = mlp_params(), batch()
    _, (expected, _) = autograd_grads(mlp_loss, params, b)
    assert_trees_equal(grad(mlp_loss)(params, b), expected)


def test_value_and_grad_returns_value_then_grads():
    params, b = mlp_params(), batch()
    value, (expected, _) = autograd_grads(mlp_loss, params, b)
    out = value_and_grad(mlp_loss)(params, b)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out[0], value, **EXACT)
    assert_trees_equal(out[1], expected)


def test_argnums_tuple_and_negative():
    params, b = mlp_params(), batch()
    _, expected = autograd_grads(mlp_loss, params, b)
    g_params, g_batch = grad(mlp_loss, argnums=(0, 1))(params, b)
    assert_trees_equal((g_params, g_batch), tuple(expected))
    assert_trees_equal(grad(mlp_loss, argnums=-1)(params, b), expected[1])
    # A one-element tuple gives a one-element tuple, as in JAX.
    (only,) = grad(mlp_loss, argnums=(1,))(params, b)
    assert_trees_equal(only, expected[1])


def test_has_aux_conventions():
    def loss_with_aux(params, batch):
        loss = mlp_loss(params, batch)
        return loss, {"loss_x2": 2 * loss, "num_examples": batch["x"].shape[0], "tag": "mlp"}

    params, b = mlp_params(), batch()
    value, (expected, _) = autograd_grads(mlp_loss, params, b)

    (v, aux), grads = value_and_grad(loss_with_aux, has_aux=True)(params, b)
    torch.testing.assert_close(v, value, **EXACT)
    torch.testing.assert_close(aux["loss_x2"], 2 * value, **EXACT)
    assert aux["num_examples"] == 5 and aux["tag"] == "mlp"  # non-tensor aux passes through
    assert_trees_equal(grads, expected)

    grads, aux = grad(loss_with_aux, has_aux=True)(params, b)
    assert_trees_equal(grads, expected)
    assert set(aux) == {"loss_x2", "num_examples", "tag"}


def test_keyword_arguments_pass_through_undifferentiated():
    def loss(w, *, power):
        return (w**power).sum()

    torch.testing.assert_close(grad(loss)(torch.tensor([1.0, 2.0]), power=3), torch.tensor([3.0, 12.0]))


def test_non_scalar_output_says_shape_and_what_to_do():
    with pytest.raises(ValueError, match=r"scalar loss \(a tensor of shape \(\)\), but it returned a "
                                         r"tensor of shape \(5, 3\); reduce it first"):
        grad(lambda p, b: b["x"] @ p["layers"][0]["w"][:, :3])(mlp_params(), batch())


def test_other_user_errors():
    w = torch.ones(2)
    with pytest.raises(TypeError, match="return a scalar loss tensor, but it returned a float"):
        grad(lambda w: 1.0)(w)
    with pytest.raises(TypeError, match="floating-point loss, but it returned a torch.int64"):
        grad(lambda w: (w > 0).sum())(w)
    with pytest.raises(TypeError, match=r"has_aux=True expects <lambda> to return a pair \(loss, aux\)"):
        grad(lambda w: w.sum(), has_aux=True)(w)
    with pytest.raises(TypeError, match=r"argument 0 at 'steps' is a torch.int64 tensor"):
        grad(lambda p: p["w"].sum())({"w": w, "steps": torch.tensor(3)})
    with pytest.raises(TypeError, match=r"argument 1 at 'lr' is a float"):
        grad(lambda w, h: w.sum() * h["lr"], argnums=1)(w, {"lr": 0.1})
    with pytest.raises(ValueError, match="argument 2, but the function was called with 2 positional"):
        grad(lambda a, b: a.sum(), argnums=2)(w, w)
    with pytest.raises(TypeError, match="argnums must be an int or a non-empty tuple of ints"):
        grad(lambda w: w.sum(), argnums=[0])
    with pytest.raises(ValueError, match="names an argument twice"):
        grad(lambda w: w.sum(), argnums=(0, 0))
    # a model with every parameter frozen: nf.nn.functional's params are {} (torch.optim refuses an empty list)
    with pytest.raises(ValueError, match=r"with respect to argument 0 \(a dict\), which holds no tensor: nothing "
                                         r"would train \(jax.grad would return the empty tree; torch.optim refuses"):
        grad(lambda p, x: x.sum())({}, w)
    with pytest.raises(ValueError, match=r"arguments \(0, 1\) \(None, a tuple\), which hold no tensor"):
        grad(lambda p, q, x: x.sum(), argnums=(0, 1))(None, ({}, {}), w)


def test_nothing_is_modified_in_place():
    params, b = mlp_params(), batch()
    clones = optree.tree_map(torch.clone, (params, b))
    versions = [x._version for x in optree.tree_leaves((params, b))]
    value_and_grad(mlp_loss, argnums=(0, 1))(params, b)
    assert [x._version for x in optree.tree_leaves((params, b))] == versions
    assert_trees_equal((params, b), clones)


def test_value_and_grad_traces_to_one_graph_without_autograd():
    params, b = mlp_params(), batch()
    gm = make_fx(value_and_grad(mlp_loss), tracing_mode="fake")(params, b)

    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert all(isinstance(t, torch._ops.OpOverload) for t in targets), set(targets)
    names = {t._schema.name for t in targets}
    assert "aten::tanh_backward" in names  # the backward is in the graph, as plain aten ops
    assert not {"aten::item", "aten::_local_scalar_dense"} & names
    # No autograd left: the graph computes the gradient with grad mode off.
    with torch.no_grad():
        value, grads = gm(params, b)
    expected_value, (expected, _) = autograd_grads(mlp_loss, params, b)
    assert not value.requires_grad
    torch.testing.assert_close(value, expected_value, **EXACT)
    assert_trees_equal(grads, expected, rtol=1e-12, atol=1e-12)


def test_vmap_matches_a_loop():
    xs, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    f = lambda x, w: torch.tanh(x @ w)
    loop = torch.stack([f(x, w) for x in xs])
    torch.testing.assert_close(vmap(f, in_axes=(0, None))(xs, w), loop, **EXACT)
    torch.testing.assert_close(vmap(f, in_axes=(0, None), out_axes=1)(xs, w), loop.T, **EXACT)
    torch.testing.assert_close(vmap(f, in_axes=(1, None))(xs.T, w), loop, **EXACT)
    # Trees: in_axes entries are prefixes of their argument, as in JAX.
    g = lambda d: d["a"] * d["b"].sum()
    d = {"a": torch.randn(6, 2), "b": torch.randn(5)}
    torch.testing.assert_close(vmap(g, in_axes=({"a": 0, "b": None},))(d),
                               torch.stack([g({"a": a, "b": d["b"]}) for a in d["a"]]), **EXACT)
    # Keyword arguments map over dim 0, as in JAX.
    h = lambda x, *, y: x * y
    torch.testing.assert_close(vmap(h, in_axes=None)(torch.tensor(2.0), y=torch.arange(3.0)),
                               torch.tensor([0.0, 2.0, 4.0]))


def test_per_example_gradients_compose_vmap_and_grad():
    params, b = mlp_params(), batch()
    one = lambda p, x, y: mlp_loss(p, {"x": x[None], "y": y[None]})
    per_example = vmap(grad(one), in_axes=(None, 0, 0))(params, b["x"], b["y"])
    for i in range(b["x"].shape[0]):
        _, (expected, _, _) = autograd_grads(one, params, b["x"][i], b["y"][i])
        assert_trees_equal(optree.tree_map(lambda g, i=i: g[i], per_example), expected,
                           rtol=1e-12, atol=1e-12)


def test_vmap_errors():
    with pytest.raises(TypeError, match="in_axes must be an int, None, or a tuple .* got list"):
        vmap(lambda x: x, in_axes=[0])
    with pytest.raises(ValueError, match="in_axes has 1 entries, \\(0,\\), but <lambda> was called with "
                                         "2 positional arguments"):
        vmap(lambda x, y: x + y, in_axes=(0,))(torch.ones(2), torch.ones(2))


def test_argnums_naming_one_argument_twice_through_a_negative_index():
    from ndfunc._src.autodiff import grad

    with pytest.raises(ValueError, match=r"argnums \(0, -2\) names an argument twice"):
        grad(lambda a, b: (a * b).sum(), argnums=(0, -2))(torch.ones(2), torch.ones(2))


def test_what_torch_func_refuses_is_said_with_what_to_write_instead():
    # BatchNorm in training mode writes its running statistics: a buffer closed over is refused by
    # torch.func, one passed as an argument is not (and so the error names the form that works)
    import ndfunc as nf

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    params, buffers, apply = nf.nn.functional(model)
    x = torch.randn(8, 4)
    with pytest.raises(RuntimeError, match=r"^nf\.value_and_grad: <lambda> writes in place into a tensor it closes "
                                           r"over \(a module's buffer: BatchNorm's running statistics in training "
                                           r"mode\)\. Pass such tensors as an argument"):
        value_and_grad(lambda p: apply(p, buffers, x).square().mean())(params)
    loss, grads = value_and_grad(lambda p, b: apply(p, b, x).square().mean())(params, buffers)
    assert grads.keys() == params.keys() and buffers["1.num_batches_tracked"] == 1
    w = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match=r"^nf\.value_and_grad: <lambda> uses saved-tensor hooks \(torch\.autograd"
                                           r"\.graph\.saved_tensors_hooks, save_on_cpu\), which torch\.func cannot "
                                           r"differentiate\. To recompute activations in backward mark the function "
                                           r"with nf\.remat\(fn\)"):
        with torch.autograd.graph.save_on_cpu():
            value_and_grad(lambda w: (x @ w).tanh().sum())(w)


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_utils_checkpoint_is_differentiated_as_nf_remat(reentrant):
    # torch.func cannot differentiate checkpoint's own machinery; inside nf.value_and_grad a
    # checkpointed call is an nf.remat region: eagerly the plain gradient, under nf.jit recomputed
    import ndfunc as nf
    from ndfunc.sharding import P

    g = torch.Generator().manual_seed(0)
    w1, w2, x = torch.randn(16, 64, generator=g), torch.randn(64, 16, generator=g), torch.randn(8, 16, generator=g)

    def block(a, w1, w2):
        return torch.tanh(torch.tanh(a @ w1) @ w2)

    def loss(w, x, checkpointed):
        h = x
        for _ in range(3):
            h = (torch.utils.checkpoint.checkpoint(block, h, *w, use_reentrant=reentrant) if checkpointed
                 else block(h, *w))
        return h.square().mean()

    want = torch.func.grad_and_value(loss)((w1, w2), x, False)
    assert_close = torch.testing.assert_close
    got = nf.value_and_grad(loss)((w1, w2), x, True)
    assert_close(got[0], want[1])
    assert_close(got[1], want[0])
    kept = []
    for checkpointed in (False, True):
        with nf.simulate(2):
            step = nf.jit(nf.value_and_grad(lambda w, x: loss(w, x, checkpointed)), mesh=nf.make_mesh(dp=2),
                          in_shardings=(P(), P("dp")), out_shardings=(P(), P()))
            got = nf.device_get(step((w1, w2), x))
            kept.append(step.lower((w1, w2), x).memory_analysis().breakdown.activations)
        assert_close(got[0], want[1])
        assert_close(got[1], want[0])
    assert kept[1] < kept[0] / 2  # each block's inner activations recomputed, not kept

