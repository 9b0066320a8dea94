"""A compiled step under nf.simulate runs each rank's ops on plain blocks and the collectives over
the ranks' lists (ndfunc._src.simulated_program): bit for bit what torch's simulated-tensor mode
gives (which runs when a dispatch mode of the caller's sits above the simulation), for data and
tensor parallelism, FSDP's gathers and reduce-scatters, ring attention's permutes and axis trades."""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from helpers import tanh_mlp_step
from torch.utils._python_dispatch import TorchDispatchMode

import ndfunc as nf
from ndfunc._src import stages
from ndfunc._src.simulated_program import rank_program
from ndfunc.sharding import P


class Watching(TorchDispatchMode):
    """A caller's dispatch mode above the simulation: every op is seen, so the step runs through
    the simulated-tensor mode, op by op - the reference here."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def both_ways(step, args, **jit_kw):
    """(the direct run's results, the mode's), as plain tensors, and whether the direct one ran."""
    direct_ran = []
    jitted = nf.jit(step, **jit_kw)
    compiled = jitted.lower(*args).compile()
    original = stages.Compiled._on_ranks

    def watch(self, mode):
        ranks, program = original(self, mode)
        direct_ran.append(program is not None)
        return ranks, program

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stages.Compiled, "_on_ranks", watch)
        direct = nf.device_get(compiled(*args))
    with Watching():
        through_mode = compiled(*args)
    return direct, nf.device_get(through_mode), direct_ran == [True]


def identical(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True))


def mlp_inputs(n_layers=3, d=16, batch=8):
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(d, d, generator=g) / 4 for i in range(n_layers)}
    return params, torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)


@pytest.mark.parametrize("axes,pspec,transforms", [
    ({"dp": 2, "tp": 2}, P(None, "tp"), []),
    ({"dp_shard": 4}, P("dp_shard"), "fsdp"),
    ({"dp_replicate": 2, "dp_shard": 2}, P("dp_shard"), "fsdp"),
], ids=["dp_tp", "fsdp", "hsdp"])
def test_a_step_runs_directly_on_the_ranks_blocks_bit_identical_to_the_simulated_tensor_mode(axes, pspec, transforms):
    params, x, y = mlp_inputs()
    opt = nf.optim.adamw(1e-2)
    state = opt.init(params)
    batch_axes = tuple(a for a in axes if a.startswith("dp"))
    pspecs = {k: pspec for k in params}
    sspecs = nf.optim.state_shardings(state, pspecs)
    n = 1
    for size in axes.values():
        n *= size
    with nf.simulate(n):
        mesh = nf.make_mesh(**axes)
        kw = dict(mesh=mesh, in_shardings=(pspecs, sspecs, P(batch_axes), P(batch_axes)),
                  out_shardings=(pspecs, sspecs, P()),
                  transforms=[nf.fsdp("dp_shard")] if transforms == "fsdp" else [])
        direct, through_mode, ran_directly = both_ways(tanh_mlp_step(3, opt), (params, state, x, y), **kw)
    assert ran_directly
    assert identical(direct, through_mode)
    whole = tanh_mlp_step(3, opt)(params, state, x, y)  # and the step itself, on one device
    for a, b in zip(optree.tree_leaves(direct), optree.tree_leaves(whole)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ring_attentions_permutes_run_directly_bit_identical_to_the_mode():
    g = torch.Generator().manual_seed(1)
    q, k, v, w = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(4))

    def step(q, k, v, w):
        return nf.value_and_grad(lambda q, k, v: (F.scaled_dot_product_attention(q, k, v, is_causal=True) * w).sum(),
                                 argnums=(0, 1, 2))(q, k, v)

    seq = P(None, None, "cp")
    with nf.simulate(4):
        mesh = nf.make_mesh(cp=4)
        direct, through_mode, ran_directly = both_ways(
            step, (q, k, v, w), mesh=mesh, in_shardings=(seq,) * 4, out_shardings=(P(), (seq,) * 3),
            transforms=[nf.ring_attention("cp")])
    assert ran_directly and identical(direct, through_mode)
    torch.testing.assert_close(direct[0], step(q, k, v, w)[0], rtol=1e-5, atol=1e-5)


def test_an_axis_trade_runs_directly_bit_identical_to_the_mode():
    x = torch.arange(64.0).reshape(8, 8)
    with nf.simulate(4):
        mesh = nf.make_mesh(a=2, b=2)
        direct, through_mode, ran_directly = both_ways(
            lambda x: nf.with_sharding_constraint(x * 2, P("b", "a")), (x,), mesh=mesh,
            in_shardings=(P("a", "b"),), out_shardings=P("b", "a"))
    assert ran_directly and identical(direct, through_mode) and torch.equal(direct, x * 2)


def test_a_program_with_a_random_op_is_left_to_the_mode():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.bernoulli.p, (x, 0.5)))
    assert rank_program(torch.fx.GraphModule(torch.nn.Module(), graph), (0, 1)) is None
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)),))
    program = rank_program(torch.fx.GraphModule(torch.nn.Module(), graph), (0, 1))
    a, b = torch.ones(2), torch.full((2,), 3.0)
    assert [t.tolist() for t in program([a, b])[0]] == [[2.0, 2.0], [6.0, 6.0]]
