"""Run by tests/test_jit_gloo.py under torchrun: nf.jit in 4 real processes over gloo.

Each rank compiles its own program (the same plan on every rank), runs it, and checks the gathered
results against the unsharded step computed locally, and the collectives that ran against the
lowered program's count. Any failure raises, so torchrun exits non-zero.
"""

import optree
import test_ring
import torch
from test_jit import (  # this folder is first on sys.path under torchrun
    jit_llama,
    llama_case,
)
from test_jit_partition import C10D, CountRun, adam_step, data

import ndfunc as nf
from ndfunc.sharding import P


def check(got, expected, **tol) -> None:
    for a, b in zip(optree.tree_leaves(nf.device_get(got)), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, **tol)


def mlp_dp_tp(rank: int) -> None:
    params, x, y = data(1)
    opt, step = adam_step()
    state = opt.init(params)
    expected = step(params, state, x, y)
    mesh = nf.make_mesh(dp=2, tp=2)
    specs = {"w1": P(None, "tp"), "w2": P("tp", None)}
    sspecs = nf.optim.state_shardings(state, specs)
    jitted = nf.jit(step, mesh=mesh, in_shardings=(specs, sspecs, P("dp"), P("dp")), out_shardings=(specs, sspecs, P()))
    lowered = jitted.lower(params, state, x, y)
    program = lowered.cost_analysis()["collectives"]
    with CountRun() as ran:
        out = jitted(params, state, x, y)
    # what ran is the program as it runs on gloo: some reductions as all-to-alls, one for one
    runs = {kind: sum(n.target is op for n in lowered.compile().runs.graph.nodes) for kind, op in C10D.items()}
    assert ran.counts == runs and sum(runs.values()) == sum(program.values()), (rank, ran.counts, runs, program)
    check(out, expected, rtol=1e-5, atol=1e-5)
    print(f"rank {rank}: mlp dp x tp ok {program}", flush=True)


def mlp_dp_tp_compiled(rank: int) -> None:
    # an Adam step over dp x tp through torch.compile: its all-reduces inside the compiled graph
    params, x, y = data(1)
    opt, step = adam_step()
    state = opt.init(params)
    expected = step(params, state, x, y)
    specs = {"w1": P(None, "tp"), "w2": P("tp", None)}
    sspecs = nf.optim.state_shardings(state, specs)
    jitted = nf.jit(step, mesh=nf.make_mesh(dp=2, tp=2), in_shardings=(specs, sspecs, P("dp"), P("dp")),
                    out_shardings=(specs, sspecs, P()), compile=True)
    assert jitted.lower(params, state, x, y).cost_analysis()["collectives"]  # there are some
    check(jitted(params, state, x, y), expected, rtol=1e-5, atol=1e-5)
    print(f"rank {rank}: mlp dp x tp compiled ok", flush=True)


def llama_strategy(rank: int, strategy: str, axes: dict) -> None:
    jitted, p, s, batch, expected, _ = jit_llama(strategy, nf.make_mesh(**axes), llama_case(), donate_argnums=(0, 1))
    check(jitted(p, s, batch), expected, rtol=1e-4, atol=1e-5)
    print(f"rank {rank}: llama {strategy} ok", flush=True)


def ring_compiled(rank: int) -> None:
    # the ring's point-to-point exchanges run as they are between the compiled graphs
    (q, k, v, w), positions = test_ring.inputs(layout="zigzag")
    args = (*(x[:1, :1] for x in (q, k, v)), positions[:1], w[:1, :1])
    expected = test_ring.attention_step(*args)  # torch's attention over the whole sequence
    seq = P(None, None, "cp")
    step = nf.jit(test_ring.attention_step, mesh=nf.make_mesh(cp=4), in_shardings=(seq, seq, seq, P(None, "cp"), seq),
                  out_shardings=(P(), (seq, seq, seq)), transforms=[nf.ring_attention("cp")], compile=True)
    check(step(*args), expected, rtol=1e-5, atol=1e-5)
    print(f"rank {rank}: ring compiled ok", flush=True)


def main() -> None:
    nf.init()
    rank = nf.rank()
    assert nf.world_size() == 4
    mlp_dp_tp(rank)
    llama_strategy(rank, "fsdp", dict(dp=4))
    llama_strategy(rank, "dp_tp", dict(dp=2, tp=2))
    # the local program through torch.compile: Inductor's kernels, the collectives as they are
    mlp_dp_tp_compiled(rank)
    ring_compiled(rank)
    nf.shutdown()


if __name__ == "__main__":
    main()
