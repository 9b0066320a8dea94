"""Attention as one device-neutral op (`ndfunc.attention`): each kernel against torch's own
`F.scaled_dot_product_attention` and its autograd; the tracer's one op whatever the device; the
kernel the lowering picks per device; the CUDA kernels' calls checked against torch's CUDA ops on
fake CUDA tensors (no GPU needed), and run on a GPU where there is one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import no_gpu_here  # noqa: F401 (a fixture)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

import ndfunc as nf
from ndfunc._src import attention
from ndfunc._src.partition.planning import ops
from ndfunc._src.trace import trace
from ndfunc.sharding import P

B, H, L, S, E = 2, 4, 12, 20, 16
# fp32 kernels and torch's reference differ by summation order only: sums of S products of
# order-1 values, a few fp32 ulps (1.2e-7) times S
FP32 = dict(rtol=1e-5, atol=1e-5)
FP64 = dict(rtol=1e-12, atol=1e-12)


def make(groups=H, dtype=torch.float32, rows=L, cols=S, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, rows, E, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, groups, cols, E, generator=g, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(B, H, rows, E, generator=g, dtype=torch.float64)
    return [x.to(dtype=dtype, device=device) for x in (q, k, v, grad)]


def reference(q, k, v, grad, mask, causal):
    """torch's attention and autograd (its math path: whatever kernel, a different computation
    than any of ours), and the log-sum-exp of its scaled scores."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal,
                                             enable_gqa=k.shape[1] != q.shape[1])
    out.backward(grad)
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(), -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    return [out.detach(), scores.logsumexp(-1), *(x.grad for x in leaves)]


