"""nf.mixed_precision: bf16 compute, fp32 master parameters, optimizer state and gradient sums.
The reference is the same step written by hand on one device: the loss of the parameters cast to
bf16, differentiated with respect to the fp32 parameters."""

from __future__ import annotations

import operator
import re

import optree
import pytest
import torch
from test_matrix import MATRIX, run_sharded, setup

import ndfunc as nf
from models import llama
from ndfunc._src.partition.program import comm

c10d = torch.ops._c10d_functional


def bf16_loss(params, batch, cfg):
    return llama.loss(optree.tree_map(lambda x: x.to(torch.bfloat16), params), batch, cfg)


def rel_error(got, want) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "fsdp_tp"])
def test_mixed_precision_gradients_equal_the_bf16_gradients_by_hand(name):
    cfg, _, _, params, batches = setup()
    batch = batches[0]
    expected = nf.grad(bf16_loss)(params, batch, cfg)
    config = nf.ParallelConfig(*MATRIX[name])
    with nf.simulate(config.total_size):
        mesh = config.build_mesh()
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        grads = nf.jit(lambda p, b: nf.grad(llama.loss)(p, b, cfg), mesh=mesh,
                       in_shardings=(pspec, {k: config.batch_spec for k in batch}), out_shardings=pspec,
                       transforms=[nf.mixed_precision(torch.bfloat16, torch.float32)])
        got = nf.device_get(grads(params, batch))
    # bf16 keeps 8 bits of mantissa (a rounding is 2**-8 = 0.4% relative); the products and sums
    # round a few times and in another order on each rank: 3% of each gradient's norm
    for g, want in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        assert g.dtype == torch.float32  # as the parameter it belongs to
        assert rel_error(g, want) < 3e-2


@pytest.mark.slow
@pytest.mark.parametrize("name,schedule", [("fsdp_tp", None), ("fsdp_cp", "dp_shard")])
def test_mixed_precision_steps_keep_fp32_parameters_and_state_and_train(name, schedule):
    # and under nf.fsdp's schedule, which gathers each cast shard again for backward (over
    # dp_shard and cp: the rules shard the parameters over both; test_fsdp holds the schedule)
    cfg, opt, _, params, batches = setup()
    def by_hand(params, state, batch):
        loss, grads = nf.value_and_grad(bf16_loss)(params, batch, cfg)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss

    state, expected = opt.init(params), []
    p = params
    for batch in batches:
        p, state, loss = by_hand(p, state, batch)
        expected.append(float(loss))
    transforms = [nf.mixed_precision(torch.bfloat16, torch.float32)] + ([nf.fsdp(schedule)] if schedule else [])
    got_params, losses, _ = run_sharded(MATRIX[name], transforms)
    assert losses == pytest.approx(expected, rel=1e-3)
    assert all(x.dtype == torch.float32 for x in optree.tree_leaves(got_params))


# a rank's row each, every entry exact in bf16: their fp32 sum per column, 1 + 3 * 2**-9, is not
ROWS = torch.tensor([[1.0] * 4] + [[2.0**-9] * 4] * 3)


def test_a_gradient_summed_in_fp32_reaches_its_fp32_parameter_unrounded():
    # each of 4 ranks' bf16 gradient is exact in bf16 (1, then 2**-9 three times); their sum in fp32,
    # 1 + 3 * 2**-9, is not: the fp32 parameter gets that sum, as FSDP2's reduce_dtype keeps it, not
    # the sum rounded to bf16 (1 + 2**-7) and cast back
    x = ROWS
    with nf.simulate(4):
        grad = nf.jit(nf.grad(lambda w, x: (x @ w).sum()), mesh=nf.make_mesh(dp=4),
                      in_shardings=(nf.sharding.P(), nf.sharding.P("dp")), out_shardings=nf.sharding.P(),
                      transforms=[nf.mixed_precision(torch.bfloat16, torch.float32)])
        got = nf.device_get(grad(torch.ones(4), x))
    assert got.dtype == torch.float32 and torch.equal(got, torch.full((4,), 1 + 3 * 2.0**-9))


