"""The local program's fp32 matmuls on CPU as oneDNN's (ndfunc._src.partition.backends.cpu_kernels): which run as
oneDNN's, and that those agree with a float64 product within fp32's rounding bound, as aten's do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ndfunc as nf
from ndfunc._src.partition.backends import cpu_kernels as kernels
from ndfunc.sharding import P

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="oneDNN's matmul comes with torch's x86 builds only, and this torch has none")

ONEDNN, MM, BMM = "mkldnn::_linear_pointwise", "aten::mm", "aten::bmm"


def ran(f):
    """f's result, and the names of the ops that ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = f()
    return out, {e.key for e in prof.key_averages()}


def within_rounding(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """|out - a @ b| within the fp32 dot product's bound, k u (|a| @ |b|), against the float64 product."""
    k, u = a.shape[-1], 2.0 ** -24
    exact = a.double() @ b.double()
    return bool(((out.double() - exact).abs() <= k * u * (a.double().abs() @ b.double().abs())).all())


def layouts(m: int, k: int, n: int, g: torch.Generator) -> dict:
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {"contiguous": (r(m, k), r(k, n)), "a transposed": (r(k, m).t(), r(k, n)),
            "b transposed": (r(m, k), r(n, k).t()), "both transposed": (r(k, m).t(), r(n, k).t()),
            "a every other column": (r(m, 2 * k)[:, ::2], r(k, n)), "b a column slice": (r(m, k), r(k, n + 9)[:, 5:-4]),
            "a one row broadcast": (r(1, k).expand(m, k), r(k, n)), "a at an offset": (r(m + 7, k)[7:], r(k, n)),
            "a parameter": (torch.nn.Parameter(r(m, k), requires_grad=False), r(k, n))}


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.setattr(kernels, "ONEDNN_MATMUL", True)


@pytest.mark.parametrize("layout", list(layouts(1, 1, 1, torch.Generator())))
def test_a_matmul_runs_as_onednns_and_is_within_fp32_rounding_of_the_exact_product(layout):
    a, b = layouts(256, 192, 128, torch.Generator().manual_seed(0))[layout]
    out, ops = ran(lambda: kernels.mm(a, b))
    assert ONEDNN in ops and MM not in ops
    assert out.shape == (256, 128) and out.is_contiguous()
    assert within_rounding(out, a, b)
    assert within_rounding(torch.mm(a, b), a, b)  # the bound is one aten's result meets too


def test_a_batch_of_one_matrix_runs_as_onednns_into_a_tensor_of_its_own_strided_as_atens():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(1, 256, 192, generator=g), torch.randn(1, 192, 128, generator=g)
    out, ops = ran(lambda: kernels.bmm(a, b))
    assert ONEDNN in ops and BMM not in ops
    assert out.shape == (1, 256, 128) and out.stride() == torch.bmm(a, b).stride() and out._base is None
    assert within_rounding(out[0], a[0], b[0])


def test_a_second_operand_with_overlapping_rows_runs_as_atens():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(256, 256, generator=g), torch.randn(600, generator=g).unfold(0, 256, 1)[:256]
    out, ops = ran(lambda: kernels.mm(a, b))  # oneDNN refuses such strides
    assert ONEDNN not in ops and torch.equal(out, torch.mm(a, b))


def test_a_transposed_first_operand_above_the_copy_bound_runs_as_atens(monkeypatch):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(192, 256, generator=g).t(), torch.randn(192, 128, generator=g)
    monkeypatch.setattr(kernels, "ONEDNN_COPY_MAX", a.numel() * 4 - 1)
    out, ops = ran(lambda: kernels.mm(a, b))
    assert ONEDNN not in ops and torch.equal(out, torch.mm(a, b))
    monkeypatch.setattr(kernels, "ONEDNN_COPY_MAX", a.numel() * 4)
    assert ONEDNN in ran(lambda: kernels.mm(a, b))[1]


def einsum_step(x, w):
    return torch.einsum("bld,dk->blk", x, w).tanh() @ w.T


def as_close_as_eager(f, out, *args) -> bool:
    """out within twice the distance of eager's fp32 result from the float64 one."""
    exact = f(*(x.double() for x in args))
    return bool((out.double() - exact).abs().max() <= 2 * (f(*args).double() - exact).abs().max())


@pytest.mark.parametrize("on", [True, False])
def test_a_jitted_step_runs_its_fp32_matmuls_as_onednns_when_on_and_as_atens_when_off(monkeypatch, on):
    monkeypatch.setattr(kernels, "ONEDNN_MATMUL", on)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 128, 256, generator=g), torch.randn(256, 192, generator=g)
    compiled = nf.jit(einsum_step).lower(x, w).compile()  # profiled apart from tracing, which runs aten's
    out, ops = ran(lambda: compiled(x, w))
    assert (ONEDNN in ops) is on and (MM in ops or BMM in ops) is not on
    assert as_close_as_eager(einsum_step, out, x, w)


