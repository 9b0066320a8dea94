"""On gloo the program runs its reductions and gathers (up to a bound) as all-to-alls
(ndfunc._src.partition.backends.gloo): the same results as the collectives the partitioner wrote, on
simulated ranks told that their groups are gloo's, and against the single-device step."""

from __future__ import annotations

import optree
import pytest
import torch
from test_fsdp import llama_case

import ndfunc as nf
import ndfunc._src.partition.backends.cpu_kernels
import ndfunc._src.partition.backends.gloo
from ndfunc._src.partition import program
from ndfunc._src.runtime import cpu_backend
from ndfunc.sharding import NamedSharding, P

c10d = torch.ops._c10d_functional


def fsdp_tp_step(cfg, params, opt):
    """The llama AdamW step, FSDP x TP 2 x 2 (call inside nf.simulate(4)), and its arguments."""
    from models import llama, train

    config = nf.ParallelConfig(dp_shard_size=2, tp_size=2)
    mesh = config.build_mesh()
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    state = opt.init(params)
    sspec = nf.optim.state_shardings(state, pspec)
    named = lambda t, s: nf.device_put(t, optree.tree_map(
        lambda q: NamedSharding(mesh, q), s, is_leaf=lambda q: isinstance(q, P)))
    f = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh, in_shardings=(pspec, sspec, None),
               out_shardings=(pspec, sspec, P()), transforms=[nf.fsdp("dp_shard")])
    return f, (named(params, pspec), named(state, sspec))


def kinds(gm) -> dict:
    ops = {"all_reduce": c10d.all_reduce.default, "all_gather": c10d.all_gather_into_tensor.default,
           "reduce_scatter": c10d.reduce_scatter_tensor.default, "all_to_all": c10d.all_to_all_single.default}
    return {k: sum(n.target is op for n in gm.graph.nodes) for k, op in ops.items()}


@pytest.mark.slow
def test_on_gloo_reductions_and_gathers_run_as_all_to_alls_with_the_same_results(monkeypatch):
    from models import train

    cfg, params, batch, opt, _ = llama_case((4, 32), vocab_size=512, dim=64, n_layers=2, ffn_dim=128)
    expected = train.make_step(cfg, opt)(params, opt.init(params), batch)
    with nf.simulate(4):
        f, args = fsdp_tp_step(cfg, params, opt)
        as_written = nf.device_get(f(*args, batch))
        monkeypatch.setattr(ndfunc._src.partition.backends.gloo, "backend_of", lambda group: "gloo")
        f, args = fsdp_tp_step(cfg, params, opt)
        lowered = f.lower(*args, batch)
        got = nf.device_get(f(*args, batch))
    written, runs = kinds(lowered.program.local), kinds(lowered.compile().runs)
    # every reduce-scatter, the gathers of up to 16 MiB and the all-reduces of up to 1 MiB
    # (tensor parallelism's activations, the loss): here all, a small model
    assert written["reduce_scatter"] > 0 and written["all_reduce"] > 1 and written["all_gather"] > 0
    assert runs["all_to_all"] == sum(written.values())
    for a, b, c in zip(optree.tree_leaves(got), optree.tree_leaves(as_written), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("backend", ["nccl", "fake"])
def test_other_backends_run_the_program_as_written(monkeypatch, backend):
    cfg, params, batch, opt, _ = llama_case((4, 32), vocab_size=512, dim=64, n_layers=1, ffn_dim=128)
    monkeypatch.setattr(ndfunc._src.partition.backends.gloo, "backend_of", lambda group: backend)
    # the collectives only: on an AMD CPU with AVX-512 the matmul kernels pass would copy the program too
    monkeypatch.setattr(ndfunc._src.partition.backends.cpu_kernels, "ONEDNN_MATMUL", False)
    with nf.simulate(4):
        f, args = fsdp_tp_step(cfg, params, opt)
        lowered = f.lower(*args, batch)
    assert lowered.compile().runs is lowered.program.local


@pytest.mark.parametrize(("name", "cpu"), [("gloo", "gloo"), ("cpu:gloo,cuda:nccl", "gloo"), ("nccl", "nccl"),
                                           ("fake", "fake")])
def test_a_group_made_for_several_devices_runs_cpu_tensors_on_its_cpu_backend(name, cpu):
    assert cpu_backend(name) == cpu


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "4d"])
def test_each_collective_records_the_shape_it_sends(name):
    # the all-to-all forms take their blocks from each collective's Comm: it must be the input's
    # shape as sent (a reduce-scatter off dim 0 sends its blocks stacked on dim 0), as the
    # program's own shapes, propagated, say
    from test_matrix import lowered_step

    lowered = lowered_step(name)
    lowered.cost_analysis()  # fills every node's meta['val']
    collectives = [n for n, _ in program.collectives(lowered.program.local)]
    assert any(n.target is c10d.reduce_scatter_tensor.default for n in collectives)
    for n in collectives:
        assert program.comm(n).sent == tuple(n.args[0].meta["val"].shape), n.format_node()


@pytest.mark.parametrize(("rows", "rewritten"), [(64, True), (65, False)])
def test_a_gather_runs_as_an_all_to_all_up_to_the_bound_and_as_gloos_own_above(monkeypatch, rows, rewritten):
    # 64 rows of 4 floats per rank: 4 KiB gathered, the bound; a row more is above it
    from ndfunc._src.partition.backends import gloo as algorithms
    monkeypatch.setattr(algorithms, "GATHER_COPIES_MAX", 4096)
    monkeypatch.setattr(ndfunc._src.partition.backends.gloo, "backend_of", lambda group: "gloo")
    x = torch.randn(4 * rows, 4)
    with nf.simulate(4):
        f = nf.jit(lambda x: x * 2, mesh=nf.make_mesh(dp=4), in_shardings=P("dp"), out_shardings=P())
        runs = kinds(f.lower(x).compile().runs)
        got = nf.device_get(f(x))
    assert (runs["all_to_all"], runs["all_gather"]) == ((1, 0) if rewritten else (0, 1))
    torch.testing.assert_close(got, x * 2, rtol=0, atol=0)


def test_compiled_shows_the_program_that_runs_and_lowered_the_one_partitioned(monkeypatch):
    # on gloo the partitioner's reduction runs as an all-to-all and a sum: Compiled.as_text and
    # cost_analysis say so; Lowered's keep the all-reduce the partitioner chose
    monkeypatch.setattr(ndfunc._src.partition.backends.gloo, "backend_of", lambda group: "gloo")
    with nf.simulate(4):
        f = nf.jit(lambda x: x.sum(0), mesh=nf.make_mesh(dp=4), in_shardings=P("dp"), out_shardings=P())
        lowered = f.lower(torch.ones(8, 4))
        compiled = lowered.compile()
    assert "all_reduce(" in lowered.as_text() and "all_to_all_single(" not in lowered.as_text()
    assert "all_to_all_single(" in compiled.as_text() and "all_reduce(" not in compiled.as_text()
    assert lowered.cost_analysis()["collectives"] == {"all_reduce": 1}
    assert compiled.cost_analysis()["collectives"] == {"all_to_all": 1}
