"""Every transform through the same checks (as optax runs every optimizer through one suite): it
composes with nf.jit, keeps the results the step has without it, keeps the placements asked for,
and refuses a mesh without its axes. Then nf.jit's own checks of what it is given."""

from __future__ import annotations

import contextlib
import dataclasses

import optree
import pytest
import torch

import ndfunc as nf
from models import llama, train
from ndfunc.sharding import NamedSharding, P

CONFIG = nf.ParallelConfig(dp_shard_size=2, cp_size=2)  # 4 ranks: FSDP over ('dp_shard', 'cp'), CP
# name: (transforms, the model's remat policy, tolerance of the parameters after a step against
# the step without it); the loss is the model's float32 one: within a few of its ulps
TRANSFORMS = {
    # the same sums: gathers and reduce-scatters move, the arithmetic does not
    "fsdp": ([nf.fsdp(("dp_shard", "cp"))], None, dict(rtol=1e-12, atol=1e-12)),
    # the attention sums over key blocks in another order (online softmax), which the model's fp32
    # norms and rotary angles round to fp32: gradients within fp32 ulps, times the learning rate
    "ring_attention": ([nf.ring_attention("cp", load_balance=None)], None, dict(rtol=1e-6, atol=1e-8)),
    # bf16 compute: gradients to 8 bits of mantissa, scaled by the learning rate
    "mixed_precision": ([nf.mixed_precision(torch.bfloat16, torch.float32)], None, dict(rtol=1e-2, atol=1e-3)),
    # the same ops, recomputed
    "remat": ([], "full", dict(rtol=1e-12, atol=1e-12)),
    # the same ops, but the graph with its recomputation is partitioned on its own, and where its
    # plan differs (since the loss is vocabulary-parallel, it does) the model's fp32 norms, rotary
    # angles and loss are summed in another order: fp32 ulps, times the learning rate, as the ring's
    "remat_save_dots": ([], "save_dots", dict(rtol=1e-6, atol=1e-8)),
}


def run(transforms, remat):
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=1, remat=remat)
    # SGD: an update linear in the gradient (Adam near a zero gradient turns summation-order noise
    # into a whole step, which would test the optimizer's conditioning, not the transform)
    opt = nf.optim.sgd(0.5)
    g = torch.Generator().manual_seed(0)
    b, seq = 4, 16
    batch = {"tokens": torch.randint(0, cfg.vocab_size, (b, seq), generator=g),
             "targets": torch.randint(0, cfg.vocab_size, (b, seq), generator=g),
             "positions": torch.arange(seq).expand(b, seq).contiguous()}
    # float64 parameters (the model keeps its norms, rotary angles and loss in float32), made whole
    # on this one device (not once per simulated rank)
    params = optree.tree_map(lambda x: x.double(), llama.init(cfg, nf.random.key(0)))
    with nf.simulate(CONFIG.total_size):
        mesh = CONFIG.build_mesh()
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), CONFIG.rules)
        state = opt.init(params)
        sspec = nf.optim.state_shardings(state, pspec)
        step = nf.jit(train.make_step(cfg, opt, CONFIG.rules), mesh=mesh, transforms=transforms,
                      in_shardings=(pspec, sspec, {k: CONFIG.batch_spec for k in batch}),
                      out_shardings=(pspec, sspec, P()))
        new_params, _, loss = step(params, state, batch)
        leaves, specs = optree.tree_leaves(new_params), optree.tree_leaves(pspec, is_leaf=lambda s: isinstance(s, P))
        kept = all(nf.sharding_of(x).is_equivalent_to(NamedSharding(mesh, s), x.ndim) for x, s in zip(leaves, specs))
        return nf.device_get(new_params), float(nf.device_get(loss)), kept


