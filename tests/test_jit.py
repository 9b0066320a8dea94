"""nf.jit's API: signatures and retracing, shardings as prefix trees, donation, constraints,
transforms, shard_map inside, errors - and the llama train step under DP, FSDP, TP and DP x TP
against the unsharded step."""

import dataclasses
import gc
import re

import optree
import pytest
import torch
from helpers import tanh_mlp_step
from test_jit_partition import assert_same
from torch.distributed.tensor import DTensor

import ndfunc as nf
from models import llama, train
from ndfunc import lax
from ndfunc.sharding import NamedSharding, P

TOL = dict(rtol=1e-5, atol=1e-5)


def named(mesh, specs):
    return optree.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


# --- signatures ----------------------------------------------------------------------------------

def test_traces_once_per_signature_and_again_only_for_a_new_one():
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        f = nf.jit(lambda x, y: (x * y).sum(0), mesh=mesh, in_shardings=(P("dp"), P("dp")))
        x = torch.arange(8.0).reshape(4, 2)
        for _ in range(3):
            f(x, x)
        assert f.trace_count == 1
        f(x.double(), x.double())  # dtype
        f(torch.ones(6, 2), torch.ones(6, 2))  # shape
        xd = nf.device_put(x, NamedSharding(mesh, P()))
        g = nf.jit(lambda x: x * 2, mesh=mesh)
        g(x)
        g(xd)  # replicated: the plain tensor's signature (the same program), so a step fed its results is not traced again
        assert g.trace_count == 1
        g(nf.device_put(x, NamedSharding(mesh, P("dp"))))  # a DTensor's split is part of the signature
        assert (f.trace_count, g.trace_count) == (3, 2)


def test_static_arguments_are_baked_in_and_key_the_cache():
    @dataclasses.dataclass(frozen=True)
    class Config:
        scale: float

    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        f = nf.jit(lambda cfg, x: x * cfg.scale, mesh=mesh, static_argnums=0, in_shardings=(None, P("dp")))
        x = torch.ones(4)
        assert torch.equal(nf.device_get(f(Config(2.0), x)), torch.full((4,), 2.0))
        assert torch.equal(nf.device_get(f(Config(3.0), x)), torch.full((4,), 3.0))
        f(Config(3.0), x)
        assert f.trace_count == 2
        with pytest.raises(TypeError, match="static arguments of <lambda> must be hashable"):
            nf.jit(lambda c, x: x, mesh=mesh, static_argnums=0)([1], x)


def test_inputs_plain_or_dtensor_outputs_dtensors_laid_out_as_asked():
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        x = torch.arange(32.0).reshape(8, 4)
        f = nf.jit(lambda a, b: (a + b, (a * b).sum()), mesh=mesh, in_shardings=(P("dp", "tp"), None),
                   out_shardings=(P(None, "tp"), None))
        out, total = f(x, nf.device_put(x, NamedSharding(mesh, P("tp"))))
        assert isinstance(out, DTensor) and isinstance(total, DTensor)
        assert nf.sharding_of(out).is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)
        assert nf.sharding_of(total).is_fully_replicated  # a free output never stays a pending sum
        assert torch.equal(nf.device_get(out), 2 * x) and float(nf.device_get(total)) == float((x * x).sum())


def test_bare_specs_take_the_mesh_from_context_and_set_mesh():
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        f = nf.jit(lambda x: x + 1, in_shardings=P("dp"), out_shardings=P("dp"))
        with mesh:
            assert nf.sharding_of(f(torch.zeros(4))).spec == P("dp")
        with nf.set_mesh(mesh):
            assert torch.equal(nf.device_get(f(torch.zeros(4))), torch.ones(4))


def test_no_mesh_and_no_ranks_runs_the_function_on_one_device():
    f = nf.jit(lambda x: x * 3)
    assert torch.equal(nf.device_get(f(torch.ones(2))), torch.full((2,), 3.0))


# --- errors --------------------------------------------------------------------------------------

def test_specs_without_a_mesh_say_how_to_give_one():
    with nf.simulate(2):
        with pytest.raises(nf.sharding.ShardingError, match=r"nf.jit\(<lambda>\) got PartitionSpecs but no mesh: "
                           r"pass mesh=nf.make_mesh\(...\), call it under `with mesh:`"):
            nf.jit(lambda x: x, in_shardings=P("dp"))(torch.ones(4))


