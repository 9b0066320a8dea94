"""The partitioner on the canonical programs: collective counts and bytes of the lowered program
equal the analytic optimum, and the collectives that actually run are those (counted by a dispatch
mode during the run, which also checks that no DTensor reaches an op)."""

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import ndfunc as nf
from ndfunc._src.partition.backends.cpu_kernels import index_put_in_order
from ndfunc.sharding import P

TOL = dict(rtol=1e-5, atol=1e-5)
D, F, B = 16, 32, 512  # tokens per rank well above the hidden size, as in training
C10D = {"all_reduce": torch.ops._c10d_functional.all_reduce.default,
        "all_gather": torch.ops._c10d_functional.all_gather_into_tensor.default,
        "reduce_scatter": torch.ops._c10d_functional.reduce_scatter_tensor.default,
        "all_to_all": torch.ops._c10d_functional.all_to_all_single.default}


class CountRun(TorchDispatchMode):
    """Counts the collectives that run; fails on any op that receives a DTensor."""

    def __init__(self):
        super().__init__()
        self.counts = {k: 0 for k in C10D}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for x in optree.tree_leaves((args, kwargs or {})):
            assert not isinstance(x, DTensor), f"{func} got a DTensor inside a compiled step"
        for kind, op in C10D.items():
            if func is op:
                self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


def mlp_loss(p, x, y):
    h = torch.relu(x @ p["w1"])
    return ((h @ p["w2"] - y) ** 2).mean()


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {"w1": torch.randn(D, F, generator=g) / 4, "w2": torch.randn(F, D, generator=g) / 4}
    return params, torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)


def adam_step():
    opt = nf.optim.adam(1e-2)

    def step(p, s, x, y):
        loss, g = nf.value_and_grad(mlp_loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return nf.optim.apply_updates(p, u), s, loss

    return opt, step


def adam_case(seed=0):
    """The MLP adam step, its arguments and its unsharded results (outside any simulation)."""
    params, x, y = data(seed)
    opt, step = adam_step()
    state = opt.init(params)
    return step, (params, state, x, y), step(params, state, x, y)


def jit_adam(mesh, specs, batch_spec, case):
    """(jitted MLP adam step, its arguments, the unsharded results)."""
    step, args, expected = case
    sspecs = nf.optim.state_shardings(args[1], specs)
    jitted = nf.jit(step, mesh=mesh, in_shardings=(specs, sspecs, batch_spec, batch_spec),
                    out_shardings=(specs, sspecs, P()))
    return jitted, args, expected


def run_counted(jitted, *args):
    with CountRun() as mode:
        out = jitted(*args)
    return out, {k: v for k, v in mode.counts.items() if v}


def program_counts(lowered) -> dict:
    return lowered.cost_analysis()["collectives"]


def assert_same(got, expected, **tol):
    for a, b in zip(optree.tree_leaves(nf.device_get(got)), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, **(tol or TOL))


def test_dp_step_all_reduces_each_gradient_once_and_nothing_else():
    case = adam_case()
    with nf.simulate(4):
        jitted, args, expected = jit_adam(nf.make_mesh(dp=4), {"w1": P(), "w2": P()}, P("dp"), case)
        lowered = jitted.lower(*args)
        costs = lowered.cost_analysis()
        # each gradient all-reduced once - both in one bucket - and the loss (a scalar): no
        # parameter, no activation
        assert costs["collectives"] == {"all_reduce": 2}
        assert "all_reduce over ('dp',): 4096 B, 6144 B sent per rank (a bucket of 2)" in lowered.as_text()
        grad_bytes = (D * F + F * D) * 4
        assert costs["comm_bytes"]["total"] == pytest.approx(2 * 3 / 4 * (grad_bytes + 4))
        out, ran = run_counted(jitted, *args)
        assert ran == {"all_reduce": 2}
        assert_same(out, expected)


def test_megatron_mlp_all_reduces_the_activation_once_forward_and_once_backward():
    params, x, y = data()

    def grads(p, x, y):  # the gradient reaches x too: the backward all-reduce of a layer's input
        return nf.grad(mlp_loss, argnums=(0, 1))(p, x, y)

    expected = grads(params, x, y)
    with nf.simulate(4):
        mesh = nf.make_mesh(tp=4)
        specs = {"w1": P(None, "tp"), "w2": P("tp", None)}
        jitted = nf.jit(grads, mesh=mesh, in_shardings=(specs, P(), P()), out_shardings=(specs, P()))
        lowered = jitted.lower(params, x, y)
        text = lowered.as_text()
        costs = lowered.cost_analysis()
        assert costs["collectives"] == {"all_reduce": 2}
        assert text.count("all_reduce over ('tp',): 32768 B") == 2  # each of B x D float32
        out, ran = run_counted(jitted, params, x, y)
        assert ran == {"all_reduce": 2}
        assert_same(out, expected)


def test_a_sequence_split_input_read_by_three_einsums_is_gathered_once():
    # Megatron's sequence parallelism: a layer's input lies split over tp by the sequence, and q, k
    # and v (column-split weights) each read it whole. Each einsum views it on its own (a permute
    # apiece): the view, its gather and what lays the gathered block out are made once (before:
    # three gathers), and the backward reads that block as the einsums saved it
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, D, generator=g)
    ws = [torch.randn(D, F, generator=g) / 4 for _ in range(3)]

    def qkv(x, ws):
        x = nf.with_sharding_constraint(x, P(None, "tp"))
        q, k, v = (torch.einsum("bld,dk->blk", x, w) for w in ws)
        return (q * k * v).square().mean()

    step = nf.value_and_grad(qkv, argnums=(0, 1))
    expected = step(x, ws)
    with nf.simulate(4):
        jitted = nf.jit(step, mesh=nf.make_mesh(tp=4), in_shardings=(P(None, "tp"), [P(None, "tp")] * 3),
                        out_shardings=(P(), (P(None, "tp"), [P(None, "tp")] * 3)))
        counts = jitted.lower(x, ws).cost_analysis()["collectives"]
        out, ran = run_counted(jitted, x, ws)
        assert_same(out, expected)
    # x gathered; the loss's sum all-reduced; x's gradient, a sum over the three, reduce-scattered
    assert counts == ran == {"all_gather": 1, "all_reduce": 1, "reduce_scatter": 1}


