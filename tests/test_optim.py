"""ndfunc.optim against torch.optim, step for step, and the purity a traced train step needs."""

import math

import optree
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ndfunc import optim

NUM_STEPS = 10
# Tolerance against torch.optim after NUM_STEPS steps: 1e-6 relative. The two differ only by
# rounding order (e.g. torch folds Adam's bias corrections into the step size, optax divides the
# moments), a few ulps per step. In float64 that is ~1e-15 and every element is held to 1e-6 of
# itself. In float32 an ulp of an O(1) parameter is ~1e-7, which is *not* 1e-6 of an element that
# the steps have carried near zero (seen: 2e-8 absolute = 1.2e-6 relative at an element of 0.02),
# so float32 leaves are held to 1e-6 of the parameter scale (atol 1e-6; parameters start in
# [0.5, 1.5] in magnitude) as well as 1e-6 of the element.
RTOL = 1e-6
ATOL = {torch.float64: 0.0, torch.float32: 1e-6}


def model_params(dtypes: str = "mixed") -> dict:
    """A small model-like tree: mixed shapes, nested dicts and lists; float32 and float64 leaves
    ("mixed") or float64 only ("float64")."""
    gen = torch.Generator().manual_seed(0)

    def leaf(shape, dtype=torch.float32):
        dtype = torch.float64 if dtypes == "float64" else dtype
        sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
        return (sign * (0.5 + torch.rand(shape, generator=gen, dtype=torch.float64))).to(dtype)

    return {
        "embed": leaf((8, 4)),
        "layers": [
            {"w": leaf((4, 4)), "b": leaf((4,), torch.float64)},
            {"w": leaf((4, 4), torch.float64), "b": leaf((4,))},
        ],
        "norm": leaf(()),
    }


def grad_sequence(params, scale: float = 1.0) -> list:
    gen = torch.Generator().manual_seed(1)
    return [
        optree.tree_map(lambda p: scale * torch.randn(p.shape, generator=gen, dtype=p.dtype), params)
        for _ in range(NUM_STEPS)
    ]


def run_ndfunc(opt, params, grads_seq):
    state = opt.init(params)
    for grads in grads_seq:
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


def run_torch(make_opt, params, grads_seq, clip_norm=None, lr_lambda=None):
    leaves = [torch.nn.Parameter(p.clone()) for p in optree.tree_leaves(params)]
    opt = make_opt(leaves)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    for grads in grads_seq:
        for p, g in zip(leaves, optree.tree_leaves(grads)):
            p.grad = g.clone()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(leaves, clip_norm, foreach=False)
        opt.step()
        if sched is not None:
            sched.step()
    return optree.tree_unflatten(optree.tree_structure(params), [p.detach() for p in leaves])


def assert_trees_close(actual, expected):
    assert optree.tree_structure(actual) == optree.tree_structure(expected)
    for a, e in zip(optree.tree_leaves(actual), optree.tree_leaves(expected)):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL[a.dtype])


CASES = {
    "sgd": (lambda: optim.sgd(0.1),
            lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False)),
    "sgd_momentum": (lambda: optim.sgd(0.1, momentum=0.9),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False)),
    "sgd_nesterov": (lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=False)),
    "adam": (lambda: optim.adam(1e-2),
             lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False)),
    "adam_betas": (lambda: optim.adam(3e-2, b1=0.8, b2=0.95, eps=1e-6),
                   lambda ps: torch.optim.Adam(ps, lr=3e-2, betas=(0.8, 0.95), eps=1e-6, foreach=False)),
    "adamw": (lambda: optim.adamw(1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)),
}


@pytest.mark.parametrize("dtypes", ["mixed", "float64"])
@pytest.mark.parametrize("name", CASES)
def test_matches_torch_optim(name, dtypes):
    make_ours, make_theirs = CASES[name]
    params = model_params(dtypes)
    grads_seq = grad_sequence(params)
    assert_trees_close(run_ndfunc(make_ours(), params, grads_seq),
                       run_torch(make_theirs, params, grads_seq))


@pytest.mark.parametrize("dtypes", ["mixed", "float64"])
def test_clip_then_adamw_matches_clip_grad_norm_then_adamw(dtypes):
    params = model_params(dtypes)
    # Gradients with a global norm ~30x max_norm, so every step clips. torch divides by
    # (norm + 1e-6), optax by norm: at norm ~30 that is a 3e-8 relative difference, inside RTOL.
    grads_seq = grad_sequence(params, scale=4.0)
    assert all(optim.global_norm(g) > 20.0 for g in grads_seq)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    expected = run_torch(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
                         params, grads_seq, clip_norm=1.0)
    assert_trees_close(run_ndfunc(opt, params, grads_seq), expected)