def test_a_bucket_of_gradients_reaches_its_fp32_parameters_unrounded():
    # as above, under nf.fsdp: a layer's two gradients are reduce-scattered as one bucket in fp32,
    # then cut into their pieces; each piece reaches its fp32 parameter as summed, 1 + 3 * 2**-9,
    # where the bucket was cast back to bf16 before the cut and each piece up again (1 + 2**-7)
    P = nf.sharding.P
    x = ROWS
    params = {"layers": [{"a": torch.ones(4, 4), "b": torch.ones(4, 4)}]}
    specs = {"layers": [{"a": P("dp"), "b": P("dp")}]}

    def loss(p, x):
        layer = p["layers"][0]
        x = x.to(layer["a"].dtype)
        return (x @ layer["a"]).sum() + (x @ layer["b"]).sum()

    with nf.simulate(4):
        grad = nf.jit(nf.grad(loss), mesh=nf.make_mesh(dp=4), in_shardings=(specs, P("dp")), out_shardings=specs,
                      transforms=[nf.fsdp("dp"), nf.mixed_precision(torch.bfloat16, torch.float32)])
        sums = [n for n in grad.lower(params, x).program.local.graph.nodes
                if n.target is c10d.reduce_scatter_tensor.default]
        got = nf.device_get(grad(params, x))
    assert len(sums) == 1 and comm(sums[0]).dtype == torch.float32  # one bucket, summed in fp32
    for g in (got["layers"][0]["a"], got["layers"][0]["b"]):
        assert g.dtype == torch.float32 and torch.equal(g, torch.full((4, 4), 1 + 3 * 2.0**-9))


def test_a_gradient_summed_over_two_axes_in_turn_is_not_rounded_between_them():
    # as above, each rank's row of x a bf16-exact gradient, the weight stored split over dp and
    # replicated over tp: its gradient is reduce-scattered over dp, then all-reduced over tp, both
    # in fp32. Rounded to bf16 between the two (as each reduction's sum was cast back to the bf16
    # it came in), 1 + 2**-9 becomes 1 and the parameter gets 1 + 2**-8, not 1 + 3 * 2**-9
    x = ROWS
    with nf.simulate(4):
        grad = nf.jit(nf.grad(lambda w, x: (x @ w).sum()), mesh=nf.make_mesh(dp=2, tp=2),
                      in_shardings=(nf.sharding.P("dp"), nf.sharding.P(("dp", "tp"))), out_shardings=nf.sharding.P("dp"),
                      transforms=[nf.mixed_precision(torch.bfloat16, torch.float32)])
        sums = [(n.target, comm(n).axes) for n in grad.lower(torch.ones(4), x).program.local.graph.nodes
                if n.target in (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)]
        got = nf.device_get(grad(torch.ones(4), x))
    assert sums == [(c10d.reduce_scatter_tensor.default, ("dp",)), (c10d.all_reduce.default, ("tp",))]
    assert got.dtype == torch.float32 and torch.equal(got, torch.full((4,), 1 + 3 * 2.0**-9))