# (in, out, how many all-to-alls: one for each axis that moves its split alone, or for each of
# several that move in turn, each the innermost split of both its dims when it moves; else the
# splits are gathered and sliced)
MOVES = [
    ({"dp": 4}, P("dp"), P(None, "dp"), 1),
    ({"dp": 4}, P(None, None, "dp"), P("dp"), 1),
    ({"dp": 2, "tp": 2}, P("dp", None, "tp"), P(None, "dp", "tp"), 1),
    ({"dp": 2, "tp": 2}, P("dp", "tp"), P(None, "tp", "dp"), 1),
    ({"dp": 2, "tp": 2}, P("dp", "tp"), P("dp", None, "tp"), 1),  # the second axis moves
    ({"dp": 2, "tp": 2}, P("dp", "tp"), P("tp", None, "dp"), 2),  # dp leaves dim 0, then tp moves onto it
    ({"dp": 2, "tp": 2}, P("dp", "tp"), P("tp", "dp"), 0),  # each moves onto the other's dim
    ({"dp": 2, "tp": 2}, P(("dp", "tp")), P(None, ("dp", "tp")), 0),  # both split one dim, nested
    ({"dp": 2, "tp": 2}, P("dp", None, "tp"), P(None, ("dp", "tp")), 2),  # dp first: the outer split
]