def test_a_wrong_prefix_says_where_the_trees_part():
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        f = nf.jit(lambda p: p["w"] * 2, mesh=mesh, in_shardings=({"v": P()},))
        with pytest.raises(ValueError, match=re.escape("in_shardings has no entry for '0.w'; in_shardings has an entry for '0.v', which is not in the arguments (in_shardings has keys ['v']; the arguments: ['w']) at '0'")):
            f({"w": torch.ones(2)})


def test_a_spec_that_does_not_fit_names_the_argument():
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=4)
        f = nf.jit(lambda p: p["w"] * 2, mesh=mesh, in_shardings=({"w": P("dp")},))
        with pytest.raises(nf.sharding.IndivisibleError, match=r"^argument '0\.w': dim 0 of shape \(6,\) has size 6, "
                           r"which P\('dp'\) splits over mesh axes \('dp',\) \(dp=4\) into 4 blocks"):
            f({"w": torch.ones(6)})


def test_a_sharding_constraint_fixes_a_layout_inside():
    def f(x):
        y = nf.with_sharding_constraint(x * 2, P(None, "tp"))
        return y + 1

    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        j = nf.jit(f, mesh=mesh, in_shardings=P("dp"), out_shardings=P("dp"))
        text = j.lower(torch.ones(4, 4)).as_text()
        # from rows over dp to columns over tp: gather over dp, slice over tp
        assert "all_gather over ('dp',)" in text
        assert torch.equal(nf.device_get(j(torch.ones(4, 4))), torch.full((4, 4), 3.0))


def test_transforms_see_the_partitioned_and_the_lowered_program():
    seen = []

    class Record(nf.transforms.Transform):
        def partitioned(self, program):
            seen.append(("partitioned", program.plan is not None, program.local is None))

        def lowered(self, program):
            # a pass may edit the local program: scale the result by 2
            out = program.local.graph.find_nodes(op="output")[0]
            with program.local.graph.inserting_before(out):
                doubled = program.local.graph.call_function(torch.ops.aten.mul.Tensor, (out.args[0][0], 2))
            out.args = ([doubled],)
            program.local.recompile()
            seen.append(("lowered", "val" in out.args[0][0].args[0].meta))

    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        j = nf.jit(lambda x: x + 1, mesh=mesh, in_shardings=P("dp"), transforms=[Record()])
        got = nf.device_get(j(torch.zeros(4)))
    assert seen == [("partitioned", True, True), ("lowered", True)]
    assert torch.equal(got, torch.full((4,), 2.0))


def test_shard_map_inside_jit_runs_its_collectives_and_differentiates():
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(6, 8, generator=g), torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
    expected = torch.func.grad(lambda a, b: ((torch.tanh(x @ a) @ b) ** 2).sum(), argnums=(0, 1))(w1, w2)
    with nf.simulate(4):
        mesh = nf.make_mesh(tp=4)

        def local_loss(x, w1, w2):
            y = lax.psum(torch.tanh(x @ w1) @ w2, "tp")
            return (y * y).sum() + 0 * lax.axis_index("tp")

        # the loss is the same on every rank (0 times its position), which the check does not see:
        # the caller's word, as with JAX's check_vma=False
        mapped = nf.shard_map(local_loss, mesh, in_specs=(P(), P(None, "tp"), P("tp")), out_specs=P(), check_vma=False)
        grads = nf.jit(lambda a, b, x: nf.grad(lambda a, b: mapped(x, a, b), argnums=(0, 1))(a, b),
                       mesh=mesh, in_shardings=(P(None, "tp"), P("tp"), P()))
        lowered = grads.lower(w1, w2, x)
        assert lowered.cost_analysis()["collectives"] == {"all_reduce": 2}  # psum, and its transpose
        for got, want in zip(nf.device_get(grads(w1, w2, x)), expected):
            torch.testing.assert_close(got, want, **TOL)


def test_axis_index_inside_jit_is_each_ranks_own():
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        where = nf.shard_map(lambda x: x + lax.axis_index(("dp", "tp")).float(), mesh,
                             in_specs=(P(("dp", "tp")),), out_specs=P(("dp", "tp")))
        got = nf.jit(where, mesh=mesh)(torch.zeros(4))
        assert torch.equal(nf.device_get(got), torch.arange(4.0))


# --- donation ------------------------------------------------------------------------------------

def test_a_donated_plain_tensor_in_simulation_takes_one_write_not_one_per_rank():
    # a tensor that is not a DTensor stands for every simulated rank's block; donated, each rank
    # writes its result into memory of its own, not all four into the one tensor
    g = torch.Generator().manual_seed(0)
    s, c = torch.randn(16, generator=g), torch.randn(16, generator=g)
    with nf.simulate(4):
        step = nf.jit(lambda s, c: s + c, mesh=nf.make_mesh(dp=4), in_shardings=P(), out_shardings=P(),
                      donate_argnums=(0,))
        got = nf.device_get(step(s.clone(), c))
    assert torch.equal(got, s + c)


