"""The ND-parallel strategy matrix: one model, one step function; each strategy is a ParallelConfig
and its rules. Three AdamW steps of llama `tiny()` must equal the same three steps on one device."""

from __future__ import annotations

import optree
import pytest
import torch

import ndfunc as nf
from models import llama, train
from ndfunc.sharding import NamedSharding, P

pytestmark = pytest.mark.slow  # three llama steps per strategy: minutes in all

MATRIX = {  # name: (dp_replicate, dp_shard, cp, tp)
    "dp": (4, 1, 1, 1),
    "fsdp": (1, 4, 1, 1),
    "tp": (1, 1, 1, 4),
    "cp": (1, 1, 4, 1),
    "hsdp": (2, 2, 1, 1),
    "fsdp_tp": (1, 2, 1, 2),
    "fsdp_cp": (1, 2, 2, 1),
    "hsdp_tp": (2, 2, 1, 2),
    "4d": (1, 2, 2, 2),
    "4d_16": (2, 2, 2, 2),
}
STEPS = 3
# fp32, sums in another order than on one device, compounded over three Adam steps (Adam divides
# by sqrt(v), so early small gradients are amplified): relative 1e-4 on the parameters
RTOL, ATOL = 1e-4, 2e-5


def setup():
    cfg = llama.LlamaConfig.tiny()
    opt = nf.optim.adamw(1e-3, weight_decay=0.1)
    step = train.make_step(cfg, opt)

    g = torch.Generator().manual_seed(0)
    B, L = 8, 16
    batches = [{"tokens": torch.randint(0, cfg.vocab_size, (B, L), generator=g),
                "targets": torch.randint(0, cfg.vocab_size, (B, L), generator=g),
                "positions": torch.arange(L).expand(B, L).contiguous()} for _ in range(STEPS)]
    params = llama.init(cfg, nf.random.key(0))
    return cfg, opt, step, params, batches


def reference():
    cfg, opt, step, params, batches = setup()
    state, losses = opt.init(params), []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, losses


def run_sharded(sizes: tuple[int, ...], transforms=(), layout=None):
    """`layout`: a function of (batch, cp) laying each batch out (nf.zigzag), else as it is."""
    case = setup()  # whole values on this one device (inside the simulation each rank would make them)
    with nf.simulate(nf.ParallelConfig(*sizes).total_size):
        return run_in_this_world(sizes, transforms, layout, case)


def run_in_this_world(sizes: tuple[int, ...], transforms=(), layout=None, case=None):
    """The three steps on the ranks there are (simulated, or real processes under torchrun), from
    `case` (`setup()`, made here if not given): (updated params gathered, losses, the lowered
    program: its cost analysis when asked)."""
    cfg, opt, _, params, batches = case or setup()
    config = nf.ParallelConfig(*sizes)
    step = train.make_step(cfg, opt, config.rules)  # the activations laid out by the rules too
    if layout is not None:
        batches = [layout(b, config.cp_size) for b in batches]
    mesh = config.build_mesh()
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    state = opt.init(params)
    sspec = nf.optim.state_shardings(state, pspec)
    bspec = {k: config.batch_spec for k in batches[0]}
    jitted = nf.jit(step, mesh=mesh, in_shardings=(pspec, sspec, bspec), out_shardings=(pspec, sspec, P()),
                    donate_argnums=(0, 1), transforms=list(transforms))
    put = lambda tree, specs: nf.device_put(tree, optree.tree_map(  # noqa: E731
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)))
    p, s, losses = put(params, pspec), put(state, sspec), []
    for batch in batches:
        p, s, loss = jitted(p, s, batch)
        losses.append(float(nf.device_get(loss)))
    assert jitted.trace_count == 1
    return nf.device_get(p), losses, jitted.lower(p, s, batches[0])


def lowered_step(name: str):
    """The strategy's step lowered for the first batch, on simulated ranks."""
    config = nf.ParallelConfig(*MATRIX[name])
    cfg, opt, _, params, batches = setup()
    with nf.simulate(config.total_size):
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        state = opt.init(params)
        sspec = nf.optim.state_shardings(state, pspec)
        jitted = nf.jit(train.make_step(cfg, opt, config.rules), mesh=config.build_mesh(),
                        in_shardings=(pspec, sspec, {k: config.batch_spec for k in batches[0]}),
                        out_shardings=(pspec, sspec, P()))
        return jitted.lower(params, state, batches[0])


def test_a_plan_does_not_depend_on_what_was_partitioned_before(monkeypatch):
    # tp=4 and dp_shard=4 both partition over one axis of 4, so they share strategies; a
    # constraint's spec (the batch over ('dp_replicate', 'dp_shard')) is another layout on each
    from ndfunc._src.partition.planning import ops
    monkeypatch.setattr(ops, "_CACHE", {})
    alone = lowered_step("tp").cost_analysis()["collectives"]
    monkeypatch.setattr(ops, "_CACHE", {})
    lowered_step("fsdp")
    assert lowered_step("tp").cost_analysis()["collectives"] == alone


@pytest.fixture(scope="module")
def single_device():
    return reference()


@pytest.mark.parametrize("name", list(MATRIX))
def test_three_adamw_steps_equal_the_single_device_run(name, single_device):
    expected_params, expected_losses = single_device
    params, losses, _ = run_sharded(MATRIX[name])
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    paths, leaves, _ = optree.tree_flatten_with_path(params)
    for path, got, want in zip(paths, leaves, optree.tree_leaves(expected_params)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, p=path: f"{nf.tree.keystr(p)}: {m}")


@pytest.mark.parametrize("name", ["fsdp", "4d"])
def test_with_fsdp_resharding_and_prefetch_the_steps_are_the_same(name, single_device):
    expected_params, expected_losses = single_device
    params, losses, lowered = run_sharded(MATRIX[name], [nf.fsdp(("dp_shard", "cp"))])
    costs, plain = lowered.cost_analysis(), run_sharded(MATRIX[name])[2].cost_analysis()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for got, want in zip(optree.tree_leaves(params), optree.tree_leaves(expected_params)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert costs["peak_memory_bytes"] < plain["peak_memory_bytes"]  # gathered weights freed after forward
    # weights gathered again for backward (in 4d over two axes, ('dp_shard', 'cp'): one after the other)
    assert costs["comm_bytes"]["all_gather"] > plain["comm_bytes"]["all_gather"]


@pytest.mark.parametrize("name", ["cp", "fsdp_cp", "4d"])
def test_with_ring_attention_on_zigzag_batches_the_steps_are_the_same(name, single_device):
    # the loss is a mean over tokens, so the zigzag order changes nothing but who holds what;
    # rotary embeddings and the causal mask follow the positions
    expected_params, expected_losses = single_device
    # (eight sequences over one or two data-parallel ranks: flattened to tokens, a rank's are strided,
    # and the plan gathers them over cp there, as it warns)
    with pytest.warns(nf.sharding.ShardingWarning, match=r"sequences a rank, and where it flattens \(batch, sequence\)"):
        params, losses, lowered = run_sharded(MATRIX[name], [nf.ring_attention("cp")], layout=nf.zigzag)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for got, want in zip(optree.tree_leaves(params), optree.tree_leaves(expected_params)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # forward and backward of each of the two layers' attention go round the ring
    assert lowered.cost_analysis()["collectives"]["ppermute"] == 4