def test_an_all_to_all_sends_a_transposed_block_whole():
    # the block moved is a transposed view (not contiguous) and its split moves onto dim 0: the
    # blocks sent must be made contiguous first (collectives take dense buffers)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=4)
        f = nf.jit(lambda x: nf.with_sharding_constraint(x.t(), P(None, "dp")), mesh=mesh, in_shardings=(P("dp"),),
                   out_shardings=P("dp"))
        lowered = f.lower(x)
        out, ran = run_counted(f, nf.device_put(x, nf.sharding.NamedSharding(mesh, P("dp"))))
        torch.testing.assert_close(nf.device_get(out), x.t(), rtol=0, atol=0)
    assert ran == lowered.cost_analysis()["collectives"] == {"all_to_all": 1}
    (sent,) = [n.args[0] for n in lowered.program.local.graph.nodes
               if n.target is torch.ops._c10d_functional.all_to_all_single.default]
    assert sent.meta["val"].is_contiguous()


@pytest.mark.parametrize("axes, src, dst, swaps", MOVES)
def test_splits_moving_between_dims_are_exchanged_by_all_to_alls_where_they_nest(axes, src, dst, swaps):
    x = torch.randn(8, 8, 4, generator=torch.Generator().manual_seed(0))
    with nf.simulate(4):
        mesh = nf.make_mesh(**axes)
        # computed in the input's layout, then moved
        f = nf.jit(lambda x: nf.with_sharding_constraint(x * 2, src), mesh=mesh, in_shardings=(src,), out_shardings=dst)
        costs = f.lower(x).cost_analysis()
        out, ran = run_counted(f, nf.device_put(x, nf.sharding.NamedSharding(mesh, src)))
        assert nf.sharding_of(out).is_equivalent_to(nf.sharding.NamedSharding(mesh, dst), 3)
        torch.testing.assert_close(nf.device_get(out), x * 2, rtol=0, atol=0)
    assert costs["collectives"].get("all_to_all", 0) == ran.get("all_to_all", 0) == swaps
    if swaps:  # nothing else moves: each all-to-all sends all but 1/n of the rank's block
        n = 4 if len(axes) == 1 else 2
        assert costs["comm_bytes"]["total"] == swaps * (n - 1) / n * x.numel() * 4 / 4


def test_fsdp_gathers_each_parameter_and_reduce_scatters_each_gradient():
    case = adam_case()
    with nf.simulate(4):
        jitted, args, expected = jit_adam(nf.make_mesh(dp_shard=4), {"w1": P("dp_shard"), "w2": P("dp_shard")},
                                          P("dp_shard"), case)
        costs = jitted.lower(*args).cost_analysis()
        assert costs["collectives"] == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1}
        param_bytes = 2 * D * F * 4
        assert costs["comm_bytes"]["all_gather"] == pytest.approx(3 / 4 * param_bytes)
        assert costs["comm_bytes"]["reduce_scatter"] == pytest.approx(3 / 4 * param_bytes)
        out, ran = run_counted(jitted, *args)
        assert ran == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1}
        assert_same(out, expected)


@pytest.mark.parametrize("axes", [dict(dp=4, tp=1), dict(dp=1, tp=4)])
def test_a_size_one_axis_has_no_collectives(axes):
    params, x, y = data()
    opt, step = adam_step()
    state = opt.init(params)
    expected = step(params, state, x, y)
    with nf.simulate(4):
        mesh = nf.make_mesh(**axes)
        specs = {"w1": P(None, "tp"), "w2": P("tp", None)}
        sspecs = nf.optim.state_shardings(state, specs)
        jitted = nf.jit(step, mesh=mesh, in_shardings=(specs, sspecs, P("dp"), P("dp")),
                        out_shardings=(specs, sspecs, P()))
        lowered = jitted.lower(params, state, x, y)
        live = "dp" if axes["dp"] > 1 else "tp"
        dead = "tp" if live == "dp" else "dp"
        text = lowered.as_text()
        assert f"over ('{dead}',)" not in text and f"over ('{live}',)" in text
        # the same program as on a mesh of the live axis alone
        alone = nf.make_mesh(**{live: 4})
        alone_specs = {"w1": P(None, "tp") if live == "tp" else P(), "w2": P("tp", None) if live == "tp" else P()}
        reference = nf.jit(step, mesh=alone, in_shardings=(alone_specs, nf.optim.state_shardings(state, alone_specs),
                                                            P("dp") if live == "dp" else P(), P("dp") if live == "dp" else P()),
                           out_shardings=(alone_specs, nf.optim.state_shardings(state, alone_specs), P()))
        assert program_counts(lowered) == program_counts(reference.lower(params, state, x, y))
        assert_same(jitted(params, state, x, y), expected)


