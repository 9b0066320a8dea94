"""nf.jit(compile=True): each rank's local program through torch.compile. The same step as the
eager one, results in the donated buffers, simulated ranks run op by op. (On gloo processes:
tests/jit_worker.py; on CUDA: tests/test_gpu.py and benchmarks/gpu_step.py.)"""

import optree
import pytest
import torch
from test_jit import llama_step

import ndfunc as nf
from models import train
from ndfunc._src import stages
from ndfunc._src.partition.backends import cpu_kernels
from ndfunc.sharding import P


TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, as tests/test_jit.py compares a sharded step to the unsharded one


def test_a_compiled_step_equals_the_eager_step_and_writes_into_the_donated_buffers():
    # Inductor's fused kernels round otherwise than the op-by-op step (its own pow, sums in another
    # order). Compared where that noise stays noise: an Adam eps that keeps near-zero gradients'
    # updates from turning it into whole steps (lr / eps = 10, not 1e5)
    cfg, _, params, _, batch = llama_step()
    opt = nf.optim.adamw(1e-3, eps=1e-4, weight_decay=0.1)
    step = train.make_step(cfg, opt)
    state = opt.init(params)
    expected = step(params, state, batch)  # the pure step, eager
    jitted = nf.jit(step, donate_argnums=(0, 1), compile=True)
    donated = optree.tree_map(torch.clone, (params, state))
    buffers = [x.data_ptr() for x in optree.tree_leaves(donated)]
    got = jitted(*donated, batch)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, **TOL)
    assert [x.data_ptr() for x in optree.tree_leaves(got[:2])] == buffers
    again = jitted(*got[:2], batch)  # the second step runs the compiled program again
    for a, b in zip(optree.tree_leaves(again), optree.tree_leaves(step(*expected[:2], batch))):
        torch.testing.assert_close(a, b, **TOL)
    assert jitted.trace_count == 1


def test_a_compiled_program_leaves_its_matmuls_to_inductor(monkeypatch):
    # on an AMD CPU with AVX-512 an op-by-op program calls oneDNN for big fp32 matmuls
    # (backends.cpu_kernels), which Inductor cannot lower: a compiled one keeps aten's and lets
    # Inductor choose. Asked on any machine with the choice turned on.
    monkeypatch.setattr(cpu_kernels, "ONEDNN_MATMUL", True)
    x, w = torch.randn(256, 128), torch.randn(128, 256)  # 8M multiply-adds, over ONEDNN_MIN_MACS
    kernels = lambda compiled: {n.target for n in compiled.runs.graph.nodes} & cpu_kernels.KERNELS  # noqa: E731
    if torch.backends.mkldnn.enabled:  # (a torch built without oneDNN never chooses it)
        assert kernels(nf.jit(torch.matmul).lower(x, w).compile())
    compiled = nf.jit(torch.matmul, compile=True)
    assert not kernels(compiled.lower(x, w).compile())
    torch.testing.assert_close(compiled(x, w), x @ w)


def test_simulated_ranks_run_the_program_op_by_op(monkeypatch):
    def never(gm, backend):
        def run(*args):
            raise AssertionError("a simulated step ran the compiled program")
        return run

    monkeypatch.setattr(stages, "compiled_program", never)
    _, step, params, state, batch = llama_step()
    expected = step(params, state, batch)
    with nf.simulate(2):
        jitted = nf.jit(step, mesh=nf.make_mesh(dp=2), in_shardings=(P(), P(), P("dp")), compile=True)
        got = nf.device_get(jitted(params, state, batch))
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, **TOL)


def test_compile_takes_a_flag_or_a_backends_name():
    with pytest.raises(TypeError) as e:
        nf.jit(lambda x: x, compile=1.0)
    assert str(e.value) == ("nf.jit: compile= takes True (Inductor), False, or a torch.compile backend's name "
                            "such as 'inductor'; got 1.0.")
    assert nf.jit(lambda x: x * 2, compile="aot_eager")(torch.ones(2)).tolist() == [2.0, 2.0]
