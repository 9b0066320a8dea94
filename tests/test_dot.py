"""`ndfunc::dot`: an einsum, `@` or `F.linear` of a batch of rows and a weight traced as one
contraction that keeps the rows' leading dims, against torch's own on one device."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import ndfunc as nf
from ndfunc._src.dot import dot, dot_leading_op, dot_op
from ndfunc._src.partition.planning.flops import node_flops
from ndfunc._src.trace import trace
from ndfunc.sharding import P

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 sums over each rank's block, added in another order


def traced_ops(fn, *args) -> set:
    return {n.target for n in trace(fn, args).graph.nodes if n.op == "call_function"}


def _einsum(equation):
    return lambda x, w: torch.einsum(equation, x, w)


# (what, x's shape, w's shape)
CASES = [
    (_einsum("bld,dhk->blhk"), (2, 8, 4), (4, 3, 2)),  # a projection to heads
    (_einsum("bhlk,hkd->bld"), (2, 3, 8, 2), (3, 2, 4)),  # from heads: x's contracted dims moved last
    (_einsum("...d,df->...f"), (2, 8, 4), (4, 6)),
    (_einsum("bld,df->bfl"), (2, 8, 4), (4, 6)),  # the result's dims in another order
    (_einsum("bld,df"), (2, 8, 4), (4, 6)),  # implicit: (b, f, l)
    (lambda x, w: torch.einsum("bld,dhk->blhk", [x, w]), (2, 8, 4), (4, 3, 2)),
    (lambda x, w: x @ w, (2, 8, 4), (4, 6)),
    (lambda x, w: torch.matmul(x, w), (3, 2, 8, 4), (4, 6)),
    (lambda x, w: x.matmul(w), (2, 8, 4), (4, 6)),
    (lambda x, w: F.linear(x, w), (2, 8, 4), (6, 4)),
    (lambda x, w: F.linear(x, w, w[:, 0].exp()), (2, 8, 4), (6, 4)),  # with a bias, added inside the product
    (lambda x, w: F.linear(x.transpose(0, 1), w, w[:, 0].exp()), (8, 2, 4), (6, 4)),  # ... after it
]
IDS = ["heads", "from-heads", "ellipsis", "reordered", "implicit", "operand-list", "at", "matmul", "method",
       "linear", "linear-bias", "linear-bias-strided"]


@pytest.mark.parametrize("fn, x_shape, w_shape", CASES, ids=IDS)
def test_a_contraction_of_rows_and_a_weight_is_one_dot_and_its_gradients_two(fn, x_shape, w_shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(x_shape, generator=g), torch.randn(w_shape, generator=g)
    loss = lambda x, w: fn(x, w).sin().sum()  # noqa: E731
    step = nf.value_and_grad(loss, argnums=(0, 1))
    traced = trace(step, (x, w))
    ops = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert {dot_op, dot_leading_op} <= ops
    assert not ops & {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}
    for got, want in zip(traced(x, w), step(x, w)):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("fn, x_shape, w_shape", [
    (_einsum("bij,bjk->bik"), (2, 3, 4), (2, 4, 5)),  # a dim both keep: a batched matmul
    (_einsum("bld,d->bl"), (2, 3, 4), (4,)),  # nothing of w's kept
    (_einsum("bld,dk->bk"), (2, 3, 4), (4, 5)),  # l summed out of x alone
    (_einsum("bii,ik->bk"), (2, 4, 4), (4, 5)),  # a diagonal
    (lambda x, w: x @ w, (8, 4), (4, 6)),  # rows already one dim: mm as it is
    (lambda x, w: F.linear(x, w), (8, 4), (6, 4)),
], ids=["batched", "vector", "summed-out", "diagonal", "2d-at", "2d-linear"])
def test_other_products_are_torchs_own(fn, x_shape, w_shape):
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    traced = trace(fn, (x, w))
    assert dot_op not in {n.target for n in traced.graph.nodes}
    torch.testing.assert_close(traced(x, w), fn(x, w))


def test_operands_of_two_dtypes_are_refused_as_torch_refuses_them():
    with pytest.raises(TypeError, match="multiplies float32 and float64"):
        trace(lambda x, w: x @ w, (torch.randn(2, 8, 4), torch.randn(4, 6, dtype=torch.float64)))


def test_a_dot_under_vmap_or_autocast_is_torchs_own():
    x, w = torch.randn(3, 2, 8, 4), torch.randn(4, 6)
    batched = lambda x, w: torch.vmap(lambda xi: xi @ w)(x)  # noqa: E731 (no batching rule for the op)
    assert dot_op not in traced_ops(batched, x, w)

    def cast(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return x @ w
    assert dot_op not in traced_ops(cast, x, w)


def test_dot_and_its_gradient_differentiate_twice():
    # eager, float64: each op's gradient is the other op (or itself), so a gradient of a gradient
    # (plain autograd inside a step) is a product too
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 5, 2, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: dot(x, w, 1), (x, w))
    assert torch.autograd.gradgradcheck(lambda x, w: dot(x, w, 1), (x, w))
    y = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    leading = lambda x, y: dot_leading_op(x, y, 2)  # noqa: E731
    torch.testing.assert_close(leading(x, y), torch.einsum("bld,blk->dk", x, y))


def test_a_dot_counts_the_flops_of_its_matmul():
    x, w = torch.randn(2, 8, 4), torch.randn(4, 3, 2)
    nodes = [n for n in trace(nf.grad(lambda x, w: torch.einsum("bld,dhk->blhk", x, w).sum(), argnums=(0, 1)),
                              (x, w)).graph.nodes if n.target in (dot_op, dot_leading_op)]
    assert [node_flops(n) for n in nodes] == [2 * 16 * 4 * 6] * 3  # forward, and each gradient


def test_batch_and_sequence_split_over_two_axes_stay_split_through_linear_layers():
    # two sequences a rank, the batch over dp_shard and the sequence over cp: torch's flatten of
    # (batch, sequence) left each rank's tokens strided, and the plan moved them over cp first (an
    # all-to-all here, gathers elsewhere). As dots they stay split: only the weights' gradients and
    # the loss are reduced
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 512, 8, generator=g)  # (tokens well above the weights: else gathering them pays)
    params = {"wq": torch.randn(8, 2, 4, generator=g) / 3, "wo": torch.randn(2, 4, 8, generator=g) / 3,
              "w1": torch.randn(12, 8, generator=g) / 3, "b1": torch.randn(12, generator=g)}

    def loss(params, x):
        h = torch.einsum("bld,dhk->blhk", x, params["wq"]).tanh()
        y = torch.einsum("blhk,hkd->bld", h, params["wo"])
        return F.linear(y, params["w1"], params["b1"]).square().mean()

    step = nf.value_and_grad(loss)
    expected = step(params, x)
    with nf.simulate(4):
        jitted = nf.jit(step, mesh=nf.make_mesh(dp_shard=2, cp=2), in_shardings=(P(), P("dp_shard", "cp")),
                        out_shardings=(P(), P()))
        lowered = jitted.lower(params, x)
        got = jitted(params, x)
    for a, b in zip(nf.device_get(got)[1].values(), expected[1].values()):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(nf.device_get(got)[0], expected[0], **TOL)
    assert set(lowered.cost_analysis()["collectives"]) == {"all_reduce"}


@pytest.mark.parametrize("x_spec, w_spec, bias", [(P("tp"), P(), (Replicate(),)),  # rows split: each adds it whole
                                                   (P(), P("tp"), (Shard(0),))])  # features split: the bias too
def test_a_linear_layers_bias_is_laid_out_as_its_products_features(x_spec, w_spec, bias):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 64, 16, generator=g), torch.randn(512, 16, generator=g), torch.randn(512, generator=g)
    step = nf.value_and_grad(lambda x, w, b: F.linear(x, w, b).tanh().sum(), argnums=(0, 1, 2))
    expected = step(x, w, b)
    with nf.simulate(2):
        jitted = nf.jit(step, mesh=nf.make_mesh(tp=2), in_shardings=(x_spec, w_spec, P()))
        program = jitted.lower(x, w, b).program
        (forward,) = [n for n in program.traced.graph.nodes if n.target is dot_op and len(n.args) > 3]
        got = nf.device_get(jitted(x, w, b))
    assert program.plan.strategy[forward].ins[2] == bias
    torch.testing.assert_close(got[0], expected[0], **TOL)
    for a, e in zip(got[1], expected[1]):
        torch.testing.assert_close(a, e, **TOL)


def test_save_dots_keeps_a_dot_and_full_remat_makes_it_again():
    # nf.remat's policy reads the op registry: a `dot` is a product, kept by 'save_dots'
    g = torch.Generator().manual_seed(0)
    ws, x = [torch.randn(32, 32, generator=g) / 6 for _ in range(2)], torch.randn(2, 64, 32, generator=g)

    def loss(policy):
        def layer(w, h):
            return torch.tanh(torch.tanh(h @ w).sin() @ w)
        block = nf.remat(layer, policy) if policy else layer

        def f(ws, x):
            for w in ws:
                x = block(w, x)
            return x.square().sum()
        return f

    flops = {}
    for policy in (None, "full", "save_dots"):
        lowered = nf.jit(nf.grad(loss(policy))).lower(ws, x)
        assert dot_op in {n.target for n in lowered.program.traced.graph.nodes}
        flops[policy] = lowered.cost_analysis()["flops"]
    assert flops["full"] - flops[None] == 2 * 2 * (2 * 128 * 32 * 32)  # each layer's two products again
    assert flops["save_dots"] == flops[None]