@pytest.mark.parametrize("n,axes,specs,batch", [
    (4, dict(dp=2, tp=2), {"w1": P(None, "tp"), "w2": P("tp", None)}, P("dp")),
    (8, dict(dp=2, tp=4), {"w1": P(None, "tp"), "w2": P("tp", None)}, P("dp")),
    (8, dict(dp=8), {"w1": P(), "w2": P()}, P("dp")),
    (8, dict(tp=8), {"w1": P(None, "tp"), "w2": P("tp", None)}, P()),
])
def test_mlp_step_equals_the_unsharded_step(n, axes, specs, batch):
    params, x, y = data(1)
    opt, step = adam_step()
    state = opt.init(params)
    expected = step(params, state, x, y)
    with nf.simulate(n):
        mesh = nf.make_mesh(**axes)
        sspecs = nf.optim.state_shardings(state, specs)
        jitted = nf.jit(step, mesh=mesh, in_shardings=(specs, sspecs, batch, batch), out_shardings=(specs, sspecs, P()))
        out = jitted(params, state, x, y)
        for name, t in out[0].items():  # results come laid out as out_shardings say
            assert nf.sharding_of(t).is_equivalent_to(nf.sharding.NamedSharding(mesh, specs[name]), t.ndim)
        assert_same(out, expected)


def test_a_head_split_on_its_contraction_dim_is_gathered_not_its_logits_reduced():
    # logits = x @ W with W stored split over its rows (FSDP's layout) and x split by rows of the
    # batch: gathering W moves D x V; splitting x the other way and reduce-scattering the logits
    # moves B x V, 32 times more. Views stand between the matmul and the softmax that cannot take
    # a pending sum, so the choice is one for several nodes at once.
    g = torch.Generator().manual_seed(0)
    V = 256
    w, x = torch.randn(D, V, generator=g) / 4, torch.randn(B, D, generator=g)

    def logprobs(w, x):
        logits = (x @ w).reshape(B // 8, 8, V).reshape(B, V)
        return torch.log_softmax(logits, dim=-1)

    with nf.simulate(4):
        jitted = nf.jit(logprobs, mesh=nf.make_mesh(dp_shard=4), in_shardings=(P("dp_shard"), P("dp_shard")),
                        out_shardings=P("dp_shard"))
        costs = jitted.lower(w, x).cost_analysis()
        assert costs["collectives"] == {"all_gather": 1}
        assert costs["comm_bytes"]["total"] == pytest.approx(3 / 4 * D * V * 4)
        out, ran = run_counted(jitted, w, x)
        assert ran == {"all_gather": 1}
        assert_same(out, logprobs(w, x))


def test_identical_layers_are_decided_once():
    # the solver remembers each node's answer by its local situation: a stack twice as deep adds
    # a layer's worth of nodes many times over, but almost no new situations to decide
    from ndfunc._src.partition.planning.solve import Problem

    def deep_loss(layers, x, y):
        for p in layers:
            x = x + torch.relu(x @ p["w1"]) @ p["w2"]
        return ((x - y) ** 2).mean()

    def problem(depth):
        g = torch.Generator().manual_seed(0)
        layers = [{"w1": torch.randn(D, F, generator=g) / 4, "w2": torch.randn(F, D, generator=g) / 4}
                  for _ in range(depth)]
        x, y = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
        specs = [{"w1": P(None, "tp"), "w2": P("tp", None)}] * depth
        jitted = nf.jit(nf.grad(deep_loss), mesh=nf.make_mesh(dp=2, tp=2),
                        in_shardings=(specs, P("dp"), P("dp")), out_shardings=specs)
        program = jitted.lower(layers, x, y).program
        args = (program.traced.graph, program.sizes, program.in_layouts, program.out_layouts)
        solved = Problem(*args)
        plan = solved.solve()
        # and the same search deciding every node afresh: the remembered answers change nothing
        fresh = Problem(*args)
        fresh.best = lambda n, choice, forward=False: 0 if len(fresh.c_ins[n]) == 1 else fresh._best_uncached(
            n, choice, forward)
        assert fresh.solve().strategy == plan.strategy
        return len(solved.nodes), len(solved._best)

    with nf.simulate(4):
        (nodes4, decided4), (nodes8, decided8) = problem(4), problem(8)
    assert nodes8 > 1.8 * nodes4
    assert decided8 < 1.1 * decided4, (decided4, decided8)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("classes_dim", [1, 2], ids=["logits_NC", "logits_BCL"])
@pytest.mark.parametrize("axes,batch", [(dict(dp=4), P("dp")), (dict(dp=2, cp=2), P("dp", "cp"))])
def test_a_cross_entropy_over_targets_ignored_unevenly_is_the_whole_batchs_mean(axes, batch, classes_dim, weighted):
    # rank 0's block ignores most of its targets and rank 3's none: a mean of each rank's own
    # mean is not the batch's. (Under cp alone the solver gathers this small step's inputs and
    # computes the loss whole, so there is nothing to test there.)
    g = torch.Generator().manual_seed(0)
    Bt, L, V = 4, 8, 512  # logits far bigger than what a sharded loss reduces: the loss runs sharded
    w, x = torch.randn(D, V, generator=g), torch.randn(Bt, L, D, generator=g)
    targets = torch.randint(0, V, (Bt, L), generator=g)
    targets[0, 1:] = -100
    targets[1, ::2] = -100
    class_weight = torch.rand(V, generator=g) + 0.5 if weighted else None

    def loss(w, x, targets):
        logits = x @ w
        if classes_dim == 2:  # (B, V, L): cross_entropy takes the classes on dim 1
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, weight=class_weight)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=class_weight)

    step = lambda w, x, targets: torch.func.grad_and_value(loss)(w, x, targets)  # noqa: E731
    expected = step(w, x, targets)
    with nf.simulate(4):
        jitted = nf.jit(step, mesh=nf.make_mesh(**axes), in_shardings=(P(), batch, batch), out_shardings=(P(), P()))
        got = nf.device_get(jitted(w, x, targets))
    assert_same(got, expected)


