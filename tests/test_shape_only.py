"""Shape-only lowering: a step lowered over `nf.ShapeDtypeStruct` stand-ins on an `AbstractMesh`
is the program real ranks would run, and nothing of the step's size is allocated to make it."""

import json
import re
import subprocess
import sys

import optree
import pytest
import torch

import ndfunc as nf
from models import llama, train
from ndfunc.sharding import AbstractMesh, NamedSharding, P
from tests.helpers import REPO

CONFIG = nf.ParallelConfig(dp_shard_size=2, tp_size=2)  # 4 ranks: lowers in seconds
SEQ = 32


def _step(cfg, opt, mesh):
    return nf.jit(train.make_step(cfg, opt, CONFIG.rules), mesh=mesh)


def _text(lowered) -> str:
    """The program's text without what names the ranks behind its axes (process groups, the mesh's kind)."""
    text = re.sub(r"'[^']*'\)", "GROUP)", lowered.as_text())
    return text.split("\n", 1)[1]


def test_stand_ins_on_an_abstract_mesh_lower_to_the_program_real_ranks_run():
    cfg, opt = llama.LlamaConfig.tiny(), nf.optim.adamw(1e-3, weight_decay=0.1)
    specs = nf.sharding.logical_to_mesh(llama.param_axes(cfg), CONFIG.rules)
    n = CONFIG.dp_world_size

    mesh = CONFIG.build_abstract_mesh()
    params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), specs))
    planned = _step(cfg, opt, mesh).lower(params, opt.init(params), train.abstract_batch(CONFIG, mesh, n, SEQ))

    real = llama.init(cfg, nf.random.key(0))
    state = opt.init(real)
    batch = {k: torch.zeros(n, SEQ, dtype=torch.long) for k in ("tokens", "targets", "positions")}
    with nf.simulate(CONFIG.total_size):
        ranks = CONFIG.build_mesh()
        args = nf.device_put((real, state, batch), (
            optree.tree_map(lambda s: NamedSharding(ranks, s), specs),
            optree.tree_map(lambda s: NamedSharding(ranks, s), nf.optim.state_shardings(state, specs)),
            {k: NamedSharding(ranks, CONFIG.batch_spec) for k in batch}))
        lowered = _step(cfg, opt, ranks).lower(*args)
        assert _text(planned) == _text(lowered)
        assert planned.cost_analysis() == lowered.cost_analysis()
        assert planned.memory_analysis() == lowered.memory_analysis()


def test_opt_init_over_stand_ins_is_the_state_laid_out_like_the_parameters():
    cfg, opt = llama.LlamaConfig.tiny(), nf.optim.adamw(1e-3)
    mesh = AbstractMesh({"dp_shard": 4, "tp": 2})
    specs = nf.sharding.logical_to_mesh(llama.param_axes(cfg), [("embed", "dp_shard"), ("mlp", "tp")])
    params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), specs))
    state = opt.init(params)
    real = opt.init(llama.init(cfg, nf.random.key(0)))
    expected = nf.optim.state_shardings(real, specs)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    assert optree.tree_structure(state) == optree.tree_structure(real)
    for got, want, spec in zip(optree.tree_leaves(state), optree.tree_leaves(real),
                               optree.tree_leaves(expected, is_leaf=is_spec)):
        assert (got.shape, got.dtype) == (tuple(want.shape), want.dtype)
        assert got.sharding == NamedSharding(mesh, spec)
    # state_shardings over stand-ins without layouts lays them out as given
    unplaced = opt.init(llama.abstract_params(cfg))
    assert all(x.sharding is None for x in optree.tree_leaves(unplaced))
    named = optree.tree_map(lambda s: NamedSharding(mesh, s), specs)
    assert nf.optim.state_shardings(unplaced, named) == state
    with nf.set_mesh(mesh):  # a bare P binds to the mesh in context
        assert nf.optim.state_shardings(unplaced, specs) == state


def test_sharding_of_a_stand_in_is_its_own_and_of_a_dtensor_its_layout():
    mesh = AbstractMesh({"dp_shard": 4})
    split = NamedSharding(mesh, P("dp_shard"))
    assert nf.sharding_of(nf.ShapeDtypeStruct((8, 2), torch.float32, sharding=split)) == split
    assert nf.sharding_of(nf.ShapeDtypeStruct((8, 2), torch.float32)) is None
    assert nf.sharding_of(torch.zeros(8, 2)) is None
    with nf.simulate(4):
        x = nf.device_put(torch.zeros(8, 2), NamedSharding(nf.make_mesh(dp_shard=4), P("dp_shard")))
        assert nf.sharding_of(x).spec == P("dp_shard")


@pytest.mark.slow
def test_a_70b_step_on_1024_abstract_ranks_lowers_without_allocating_it():
    # one layer of Llama 3 70B with its 128k vocabulary (3.0e9 parameters: 12 GB in fp32, 36 GB with
    # Adam's moments) over dp_shard 64 x cp 2 x tp 8; a process of its own measures its peak
    out = subprocess.run([sys.executable, str(REPO / "tests" / "shape_only_worker.py"), "1", "1,64,2,8"],
                         capture_output=True, text=True, cwd=REPO, timeout=600, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    whole = report["whole_parameter_bytes"]
    assert whole > 11e9
    # what torch, the graph and the program take: far below one copy of the parameters
    assert report["rss_peak"] < 2 * 2**30, report
    memory = report["memory"]
    assert memory["argument_size_in_bytes"] == report["argument_bytes_from_shardings"]
    assert memory["peak_memory_in_bytes"] >= memory["argument_size_in_bytes"] + memory["temp_size_in_bytes"]
    assert report["flops"] > 0 and report["comm_bytes"] > 0


# --- what can be planned but not run ---------------------------------------------------------------

def test_a_step_called_with_stand_ins_says_to_lower_it():
    mesh = AbstractMesh({"dp": 2})
    step = nf.jit(lambda x: x * 2, mesh=mesh, in_shardings=P("dp"))
    x = nf.ShapeDtypeStruct((4, 2), torch.float32)
    assert step.lower(x).cost_analysis()["flops"] >= 0
    with pytest.raises(TypeError, match=re.escape(
            "<lambda> was called with nf.ShapeDtypeStruct stand-ins (or on an abstract mesh), which have shapes "
            "but no data: lower them to read the plan")):
        step(x)
    with pytest.raises(TypeError, match=re.escape(
            "<lambda> was lowered on AbstractMesh({'dp': 2}), an abstract mesh (names and sizes, no ranks): read it")):
        step.lower(x).compile()


def test_a_step_given_no_mesh_runs_on_its_dtensor_arguments_mesh():
    # the mesh is found in the arguments when neither nf.jit nor a context names it (as before
    # stand-ins were taken: finding theirs must not lose it)
    x = torch.arange(8.0).reshape(4, 2)
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        placed = nf.device_put(x, NamedSharding(mesh, P("dp")))
        out = nf.jit(lambda x: x * 2)(placed)
        assert nf.sharding_of(out).mesh == mesh
        assert torch.equal(nf.device_get(out), x * 2)


def test_opt_init_over_stand_ins_and_tensors_gives_stand_ins_laid_out_by_nobody():
    mesh = AbstractMesh({"dp": 2})
    params = {"w": nf.ShapeDtypeStruct((4, 2), torch.float32, sharding=NamedSharding(mesh, P("dp"))),
              "b": torch.zeros(2)}
    state = nf.optim.adam(1e-3).init(params)
    assert state[0].mu == {"w": nf.ShapeDtypeStruct((4, 2), torch.float32), "b": nf.ShapeDtypeStruct((2,), torch.float32)}