def masks(rows=L, cols=S):
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(B, 1, rows, cols, generator=g) > 0.3
    keep[..., 0] = True  # every query sees a key (torch's reference gives nan where none is)
    return {"none": None, "causal": None, "bool": keep,
            "additive": torch.randn(1, H, rows, cols, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("groups", [H, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
def test_each_kernel_equals_torchs_attention_and_its_gradients(kernel, mask_kind, groups, dtype):
    q, k, v, grad = make(groups, dtype)
    mask = masks()[mask_kind]
    mask = mask.to(dtype) if mask is not None and mask.is_floating_point() else mask
    causal = mask_kind == "causal"
    expected = reference(q, k, v, grad, mask, causal)
    out, lse = attention.attention_op(q, k, v, mask, causal, None, kernel)
    got = [out, lse, *attention.attention_backward_op(grad, q, k, v, out, lse, mask, causal, None, kernel)]
    assert lse.dtype == attention.accumulator(dtype) and lse.shape == (B, H, L)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **(FP32 if dtype == torch.float32 else FP64))


def test_a_query_that_sees_no_key_gets_zeros_from_the_math_kernel():
    # where torch's math path would give nan; the ring merges such rows away by their -inf lse
    q, k, v, grad = make()
    mask = torch.ones(B, 1, L, S, dtype=torch.bool)
    mask[:, :, 3] = False
    out, lse = attention.attention_op(q, k, v, mask, False, None, "math")
    dq, dk, dv = attention.attention_backward_op(grad, q, k, v, out, lse, mask, False, None, "math")
    assert (out[:, :, 3] == 0).all() and (lse[:, :, 3] == -math.inf).all()
    assert (dq[:, :, 3] == 0).all() and all(torch.isfinite(x).all() for x in (dq, dk, dv))


def test_the_tracer_records_one_attention_op_whatever_the_device():
    def step(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum()

    for device in ("cpu", "cuda"):  # CUDA: fake tensors, nothing runs (no GPU is needed)
        with FakeTensorMode(allow_non_fake_inputs=True):
            args = [torch.empty(B, H if i == 0 else 2, L, E, device=device) for i in range(3)]
        targets = [str(n.target) for n in trace(step, args).graph.nodes if n.op == "call_function"]
        assert targets.count("ndfunc.attention.default") == 1, (device, targets)
        assert not [t for t in targets if "scaled_dot_product" in t], (device, targets)


def test_the_gradient_is_one_backward_op_and_matches_torch():
    q, k, v, grad = make(groups=2)

    def loss(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * grad).sum()

    traced = trace(torch.func.grad(loss, argnums=(0, 1, 2)), (q, k, v))
    targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert targets.count("ndfunc.attention_backward.default") == 1
    for a, b in zip(traced(q, k, v), reference(q, k, v, grad, None, True)[2:]):
        torch.testing.assert_close(a, b, **FP32)


def test_what_the_op_does_not_express_stays_torchs():
    # dropout draws from torch's generator (the tracer refuses that); a 3-d query has no heads
    def step(q, k, v):
        return F.scaled_dot_product_attention(q[0], k[0], v[0]).sum()

    q, k, v, _ = make()
    targets = [str(n.target) for n in trace(step, (q, k, v)).graph.nodes if n.op == "call_function"]
    assert "ndfunc.attention.default" not in targets


@pytest.mark.parametrize("device,dtype,head_dim,masked,allowed,expected", [
    ("cpu", torch.float32, 64, False, None, "cpu_flash"),
    ("cpu", torch.bfloat16, 64, True, None, "cpu_flash"),
    ("cuda", torch.bfloat16, 128, False, None, "cuda_flash"),
    ("cuda", torch.float16, 64, True, None, "cuda_efficient"),  # flash takes no mask
    ("cuda", torch.float32, 64, False, None, "cuda_efficient"),  # nor fp32
    ("cuda", torch.bfloat16, 512, False, None, "cuda_efficient"),  # nor head dims over 256
    ("cuda", torch.float64, 64, False, None, "math"),
    ("cuda", torch.bfloat16, 128, False, [SDPBackend.CUDNN_ATTENTION], "cuda_cudnn"),
    ("cuda", torch.bfloat16, 128, False, [SDPBackend.EFFICIENT_ATTENTION], "cuda_efficient"),
    ("cuda", torch.bfloat16, 128, False, [SDPBackend.MATH], "math"),
    ("mps", torch.float32, 64, False, None, "math"),
])
def test_the_kernel_for_each_device_honours_torchs_sdpa_kernel_choice(device, dtype, head_dim, masked, allowed,
                                                                       expected, no_gpu_here):
    if allowed is None:
        assert attention.choose(device, dtype, head_dim, masked) == expected
    else:
        with sdpa_kernel(allowed):
            assert attention.choose(device, dtype, head_dim, masked) == expected


@pytest.mark.parametrize("backend,masked,expected", [
    (SDPBackend.CUDNN_ATTENTION, False, "cuda_cudnn"),  # torch's first on Hopper (2.11)
    (SDPBackend.FLASH_ATTENTION, False, "cuda_flash"),
    (SDPBackend.EFFICIENT_ATTENTION, True, "cuda_efficient"),
    (SDPBackend.MATH, True, "math"),
    (SDPBackend.CUDNN_ATTENTION, True, "cuda_efficient"),  # ours passes cuDNN no mask: the rules' pick
])
def test_with_a_gpu_here_the_kernel_is_the_one_torchs_sdpa_picks(monkeypatch, backend, masked, expected):
    # torch is asked over small tensors (here on the CPU, with what it answers replaced by `backend`)
    asked = []

    def choice(q, k, v, mask):
        asked.append((q.shape, q.dtype, None if mask is None else mask.shape))
        return int(backend.value)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "_PROBE_DEVICE", "cpu")
    monkeypatch.setattr(attention, "sdpa_choice", choice)
    attention._asked_sdpa.cache_clear()  # (what other cases' torch answered)
    assert attention.choose("cuda", torch.float16, 64, masked) == expected
    assert attention.choose("cuda", torch.float16, 64, masked) == expected  # asked once: eager calls choose each time
    assert asked == [((1, 1, 128, 64), torch.float16, (1, 1, 128, 128) if masked else None)]
    attention._asked_sdpa.cache_clear()
    assert attention.choose("cpu", torch.float16, 64, masked) == "cpu_flash"  # the CPU is not asked


def test_torch_is_asked_through_its_own_choice():
    # torch_compat.sdpa_choice is torch's: on the CPU, its flash kernel for fp32 (SDPBackend 1)
    q = torch.zeros(1, 1, 128, 64)
    assert attention.sdpa_choice(q, q, q, None) == SDPBackend.FLASH_ATTENTION.value


@pytest.mark.parametrize("kernel,dtype,masked", [("cuda_flash", torch.bfloat16, False),
                                                 ("cuda_efficient", torch.float32, True),
                                                 ("cuda_efficient", torch.bfloat16, False),
                                                 ("cuda_cudnn", torch.bfloat16, False)])
@pytest.mark.parametrize("groups", [H, 2], ids=["mha", "gqa"])
def test_the_cuda_kernels_call_torchs_cuda_ops_as_their_schemas_and_meta_functions_want(kernel, dtype, masked,
                                                                                      groups):
    # torch's own shape functions for its CUDA kernels, on fake CUDA tensors: the arguments each
    # kernel passes, and the common (B, H, L) log-sum-exp each brings back
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, grad = (torch.empty(x.shape, dtype=dtype, device="cuda") for x in make(groups, rows=L, cols=S))
        mask = torch.empty(B, 1, L, S, dtype=torch.bool, device="cuda") if masked else None
        out, lse = attention.attention_op(q, k, v, mask, False, None, kernel)
        dq, dk, dv = attention.attention_backward_op(grad, q, k, v, out, lse, mask, False, None, kernel)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, dtype, "cuda")
    assert (lse.shape, lse.dtype) == ((B, H, L), torch.float32)
    assert [x.shape for x in (dq, dk, dv)] == [q.shape, k.shape, v.shape]


def test_the_lowering_picks_the_kernel_of_the_device_the_step_runs_on(no_gpu_here):
    def step(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    q, k, v, _ = make(dtype=torch.bfloat16)
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        lowered = nf.jit(step, mesh=mesh, in_shardings=(P("dp"),) * 3).lower(q, k, v)
    assert "'cpu_flash'" in lowered.as_text()
    # and for a step traced on CUDA tensors (fake: nothing runs), the kernel for CUDA
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = [torch.empty(x.shape, dtype=torch.bfloat16, device="cuda") for x in (q, k, v)]
    node = next(n for n in trace(step, fakes).graph.nodes if n.target is attention.attention_op)
    assert ops.rule_of(node.target).local(node, node.args)[-1] == "cuda_flash"


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("groups", [H, 2], ids=["mha", "gqa"])
def test_the_ops_results_are_laid_out_as_their_fake_kernels_say(kernel, masked, groups):
    # torch.compile (nf.jit(compile=True)) holds a custom op to its fake kernel's strides
    q, k, v, grad = (x.float() for x in make(groups))
    mask = masks()["bool"] if masked else None
    real = attention.attention_op(q, k, v, mask, not masked, None, kernel)
    real_grads = attention.attention_backward_op(grad, q, k, v, *real, mask, not masked, None, kernel)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = attention.attention_op(q, k, v, mask, not masked, None, kernel)
        fake_grads = attention.attention_backward_op(grad, q, k, v, *fake, mask, not masked, None, kernel)
    assert [x.stride() for x in (*real, *real_grads)] == [x.stride() for x in (*fake, *fake_grads)]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="runs CUDA's kernels: needs a CUDA device")


@cuda
@pytest.mark.parametrize("kernel,dtype,masked", [("cuda_flash", torch.bfloat16, False),
                                                 ("cuda_efficient", torch.float32, True),
                                                 ("cuda_efficient", torch.bfloat16, False),
                                                 ("cuda_cudnn", torch.bfloat16, False),
                                                 ("math", torch.float32, True)])
@pytest.mark.parametrize("groups", [H, 2], ids=["mha", "gqa"])
def test_the_cuda_kernels_equal_torchs_attention_on_a_gpu(kernel, dtype, masked, groups):
    q, k, v, grad = make(groups, dtype=torch.float64, rows=64, cols=64)
    mask = masks(64, 64)["bool"] if masked else None
    expected = reference(q, k, v, grad, mask, not masked)  # fp64 on CPU
    cu = [x.to(device="cuda", dtype=dtype) for x in (q, k, v, grad)]
    m = None if mask is None else mask.cuda()
    out, lse = attention.attention_op(*cu[:3], m, not masked, None, kernel)
    got = [out, lse, *attention.attention_backward_op(cu[3], *cu[:3], out, lse, m, not masked, None, kernel)]
    tol = FP32 if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)  # bf16: 8 bits of mantissa
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.double().cpu(), b, **tol)