def test_a_tensor_the_step_closes_over_is_whole_on_every_rank_and_left_as_it_was():
    g = torch.Generator().manual_seed(0)
    scale, x = torch.randn(D, generator=g), torch.randn(B, D, generator=g)
    kept = scale.clone()
    # exp reads it last: were it a buffer of the program's own, exp would write into it
    step = lambda x: (x * torch.exp(scale)).sum(0)  # noqa: E731
    with nf.simulate(4):
        jitted = nf.jit(step, mesh=nf.make_mesh(dp=4), in_shardings=P("dp"), out_shardings=P())
        got = [nf.device_get(jitted(x)) for _ in range(2)]
    for out in got:
        assert_same(out, step(x))
    assert torch.equal(scale, kept)


def test_a_factory_of_a_split_tensor_is_made_in_the_layout_the_plan_gives_it():
    # new_zeros reads only its tensor's dtype and device: the plan makes it whole, where DTensor's
    # propagator would split it like the tensor; the local op must make the whole block
    x, w = torch.randn(4 * B, D), torch.randn(4 * B, D)
    with nf.simulate(4):
        jitted = nf.jit(lambda x, w: x.new_zeros(x.shape) + w, mesh=nf.make_mesh(dp=4), in_shardings=(P("dp"), P()),
                        out_shardings=P())
        (made,) = [s for n, s in jitted.lower(x, w).program.plan.strategy.items() if n.name == "new_zeros"]
        assert made.ins == ((Shard(0),),) and made.outs == ((Replicate(),),)
        assert_same(nf.device_get(jitted(x, w)), w)