@pytest.mark.parametrize("m, k, n, dtype, takes", [
    (128, 128, 128, torch.float32, True), (128, 128, 127, torch.float32, False),  # the bound, and just below
    (32, 2048, 32, torch.float32, True),  # m k n at the bound, however thin
    (256, 256, 256, torch.float64, False), (256, 256, 256, torch.bfloat16, False)])
def test_the_program_binds_fp32_matmuls_of_at_least_the_bound_to_onednn(onednn, m, k, n, dtype, takes):
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    compiled = nf.jit(torch.mm).lower(a, b).compile()
    out, ops = ran(lambda: compiled(a, b))
    assert (ONEDNN in ops) is takes and (MM in ops) is not takes
    assert within_rounding(out, a, b) if dtype is torch.float32 else torch.equal(out, torch.mm(a, b))


def test_a_program_keeps_atens_matmul_where_onednn_is_disabled_or_the_mesh_is_not_on_cpu(onednn, monkeypatch):
    a = torch.randn(256, 256)
    with monkeypatch.context() as disabled:
        disabled.setattr(torch.backends.mkldnn, "enabled", False)
        compiled = nf.jit(torch.mm).lower(a, a).compile()
    assert ONEDNN not in ran(lambda: compiled(a, a))[1]
    gm = nf.jit(torch.mm).lower(a, a).program.local
    assert kernels.choose(gm, "cuda") is gm
    assert kernels.choose(gm, "cpu") is not gm


def test_a_jitted_step_over_an_unfolded_operand_is_right(onednn):
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(600, generator=g), torch.randn(256, 256, generator=g)
    f = lambda x, w: w @ x.unfold(0, 256, 1)[:256]  # noqa: E731
    torch.testing.assert_close(nf.jit(f)(x, w), f(x, w))


def test_simulated_ranks_run_the_kernel_a_real_rank_runs(onednn):
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(2, 128, 256, generator=g), torch.randn(256, 192, generator=g)
    with nf.simulate(2):
        mesh = nf.make_mesh(dp_shard=2)
        f = nf.jit(einsum_step, mesh=mesh, in_shardings=(P("dp_shard"), P()), out_shardings=P("dp_shard"))
        compiled = f.lower(x, w).compile()
        out, ops = ran(lambda: nf.device_get(compiled(x, w)))
    assert ONEDNN in ops  # each simulated rank's block is a plain tensor, as a real rank's is
    assert as_close_as_eager(einsum_step, out, x, w)


# one fresh process (an import is seconds): imported with the variable at 1, then the module
# read again with each other value
ON_IMPORT = """
import importlib, os
from ndfunc._src.partition.backends import cpu_kernels
print("1", cpu_kernels.ONEDNN_MATMUL)
for value in ("0", "yes"):
    os.environ["NDFUNC_ATEN_MATMUL"] = value
    try:
        print(value, importlib.reload(cpu_kernels).ONEDNN_MATMUL)
    except ValueError as e:
        print(value, "ValueError:", e)
"""


@pytest.mark.slow
def test_ndfunc_aten_matmul_1_keeps_atens_matmul_and_another_value_is_refused():
    proc = subprocess.run([sys.executable, "-c", ON_IMPORT], capture_output=True, text=True,
                          env=dict(os.environ, NDFUNC_ATEN_MATMUL="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "1 False"
    assert lines[1] in ("0 True", "0 False")  # 0 leaves the choice to ndfunc (by the CPU)
    assert lines[2] == ("yes ValueError: NDFUNC_ATEN_MATMUL must be 1 (every matmul as aten's) or 0 or unset "
                        "(ndfunc's choice), not 'yes'")