def test_donated_buffers_hold_the_results_and_the_donated_values_are_retired():
    # float64: Adam's first step is lr * g / (|g| + eps), so where a gradient is near zero a
    # summation-order difference of an ulp in fp32 becomes a whole step (seen on Intel's kernels);
    # in float64 the same order noise stays ~1e-12 and the comparison is of donation alone
    g = torch.Generator().manual_seed(0)
    n_leaves, width, dtype = 8, 128, torch.float64
    params = {f"w{i}": torch.randn(width, width, generator=g, dtype=dtype) / 12 for i in range(n_leaves)}
    x, y = torch.randn(8, width, generator=g, dtype=dtype), torch.randn(8, width, generator=g, dtype=dtype)
    opt = nf.optim.adam(1e-2)
    step = tanh_mlp_step(n_leaves, opt)

    state = opt.init(params)
    expected = step(params, state, x, y)
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        specs = {name: P() for name in params}  # replicated, small batch: memory is parameters and state
        sspecs = nf.optim.state_shardings(state, specs)
        kw = dict(mesh=mesh, in_shardings=(specs, sspecs, P("dp"), P("dp")), out_shardings=(specs, sspecs, P()))
        p, s = nf.device_put(params, named(mesh, specs)), nf.device_put(state, named(mesh, sspecs))
        keeping, donating = nf.jit(step, **kw), nf.jit(step, donate_argnums=(0, 1), **kw)
        peak_keep = keeping.lower(p, s, x, y).cost_analysis()["peak_memory_bytes"]
        peak_donate = donating.lower(p, s, x, y).cost_analysis()["peak_memory_bytes"]
        leaf = width * width * dtype.itemsize
        total = n_leaves * leaf  # parameter bytes
        # params + grads + two moments, and one leaf's update temporaries at a time (each leaf's
        # update is added to its parameter before the next is made, as an eager optimizer's loop
        # does); not a second copy of the parameters and moments
        assert 4 * total <= peak_donate <= 4 * total + leaf
        assert peak_keep >= peak_donate + 1.5 * total
        buffer = p["w1"]._local_tensor
        new_p, new_s, _ = donating(p, s, x, y)
        # each rank's result lives in the donated block's memory
        assert [t.data_ptr() for t in new_p["w1"]._local_tensor._local_tensors.values()] == [
            t.data_ptr() for t in buffer._local_tensors.values()]
        assert_same((new_p, new_s), expected[:2])
        with pytest.raises(RuntimeError, match=r"^this DTensor was donated to an nf.jit call \(donate_argnums\) "
                           r"and its buffer now holds that call's results; use the value the call returned"):
            p["w1"] + 1
        with pytest.raises(RuntimeError, match="was donated"):
            nf.device_get(p["w2"])


# --- llama ---------------------------------------------------------------------------------------

RULES = {
    "dp": [("batch", "dp")],
    "fsdp": [("batch", "dp"), ("embed", "dp")],
    "tp": [("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp")],
    "dp_tp": [("batch", "dp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp")],
}
MESHES = {"dp": dict(dp=4), "fsdp": dict(dp=4), "tp": dict(tp=4), "dp_tp": dict(dp=2, tp=2)}


def llama_step():
    cfg = llama.LlamaConfig.tiny()
    opt = nf.optim.adamw(1e-3, weight_decay=0.1)
    step = train.make_step(cfg, opt)

    params = llama.init(cfg, nf.random.key(0))
    g = torch.Generator().manual_seed(0)
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (8, 16), generator=g),
             "targets": torch.randint(0, cfg.vocab_size, (8, 16), generator=g)}
    return cfg, step, params, opt.init(params), batch


def llama_case():
    """The llama step, its arguments and its unsharded results (computed outside any simulation)."""
    cfg, step, params, state, batch = llama_step()
    return cfg, step, params, state, batch, step(params, state, batch)