def test_rows_gathered_by_index_get_one_gradient_on_every_rank():
    # a mixture of experts' weights[expert_ids]: the weights' gradient sums the picked rows' by
    # index_put(accumulate=True), whose CPU kernel adds colliding rows in thread order; every rank
    # computes it alike from the same gathered rows and must hold it alike
    g = torch.Generator().manual_seed(0)
    weights, x = torch.randn(4, 32, 64, generator=g), torch.randn(128, 32, generator=g)  # (rows of 2048: threads
    ids = torch.randint(0, 4, (128,), generator=g)  # share them, the order they add in differs run to run)
    loss = lambda w, x, ids: torch.bmm(x[:, None], w[ids]).square().sum()  # noqa: E731
    with nf.simulate(2):
        jitted = nf.jit(nf.grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp"), P("dp")),
                        out_shardings=P())
        got = nf.device_get(jitted(weights, x, ids))  # raises if the ranks' values differ
    torch.testing.assert_close(got, torch.func.grad(loss)(weights, x, ids), rtol=1e-5, atol=1e-4)
    rows, values = torch.randint(-4, 4, (64, 3), generator=g), torch.randint(-8, 8, (64, 3, 5), generator=g).float()
    exact = torch.index_put(torch.zeros(4, 5), [rows], values, accumulate=True)  # integers: any order is exact
    assert torch.equal(index_put_in_order(torch.zeros(4, 5), [rows], values, True), exact)


@pytest.mark.parametrize("ord", [2, 1, 3])
def test_a_norm_over_a_split_dim_is_the_norm_of_the_whole(ord):
    # DTensor's rule for a p-norm over a split dim leaves partial norms pending (_NormPartial),
    # reduced as p-th powers; summed as they stand they would give the sum of the ranks' norms
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 16, generator=g) / 4, torch.randn(8, 16, generator=g)
    loss = lambda w, x: torch.linalg.vector_norm(x @ w.T, ord=ord, dim=-1).sum()  # noqa: E731
    with nf.simulate(4):
        jitted = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(tp=4), in_shardings=(P("tp", None), P()),
                        out_shardings=(P(), P("tp", None)))
        got = nf.device_get(jitted(w, x))
    want = torch.func.grad_and_value(loss)(w, x)
    torch.testing.assert_close(got[0], want[1])
    torch.testing.assert_close(got[1], want[0])


def test_a_constant_the_step_returns_is_a_copy_of_it():
    scale = torch.arange(4.0)
    with nf.simulate(4):
        jitted = nf.jit(lambda x: (x * 2, scale), mesh=nf.make_mesh(dp=4), in_shardings=P("dp"),
                        out_shardings=(P("dp"), P()))
        _, returned = jitted(torch.ones(8))
        returned.add_(1)  # a caller may write into a result, or donate it
        _, again = jitted(torch.ones(8))
        assert torch.equal(nf.device_get(again), torch.arange(4.0))
    assert torch.equal(scale, torch.arange(4.0))


def test_a_loss_over_targets_all_ignored_is_nan_on_every_rank_as_on_one_device():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(8, 5, generator=g), torch.full((8,), -100)
    loss = torch.nn.functional.cross_entropy
    with nf.simulate(4):
        jitted = nf.jit(loss, mesh=nf.make_mesh(dp=4), in_shardings=(P("dp"), P("dp")), out_shardings=P())
        got = nf.device_get(jitted(logits, targets))
    assert got.isnan() and loss(logits, targets).isnan()


def test_a_half_precision_cross_entropy_over_targets_ignored_unevenly_is_not_a_mean_of_means():
    # bfloat16 scores keep the mean op (their sum could overflow before the division); its rule
    # must not average each rank's own mean, so the scores come together and the mean is one device's
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(32, 512, generator=g).bfloat16(), torch.randint(0, 512, (32,), generator=g)
    targets[1:8] = -100  # rank 0's block keeps one target of eight
    loss = torch.nn.functional.cross_entropy
    with nf.simulate(4):
        jitted = nf.jit(loss, mesh=nf.make_mesh(dp=4), in_shardings=(P("dp"), P("dp")), out_shardings=P())
        got = nf.device_get(jitted(logits, targets))
    assert torch.equal(got, loss(logits, targets))