@pytest.mark.parametrize("mask_shape, batch, heads, axes, split", [
    ((4, 4), 4, 2, {"dp": 4}, P("dp")),  # the batch split, and the mask's first dim as long: it is the sequence's
    ((4, 4), 1, 4, {"tp": 4}, P(None, "tp")),  # the heads split, as many as keys
    ((1, 4, 4), 4, 2, {"dp": 4}, P("dp")),  # three dims, as SDPA broadcasts them
    ((16, 16), 1, 1, {"cp": 2}, P(None, None, "cp")),  # the sequence split: the mask's rows follow the queries
])
def test_a_mask_of_fewer_dims_lines_up_with_the_queries_from_the_right(mask_shape, batch, heads, axes, split):
    # SDPA broadcasts a mask from its last dim: an (L, S) mask's first dim is the sequence, whatever
    # the batch or the heads are sized
    g = torch.Generator().manual_seed(0)
    shape = (batch, heads, mask_shape[-1], 8)
    x, y, w = torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(8, 8, generator=g)
    mask = torch.rand(mask_shape, generator=g) > 0.3
    mask[..., 0] = True  # every query sees a key

    def loss(w, x, y):
        return F.mse_loss(F.scaled_dot_product_attention(x @ w, x, x, attn_mask=mask), y)
    with nf.simulate(math.prod(axes.values())):
        jitted = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(**axes), in_shardings=(P(), split, split),
                        out_shardings=(P(), P()))
        got = nf.device_get(jitted(w, x, y))
    want = torch.func.grad_and_value(loss)(w, x, y)
    torch.testing.assert_close(got[0], want[1])
    torch.testing.assert_close(got[1], want[0])