@pytest.mark.parametrize("schedule", [False, True], ids=["plain", "fsdp"])
def test_gradients_summed_over_dp_shard_then_tp_stay_in_fp32_between_the_two(schedule):
    # Llama 3 8B's layer on dp_shard 8 x tp 2, shape-only, 4 sequences a rank: the partitioner runs
    # the MLP data-parallel over tp (its weights gathered over both axes), so their gradients are
    # reduce-scattered over dp_shard, laid out rank by rank, then reduce-scattered over tp. Each
    # sum is fp32 and so is what passes between them: no cast to bf16 and back. Under nf.fsdp's
    # schedule a layer's reduce-scatters over dp_shard are one bucket, split after it
    from models import train

    cfg = llama.LlamaConfig.llama3_8b(n_layers=1, remat="full")
    transforms = [nf.fsdp("dp_shard")] if schedule else []
    lowered = train.lower_abstract(cfg, nf.ParallelConfig(1, 8, 1, 2), 4096,
                                   [*transforms, nf.mixed_precision(torch.bfloat16, torch.float32)], 4)
    lowered.program.ensure_meta()
    sums = (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)
    aten = torch.ops.aten
    passing = (aten.view.default, aten.reshape.default, aten.permute.default, aten.clone.default, aten.t.default,
               aten._to_copy.default, operator.getitem, aten.split_with_sizes.default)  # laid out, cast, cut
    chained = []  # (the first sum, the ops between, the second)
    for n in lowered.program.local.graph.nodes:
        if n.target in sums:
            between, x = [], n.args[0]
            while x.op == "call_function" and x.target in passing:
                between.append(x)
                x = x.args[0]
            if x.target is c10d.wait_tensor.default and x.args[0].target in sums:
                chained.append((x.args[0], between, n))
    assert len(chained) >= 3  # w1, w2 and w3 at least
    for first, between, second in chained:
        assert comm(first).dtype == comm(second).dtype == torch.float32
        assert all(v.dtype == torch.float32 for b in between
                   for v in (b.meta["val"] if isinstance(b.meta["val"], (list, tuple)) else [b.meta["val"]])), \
            [b.target for b in between]


def test_the_program_computes_in_bf16_and_sums_gradients_in_fp32():
    cfg, opt, step, params, batches = setup()
    config = nf.ParallelConfig(1, 4, 1, 1)
    with nf.simulate(4):
        mesh = config.build_mesh()
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        sspec = nf.optim.state_shardings(opt.init(params), pspec)
        bspec = {k: config.batch_spec for k in batches[0]}
        jitted = nf.jit(step, mesh=mesh, in_shardings=(pspec, sspec, bspec), out_shardings=(pspec, sspec, nf.sharding.P()),
                        transforms=[nf.mixed_precision(torch.bfloat16, torch.float32)])
        lowered = jitted.lower(params, opt.init(params), batches[0])
        lowered.program.ensure_meta()
        gm = lowered.program.local
    mms = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    assert mms and all(n.meta["val"].dtype == torch.bfloat16 for n in mms)
    sums = [n for n in gm.graph.nodes if n.target in (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)]
    assert sums and all(n.args[0].meta["val"].dtype == torch.float32 for n in sums)
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    assert all(o.meta["val"].dtype in (torch.float32, torch.int32) for o in outs)


def test_a_frozen_parameter_computes_in_bf16_where_the_trained_ones_do():
    # a frozen base (LoRA's, a vision tower's) is among nf.nn.functional's buffers, not
    # differentiated: cast as the differentiated parameters are, as FSDP2's policy casts it
    from ndfunc.sharding import P

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))
    model[1].requires_grad_(False)
    ids = torch.randint(0, 16, (2, 4))
    by_hand = {k: v.detach().to(torch.bfloat16).requires_grad_(v.requires_grad) for k, v in model.named_parameters()}
    want = torch.func.functional_call(model, by_hand, (ids,)).float().logsumexp(-1).mean()
    want.backward()
    params, buffers, apply = nf.nn.functional(model)
    with nf.simulate(2):
        f = nf.jit(nf.value_and_grad(lambda p, ids: apply(p, buffers, ids).float().logsumexp(-1).mean()),
                   mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")), out_shardings=(P(), P()),
                   transforms=[nf.mixed_precision(torch.bfloat16, torch.float32)])
        loss, grads = nf.device_get(f(params, ids))
    torch.testing.assert_close(loss, want.detach())
    assert set(grads) == {"0.weight", "2.weight", "2.bias"}
    for k, g in grads.items():
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, by_hand[k].grad.float(), rtol=1e-2, atol=1e-2)