def test_adamw_mask_matches_param_groups_without_decay():
    params = model_params()
    grads_seq = grad_sequence(params)
    # Decay matrices, not biases or the norm scale: the usual split.
    mask = lambda p: optree.tree_map(lambda x: x.dim() >= 2, p)
    leaves = optree.tree_leaves(params)
    decayed = [i for i, p in enumerate(leaves) if p.dim() >= 2]
    assert 0 < len(decayed) < len(leaves)

    def make_torch(ps):
        return torch.optim.AdamW(
            [{"params": [p for i, p in enumerate(ps) if i in decayed], "weight_decay": 0.1},
             {"params": [p for i, p in enumerate(ps) if i not in decayed], "weight_decay": 0.0}],
            lr=1e-2, foreach=False)

    assert_trees_close(run_ndfunc(optim.adamw(1e-2, weight_decay=0.1, mask=mask), params, grads_seq),
                       run_torch(make_torch, params, grads_seq))


def test_scheduled_adam_matches_lambda_lr():
    schedule = optim.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=3, decay_steps=9,
                                                  end_value=1e-3)
    params = model_params()
    grads_seq = grad_sequence(params)
    # LambdaLR multiplies the base lr by lr_lambda(step), the step counted from 0 as ours is.
    expected = run_torch(lambda ps: torch.optim.Adam(ps, lr=1.0, foreach=False), params, grads_seq,
                         lr_lambda=lambda step: float(schedule(torch.tensor(step))))
    assert_trees_close(run_ndfunc(optim.adam(schedule), params, grads_seq), expected)


# --- schedules, against optax's formulas written out by hand ----------------------------------

def test_linear_schedule_follows_optax_formula():
    s = optim.linear_schedule(init_value=0.1, end_value=0.01, transition_steps=10, transition_begin=5)
    expected = {0: 0.1, 5: 0.1, 8: 0.1 + (3 / 10) * (0.01 - 0.1), 15: 0.01, 40: 0.01}
    for t, value in expected.items():
        got = s(torch.tensor(t, dtype=torch.int32))
        assert got.dtype == torch.float32
        assert math.isclose(float(got), value, rel_tol=1e-6), t


def test_warmup_cosine_decay_follows_optax_formula():
    init, peak, warmup, decay, end, exponent = 0.01, 1.0, 10, 110, 0.1, 2.0
    s = optim.warmup_cosine_decay_schedule(init, peak, warmup, decay, end_value=end, exponent=exponent)

    def optax_formula(t):
        if t < warmup:
            return init + (peak - init) * t / warmup
        tc = min(t - warmup, decay - warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * tc / (decay - warmup)))
        alpha = end / peak
        return peak * ((1 - alpha) * cosine**exponent + alpha)

    for t in (0, 1, 5, 9, 10, 11, 35, 60, 109, 110, 500):
        got = float(s(torch.tensor(t, dtype=torch.int64)))
        assert math.isclose(got, optax_formula(t), rel_tol=1e-6), t
    assert math.isclose(optax_formula(110), end)


def test_constant_and_short_names():
    assert optim.constant_schedule(3e-4)(torch.tensor(7)) == 3e-4
    assert optim.constant is optim.constant_schedule
    assert optim.linear_warmup is optim.warmup_constant_schedule
    assert optim.warmup_cosine_decay is optim.warmup_cosine_decay_schedule
    s = optim.linear_warmup(0.0, 1.0, warmup_steps=4)
    assert [float(s(torch.tensor(t))) for t in (0, 2, 4, 9)] == [0.0, 0.5, 1.0, 1.0]


def test_schedule_errors_name_the_arguments():
    with pytest.raises(ValueError, match=r"decay_steps=5 and warmup_steps=5"):
        optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=5, decay_steps=5)
    with pytest.raises(ValueError, match="decay_steps > 0, got 0"):
        optim.cosine_decay_schedule(1.0, decay_steps=0)


# --- interface: apply_updates, chain, states, purity --------------------------------------------