@pytest.fixture(scope="module")
def without():
    return run([], None)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_a_transform_composes_with_jit_keeps_results_and_placements(name, without):
    transforms, remat, tol = TRANSFORMS[name]
    with pytest.warns(nf.sharding.ShardingWarning, match="sequences a rank, and where it flattens") if (
            name == "ring_attention") else contextlib.nullcontext():  # (two sequences a rank: gathered to tokens)
        params, loss, kept = run(transforms, remat)
    expected_params, expected_loss, _ = without
    assert kept  # every result laid out as out_shardings asked
    assert loss == pytest.approx(expected_loss, rel=1e-2 if name == "mixed_precision" else 1e-6)
    for got, want in zip(optree.tree_leaves(params), optree.tree_leaves(expected_params)):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("transform,axis", [(nf.fsdp("dp-shard"), "dp-shard"), (nf.fsdp(("dp_shard", "sp")), "sp"),
                                            (nf.ring_attention("cp"), "cp")])
def test_a_transform_naming_an_axis_the_mesh_lacks_is_refused_with_the_mesh_axes(transform, axis):
    with nf.simulate(2):
        mesh = nf.make_mesh(dp_shard=2, tp=1)
        name = type(transform).__name__
        message = (rf"^nf\.{name}: the mesh has no axis '{axis}'; its axes are \('dp_shard', 'tp'\)\. Name one of "
                   rf"those \(a size-1 axis is fine: the transform then does nothing\)\.$")
        with pytest.raises(ValueError, match=message):  # at once, when the mesh is given
            nf.jit(lambda x: x * 2, mesh=mesh, transforms=[transform])
        step = nf.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("dp_shard")), transforms=[transform])
        with pytest.raises(ValueError, match=message):  # else when the mesh is found, before tracing
            step(torch.ones(4))
        assert step.trace_count == 0


def test_a_transform_on_a_size_one_axis_does_nothing():
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2, cp=1)
        step = nf.jit(lambda x: (x * 2).sum(), mesh=mesh, in_shardings=P("dp"), transforms=[nf.ring_attention("cp")])
        assert float(nf.device_get(step(torch.ones(4)))) == 8.0


@pytest.mark.parametrize("given,message", [
    (["fsdp"], r"^nf\.jit\(<lambda>\): transforms\[0\] is 'fsdp', a str \(did you mean nf\.fsdp\(\.\.\.\)\?\); a "
               r"transform is nf\.fsdp\(axis\), nf\.ring_attention\(axis\), nf\.mixed_precision\(\.\.\.\) or another "
               r"ndfunc\.transforms\.Transform\.$"),
    ([object()], r"^nf\.jit\(<lambda>\): transforms\[0\] is <object object at 0x[0-9a-f]+>, a object; a transform is"),
    (nf.fsdp("dp"), r"^nf\.jit\(<lambda>\): transforms is a list, e\.g\. \[nf\.fsdp\('dp_shard'\)\]; got "
                    r"fsdp\(axis='dp'"),
])
def test_jit_refuses_what_is_not_a_transform(given, message):
    with pytest.raises(TypeError, match=message):
        nf.jit(lambda x: x, transforms=given)


def test_a_user_transform_runs_at_every_hook_in_pipeline_order():
    seen = []

    @dataclasses.dataclass(frozen=True)
    class Record(nf.transforms.Transform):
        def validate(self, mesh):
            seen.append("validate")

        def traced(self, program):
            seen.append(("traced", program.plan is None))

        def partitioned(self, program):
            seen.append(("partitioned", program.local is None))

        def lowered(self, program):
            seen.append(("lowered", program.local is not None))

    with nf.simulate(2):
        step = nf.jit(lambda x: x.sum(), mesh=nf.make_mesh(dp=2), in_shardings=P("dp"), transforms=[Record()])
        assert float(nf.device_get(step(torch.ones(4)))) == 4.0
    # validated when nf.jit is given the mesh, and again when a signature is lowered
    assert seen == ["validate", "validate", ("traced", True), ("partitioned", True), ("lowered", True)]