def test_an_eval_step_computes_a_module_in_bf16_as_its_training_forward_does():
    # nothing differentiated: the module's apply casts its parameters (a frozen one too) under the
    # transform, as FSDP2's policy casts in every forward; a bf16 model by hand is the reference
    from ndfunc.sharding import P

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))
    model[1].requires_grad_(False)
    ids = torch.randint(0, 16, (2, 4))
    want = torch.func.functional_call(model, {k: v.detach().to(torch.bfloat16) for k, v in model.named_parameters()},
                                      (ids,))
    params, buffers, apply = nf.nn.functional(model)
    with nf.simulate(2):
        f = nf.jit(lambda p, ids: apply(p, buffers, ids), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                   out_shardings=P("dp"), transforms=[nf.mixed_precision(torch.bfloat16, torch.float32)])
        got = nf.device_get(f(params, ids))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_modules_float_inputs_compute_in_bf16_as_fsdp2_casts_them():
    # an MLP fed float features: FSDP2's MixedPrecisionPolicy casts a module's floating-point
    # inputs to param_dtype (cast_forward_inputs), so its matmuls meet bf16 weights in bf16; the
    # reference is the model cast to bf16 by hand, input and all, differentiated as torch.func does.
    # (The input went in as fp32: each rank's matmul of fp32 by bf16 raised when the step ran)
    from ndfunc.sharding import P

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    params, buffers, apply = nf.nn.functional(model)

    def loss(p, x, y):
        return torch.nn.functional.mse_loss(apply(p, buffers, x).float(), y)

    def by_hand(p, x, y):
        out = torch.func.functional_call(model, {k: v.to(torch.bfloat16) for k, v in p.items()}, (x.to(torch.bfloat16),))
        return torch.nn.functional.mse_loss(out.float(), y)

    want = torch.func.grad(by_hand)(params, x, y)
    with nf.simulate(2):
        grad = nf.jit(nf.grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(None, P("dp"), P("dp")),
                      transforms=[nf.mixed_precision(torch.bfloat16, torch.float32)])
        got = nf.device_get(grad(params, x, y))
    for name, g in got.items():
        assert g.dtype == torch.float32
        # each rank's half of the batch in bf16, summed in fp32, against the whole batch in bf16: a
        # rounding or two of bf16 apart (0.4% each)
        torch.testing.assert_close(g, want[name], rtol=1e-2, atol=1e-3)


def _fp32_by_bf16(w, x):
    return (x @ w).sum()


def test_a_product_of_mixed_dtypes_is_refused_when_traced_naming_the_line():
    # x is not differentiated, so it stays fp32 while w computes in bf16: torch's mm refuses the
    # pair (as eager torch would), which a fake tensor does not check; said at trace time, with the
    # line, not by every rank's kernel as the step runs
    line = _fp32_by_bf16.__code__.co_firstlineno + 1
    with nf.simulate(2):
        grad = nf.jit(nf.grad(_fp32_by_bf16), mesh=nf.make_mesh(dp=2),
                      in_shardings=(nf.sharding.P(), nf.sharding.P("dp")),
                      transforms=[nf.mixed_precision(torch.bfloat16, torch.float32)])
        with pytest.raises(TypeError, match="^" + re.escape(
                f"_fp32_by_bf16 multiplies float32 and bfloat16 operands (aten.mm.default) at {__file__}:{line} "
                f"(return (x @ w).sum()): torch's kernels take one dtype, and every rank would raise as the step "
                f"ran. Under nf.mixed_precision the arguments nf.grad differentiates (the parameters) come in its "
                f"param_dtype: cast the others to match (`x.to(w.dtype)`), or call the model through "
                f"nf.nn.functional, whose apply casts its float inputs.") + "$"):
            grad(torch.ones(4, 4), torch.randn(4, 4))