def test_apply_updates_adds_and_keeps_param_dtype():
    params = {"a": torch.ones(2), "b": [torch.ones((), dtype=torch.float64)]}
    updates = {"a": torch.tensor([0.5, -1.0], dtype=torch.float64),
               "b": [torch.tensor(2.0, dtype=torch.float64)]}
    new = optim.apply_updates(params, updates)
    assert new["a"].dtype == torch.float32 and new["b"][0].dtype == torch.float64
    torch.testing.assert_close(new["a"], torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(new["b"][0], torch.tensor(3.0, dtype=torch.float64))


def test_apply_updates_names_structure_mismatch():
    with pytest.raises(ValueError, match="updates must have the same tree structure as params"):
        optim.apply_updates({"a": torch.ones(1)}, {"b": torch.ones(1)})


def test_chain_composes_in_order_and_threads_states():
    opt = optim.chain(optim.scale_by_schedule(lambda count: count + 1), optim.scale(3.0))
    state = opt.init(torch.zeros(2))
    assert isinstance(state, tuple) and len(state) == 2
    updates, state = opt.update(torch.ones(2), state)
    updates, state = opt.update(torch.ones(2), state)
    torch.testing.assert_close(updates, torch.full((2,), 6.0))  # (count=1) + 1 = 2, times 3
    assert int(state[0].count) == 2 and state[1] == optim.EmptyState()


def test_chain_errors():
    with pytest.raises(TypeError, match="argument 1 is a float"):
        optim.chain(optim.identity(), 0.1)
    opt = optim.chain(optim.identity(), optim.identity())
    with pytest.raises(ValueError, match="expects a tuple of 2 states, got a tuple of 1"):
        opt.update(torch.ones(1), (optim.EmptyState(),))


def test_input_errors_say_what_to_do():
    with pytest.raises(TypeError, match="learning_rate .* got a str"):
        optim.adam("1e-3")
    with pytest.raises(TypeError, match="got a tensor of shape \\(2,\\)"):
        optim.sgd(torch.ones(2))
    opt = optim.adamw(1e-3)
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="params=None; call opt.update\\(grads, state, params\\)"):
        opt.update(params, opt.init(params))
    with pytest.raises(ValueError, match="updates must have the same tree structure as the Adam state"):
        opt.update({"v": torch.ones(2)}, opt.init(params), params)
    with pytest.raises(TypeError, match="mask holds Python bools"):
        optim.adamw(1e-3, mask={"w": 1}).update(params, opt.init(params), params)
    with pytest.raises(ValueError, match="mask has no entry for 'w'; mask has an entry for 'v'"):
        optim.adamw(1e-3, mask={"v": True}).update(params, opt.init(params), params)


ALL_OPTIMIZERS = {
    "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "adamw_scheduled": lambda: optim.adamw(optim.warmup_cosine_decay(0.0, 1e-2, 2, 20), weight_decay=0.1),
    "clip_adam": lambda: optim.chain(optim.clip_by_global_norm(1.0),
                                     optim.adam(optim.linear_warmup(0.0, 1e-2, 5))),
}


@pytest.mark.parametrize("name", ALL_OPTIMIZERS)
def test_state_is_namedtuples_of_tensors(name):
    params = model_params()
    state = ALL_OPTIMIZERS[name]().init(params)

    def states(s):  # a chain's state is a tuple of its members' states, NamedTuples at the bottom
        if hasattr(s, "_fields"):
            return [s]
        assert type(s) is tuple, type(s)
        return [leaf for sub in s for leaf in states(sub)]

    named = states(state)
    assert named and all(isinstance(s, tuple) and hasattr(s, "_fields") for s in named)
    assert all(isinstance(x, torch.Tensor) for x in optree.tree_leaves(state))
    for count in [s.count for s in named if "count" in s._fields]:
        assert count.dtype == torch.int32 and count.dim() == 0
    for s in [s for s in named if isinstance(s, optim.ScaleByAdamState)]:
        assert optree.tree_structure(s.mu) == optree.tree_structure(params)


@pytest.mark.parametrize("name", ALL_OPTIMIZERS)
def test_nothing_is_modified_in_place(name):
    opt = ALL_OPTIMIZERS[name]()
    params = model_params()
    grads = grad_sequence(params, scale=4.0)[0]
    state = opt.init(params)
    _, state = opt.update(grads, state, params)  # a state with non-zero moments and counts
    inputs = (params, state, grads)
    clones = optree.tree_map(torch.clone, inputs)
    versions = [x._version for x in optree.tree_leaves(inputs)]

    updates, new_state = opt.update(grads, state, params)
    new_params = optim.apply_updates(params, updates)

    assert [x._version for x in optree.tree_leaves(inputs)] == versions
    for x, c in zip(optree.tree_leaves(inputs), optree.tree_leaves(clones)):
        assert torch.equal(x, c)
    # New tensors came out: no output aliases an input.
    in_ptrs = {x.data_ptr() for x in optree.tree_leaves(inputs) if x.numel()}
    out_ptrs = {x.data_ptr() for x in optree.tree_leaves((new_params, new_state)) if x.numel()}
    assert not in_ptrs & out_ptrs


def test_update_traces_with_make_fx_without_item_or_mutation():
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20), weight_decay=0.1,
                    mask=lambda p: optree.tree_map(lambda x: x.dim() >= 2, p)),
    )

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    params = model_params()
    grads = grad_sequence(params, scale=4.0)[0]
    state = opt.init(params)
    gm = make_fx(step, tracing_mode="fake")(params, state, grads)

    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    names = {str(t) for t in targets}
    assert not {"aten.item.default", "aten._local_scalar_dense.default"} & names, names
    inplace = [t for t in targets if isinstance(t, torch._ops.OpOverload)
               and t._schema.name.split("::")[-1].endswith("_")]
    assert not inplace, inplace
    # The graph is the step: run on real tensors, it gives what eager gives.
    traced = gm(params, state, grads)
    eager = step(params, state, grads)
    for a, e in zip(optree.tree_leaves(traced), optree.tree_leaves(eager)):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_public_names_import():
    for name in optim.__all__:
        assert getattr(optim, name) is not None, name