@pytest.mark.parametrize("axis", ["dp", "cp"])
@pytest.mark.parametrize("block", ["mha", "encoder_layer", "causal_encoder_layer"])
def test_torchs_own_attention_modules_train_equal_to_eager_with_their_attention_split(block, axis):
    # nn.MultiheadAttention(need_weights=False), and so TransformerEncoderLayer, calls SDPA from
    # inside a function torch dispatches whole: the tracer sees CPU flash attention itself (whose
    # core decomposition returns the attention weights where its backward reads the logsumexp). It
    # is traced as ndfunc's attention running that kernel: split by the batch or the sequence as
    # any SDPA call, not run whole on every rank (which would warn: an error here)
    torch.manual_seed(0)
    module = (torch.nn.MultiheadAttention(16, 4, batch_first=True) if block == "mha" else
              torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True))
    params, buffers, apply = nf.nn.functional(module)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, 16, generator=g), torch.randn(8, 6, 16, generator=g)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6)

    def loss(p, x, y):
        if block == "mha":
            out = apply(p, buffers, x, x * 1.0, x * 1.0, need_weights=False)[0]
        elif block == "causal_encoder_layer":
            out = apply(p, buffers, x, src_mask=causal, is_causal=True)
        else:
            out = apply(p, buffers, x)
        return F.mse_loss(out, y)
    split = P("dp") if axis == "dp" else P(None, "cp")
    with nf.simulate(2):
        jitted = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(**{axis: 2}), in_shardings=(P(), split, split),
                        out_shardings=(P(), P()))
        got = nf.device_get(jitted(params, x, y))
        text = jitted.lower(params, x, y).as_text()
    assert "attention" in text and "flash_attention_for_cpu" not in text
    want = torch.func.grad_and_value(loss)(params, x, y)
    torch.testing.assert_close(got[0], want[1])
    for k in params:
        torch.testing.assert_close(got[1][k], want[0][k], msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("device,dtype,expected", [("cpu", torch.float32, "math"),
                                                   ("cuda", torch.bfloat16, "cuda_efficient"),
                                                   ("cuda", torch.float64, "math")])
def test_values_of_another_head_dim_than_the_queries_get_a_kernel_that_takes_them(device, dtype, expected,
                                                                                   no_gpu_here):
    # DeepSeek's latent attention: queries and keys of one head dim, values of another. The flash
    # kernels (the CPU's too) and cuDNN take one: the CPU's raised "Q/K/V should have the same head size"
    assert attention.choose(device, dtype, 64, False, value_dim=32) == expected
    assert attention.choose(device, dtype, 64, False, value_dim=64) == attention.choose(device, dtype, 64, False)


@pytest.mark.parametrize("axis", ["dp", "cp"])
def test_attention_over_values_of_another_head_dim_trains_equal_to_eager(axis):
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(2, 2, 8, 12, generator=g), torch.randn(2, 2, 8, 12, generator=g),
                  torch.randn(2, 2, 8, 6, generator=g), torch.randn(6, 6, generator=g))

    def loss(w, q, k, v):
        return F.scaled_dot_product_attention(q, k, v @ w, is_causal=True).square().mean()

    split = P("dp") if axis == "dp" else P(None, None, "cp")
    with nf.simulate(2):
        jitted = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(**{axis: 2}),
                        in_shardings=(P(), split, split, split), out_shardings=(P(), P()))
        got = nf.device_get(jitted(w, q, k, v))
    want = torch.func.grad_and_value(loss)(w, q, k, v)
    torch.testing.assert_close(got[0], want[1])
    torch.testing.assert_close(got[1], want[0])