def jit_llama(strategy: str, mesh, case, **kw):
    """(jitted step, params and state laid out by the strategy's rules, batch, unsharded results)."""
    cfg, step, params, state, batch, expected = case
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), RULES[strategy])
    bspec = nf.sharding.logical_to_mesh(("batch", None), RULES[strategy])
    sspec = nf.optim.state_shardings(state, pspec)
    jitted = nf.jit(step, mesh=mesh, in_shardings=(pspec, sspec, bspec), out_shardings=(pspec, sspec, P()), **kw)
    p, s = nf.device_put(params, named(mesh, pspec)), nf.device_put(state, named(mesh, sspec))
    return jitted, p, s, batch, expected, step


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "tp", "dp_tp"])
def test_llama_train_step_equals_the_unsharded_step(strategy):
    case = llama_case()
    step, batch, expected = case[1], case[4], case[5]
    expected_again = step(*expected[:2], batch)  # a second step, unsharded
    with nf.simulate(4):
        jitted, p, s, batch, expected, step = jit_llama(strategy, nf.make_mesh(**MESHES[strategy]), case,
                                                         donate_argnums=(0, 1))
        new_p, new_s, loss = jitted(p, s, batch)
        # fp32: the sums run in another order than on one device
        assert_same((new_p, new_s, loss), expected, rtol=1e-4, atol=1e-5)
        # a second step from the results (donated buffers, same program)
        again = jitted(new_p, new_s, batch)
        assert jitted.trace_count == 1
        assert_same(again, expected_again, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,axes", [("dp", dict(dp=8)), ("fsdp", dict(dp=8)), ("dp_tp", dict(dp=4, tp=2))])
def test_llama_train_step_on_eight_ranks(strategy, axes):
    case = llama_case()
    with nf.simulate(8):
        jitted, p, s, batch, expected, _ = jit_llama(strategy, nf.make_mesh(**axes), case)
        assert_same(jitted(p, s, batch), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_training_loop_fed_its_own_results_lowers_its_step_once():
    from models import llama, train

    cfg, config = llama.LlamaConfig.tiny(), nf.ParallelConfig(1, 2, 1, 2)
    opt = nf.optim.adamw(1e-3)
    with nf.simulate(4):
        mesh = config.build_mesh()
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        params = nf.jit(lambda k: llama.init(cfg, k), mesh=mesh, out_shardings=pspec)(nf.random.key(0))
        state = opt.init(params)  # its step count a plain tensor; the step returns a replicated DTensor
        sspec = nf.optim.state_shardings(state, pspec)
        tokens = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
        batch = {"tokens": tokens, "targets": tokens, "positions": torch.arange(16).expand(4, 16).contiguous()}
        step = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh, donate_argnums=(0, 1),
                      in_shardings=(pspec, sspec, {k: config.batch_spec for k in batch}),
                      out_shardings=(pspec, sspec, P()))
        for _ in range(3):
            params, state, _ = step(params, state, batch)
        assert step.trace_count == 1


def test_a_program_is_built_with_young_collections_only_and_the_thresholds_come_back():
    # a full collection walks every object the program being built has made; it waits until the
    # program is built, and the thresholds the user set come back, after a failed trace too
    seen = []

    @dataclasses.dataclass(frozen=True)
    class Record(nf.transforms.Transform):
        def partitioned(self, program):
            seen.append(("partitioned", gc.get_threshold()))

    def step(x):
        seen.append(("traced", gc.get_threshold()))
        return x.sum()

    def broken(x):
        raise ValueError("a step that fails while traced")

    before = gc.get_threshold()
    gc.set_threshold(500, 7, 9)
    try:
        with nf.simulate(2):
            mesh = nf.make_mesh(dp=2)
            assert float(nf.device_get(nf.jit(step, mesh=mesh, in_shardings=P("dp"), transforms=[Record()])(
                torch.ones(4)))) == 4.0
            assert gc.get_threshold() == (500, 7, 9)
            with pytest.raises(ValueError, match="fails while traced"):
                nf.jit(broken, mesh=mesh, in_shardings=P("dp")).lower(torch.ones(4))
            assert gc.get_threshold() == (500, 7, 9)
    finally:
        gc.set_threshold(*before)
    assert seen == [("traced", (500, 7, 2**30)), ("partitioned", (500, 7, 2**30))]


def test_a_jitted_functions_programs_are_freed_with_it():
    # (a table keyed weakly by fx node kept every traced graph alive: a notebook that jits again and
    # again grew by a program each time, and so did the test suite)
    import gc

    def graphs() -> int:
        gc.collect()
        return sum(isinstance(o, torch.fx.Graph) for o in gc.get_objects())

    def run(scale: float) -> None:
        with nf.simulate(2):
            f = nf.jit(lambda x, w: torch.tanh(x @ w).sum() * scale, mesh=nf.make_mesh(dp=2),
                       in_shardings=(P("dp"), P()), out_shardings=P())
            f(torch.randn(4, 8), torch.randn(8, 4))

    run(1.0)
    before = graphs()
    for scale in (2.0, 3.0, 4.0):
        run(scale)
    assert graphs() <= before