def test_what_the_consumers_of_a_value_read_by_many_want_is_counted_as_the_search_chooses():
    # one input read by two dozen matmuls, each free to take it whole or split (AdamW's bias
    # corrections are read so, by every parameter's update): the search counts what those
    # consumers want (`_Choice`) rather than reading each of them for each one. Held to `demands`,
    # which reads each, over random choices (and the value's cost to a sum over them); and each
    # answer the search remembers for a situation to one decided afresh in it, so a situation
    # leaves out nothing the answer reads.
    import random

    from ndfunc._src.partition.planning import costs, solve

    def loss(ws, x):
        return sum(torch.tanh(x @ w).sum() for w in ws)

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(D, F, generator=g) / 4 for _ in range(24)]
    x = torch.randn(B, D, generator=g)
    with nf.simulate(4):
        jitted = nf.jit(nf.grad(loss), mesh=nf.make_mesh(dp=2, tp=2),
                        in_shardings=([P(None, "tp"), P("tp", None)] * 12, P("dp")))
        program = jitted.lower(ws, x).program
    args = (program.traced.graph, program.sizes, program.in_layouts, program.out_layouts)
    problem = solve.Problem(*args)
    hubs = {v for slots in problem._hub_slots for v, _ in slots}
    readers = sorted({m for v in hubs for m, _ in problem.consumers[v]})
    makers = sorted({problem.values[v][0] for v in hubs})
    assert any(len({ins[slot] for ins in problem.c_ins[m]}) > 2 for v in hubs for m, slot in problem.consumers[v])
    rng = random.Random(0)
    choice = costs._Choice(problem, len(problem.nodes))
    for m in makers + readers:
        choice[m] = 0
    for _ in range(1000):
        m = rng.choice(readers + makers)
        choice[m] = rng.randrange(-1 if m in readers else 0, len(problem.c_ins[m]))
        for v in hubs:
            for n in rng.sample(readers, 5):
                assert problem.paid(v, choice, n) == problem.demands(v, choice, skip=n)
            lay = problem.out_layout(v, choice)
            cost = 0
            for w in problem.demands(v, choice):
                cost += problem.tcost(v, lay, w) if w != lay else 0.0
            assert problem.value_cost(v, choice) == cost + (problem.output_cost(v, lay) if v in problem.final else 0.0)
        n = rng.choice(readers)
        if len(problem.c_ins[n]) > 1 and all(choice[problem.values[v][0]] >= 0 for v in problem.inputs[n]):
            assert problem.best(n, choice) == problem._best_uncached(n, choice, False)
    searched = solve.Problem(*args)
    remembered, asked = searched.best, []

    def best(n, choice, forward=False):
        i = remembered(n, choice, forward)
        asked.append(i == (0 if len(searched.c_ins[n]) == 1 else searched._best_uncached(n, choice, forward)))
        return i
    searched.best = best
    searched.solve()
    assert len(asked) > 100 and all(asked)


def test_a_write_in_place_into_a_value_the_plan_moves_is_refused_not_run_wrong(monkeypatch):
    # rfft's backward writes into a slice of zeros and reads the zeros whole; the plan splits the
    # slice for the write and keeps the zeros whole. The tracer writes that as a slice_scatter;
    # without it, lowering refuses the write, which would land in a moved copy
    from ndfunc._src import writes

    monkeypatch.setattr(writes, "views_as_scatters", lambda gm: False)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 16, generator=g), torch.randn(8, 6, 16, generator=g)
    loss = lambda w, x: torch.fft.rfft(x @ w.T, dim=1).abs().mean()  # noqa: E731
    with nf.simulate(4), pytest.raises(NotImplementedError, match=r"^aten\.copy_\.default writes in place into "
                                       r"slice_1, which the partitioner lays out otherwise for the write .* it "
                                       r"would not see the write\. Write it without the in-place op"):
        nf.jit(nf.grad(loss), mesh=nf.make_mesh(dp=4), in_shardings=(P(), P("dp")), out_shardings=P()).lower(w, x)
