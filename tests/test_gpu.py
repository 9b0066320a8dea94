"""The GPU path (issue 21): what runs on CUDA, and what this CPU-only build can check of it.

Tests marked `gpu` need a CUDA device and are skipped without one; `bash benchmarks/gpu_check.sh`
runs them (and the benchmark) on a GPU machine in one go. The others run everywhere: they lower
steps for CUDA over fake CUDA tensors (`nf.ShapeDtypeStruct(..., device='cuda')`), which a
CPU-only torch allows for forward programs only: its fake CUDA tensors have no device guard, so
indexing one (`x[..., None]`) raises and autograd over one aborts the process. The llama step
itself (a gradient) is therefore checked for CUDA on the GPU alone.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import optree
import pytest
import test_ring
import torch
import torch.nn.functional as F
from helpers import arange, no_gpu_here, torchrun  # noqa: F401 (a fixture)
from torch.nn.attention import SDPBackend, sdpa_kernel

import ndfunc as nf
import ndfunc._src.partition.backends.gloo
from models import llama, train
from ndfunc._src import attention
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.backends import cpu_kernels as kernels
from ndfunc._src.partition.backends import gloo as algorithms
from ndfunc._src.torch_compat import local_blocks
from ndfunc._src.transforms import ring
from ndfunc.sharding import AbstractMesh, NamedSharding, P

WORKER = pathlib.Path(__file__).with_name("gpu_worker.py")
c10d = torch.ops._c10d_functional


def gpu(test):
    """Marked `gpu` (`pytest -m gpu`), and skipped, saying why, where CUDA is absent."""
    return pytest.mark.gpu(pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device: run benchmarks/gpu_check.sh on a GPU machine")(test))


# fp32 on two devices: cuBLAS and MKL, CUDA's memory-efficient attention and the CPU's flash
# attention sum in other orders, a few ulps (1.2e-7) per sum; as tests/test_jit.py allows a sharded
# step against one device's (AdamW's eps 1e-5 below keeps that noise from turning a near-zero
# gradient's first update into a whole step: tests/test_remat.py)
FP32_ACROSS_DEVICES = dict(rtol=1e-4, atol=1e-5)
# bf16 inputs and outputs (8 bits of mantissa: 2**-8 = 0.4% relative), fp32 softmax in every
# kernel: a few roundings of order-1 values, as tests/test_attention.py allows
BF16 = dict(rtol=3e-2, atol=3e-2)
LR, WD, EPS = 1e-3, 0.1, 1e-5


def llama_case(seq: int = 16, **changes):
    """(config, AdamW, params, batch) of the tiny llama on CPU: 8 sequences of `seq` tokens."""
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), **changes)
    params = llama.init(cfg, nf.random.key(0))
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randint(0, cfg.vocab_size, (8, seq), generator=g) for k in ("tokens", "targets")}
    return cfg, nf.optim.adamw(LR, eps=EPS, weight_decay=WD), params, batch


def on(device, tree):
    """Every tensor of `tree` copied to `device`."""
    return optree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def assert_close(got, expected, **tol) -> None:
    got, expected = optree.tree_leaves(nf.device_get(got)), optree.tree_leaves(expected)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.cpu(), b.cpu(), **tol)


def torch_adamw_step(cfg, params, batch):
    """The step as PyTorch users write it: autograd and torch.optim.AdamW, on the params' device."""
    leaves, treespec = optree.tree_flatten(params)
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    tree = optree.tree_unflatten(treespec, leaves)
    optimizer = torch.optim.AdamW(leaves, lr=LR, eps=EPS, weight_decay=WD)
    loss = llama.loss(tree, batch, cfg)
    loss.backward()
    optimizer.step()
    return optree.tree_map(torch.Tensor.detach, tree), loss.detach()


def kernel_names(text: str) -> set[str]:
    return set(re.findall(r"'(cuda_\w+|cpu_flash|math)'", text))


def cpu_kernel_calls(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in kernels.KERNELS]


def stand_in(shape, dtype, device, sharding=None):
    return nf.ShapeDtypeStruct(shape, dtype, sharding=sharding, device=device)


@pytest.fixture
def onednn(monkeypatch):
    """oneDNN's matmuls on, as on an AMD CPU with AVX-512 (an H200 host is often one)."""
    monkeypatch.setattr(kernels, "ONEDNN_MATMUL", True)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)


@pytest.fixture
def no_tf32():
    """fp32 matmuls in fp32, not TF32 (torch's default, said here: a site may change it)."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


# --- CPU-only rewrites never apply to CUDA programs (runs here) ---------------------------------------

def test_onednn_matmuls_never_bind_a_program_for_cuda(onednn):
    a = torch.randn(256, 256)
    gm = nf.jit(torch.mm).lower(a, a).program.local
    assert cpu_kernel_calls(kernels.choose(gm, "cpu"))  # the rewrite is on: CPU programs get it
    assert kernels.choose(gm, "cuda") is gm


@pytest.mark.parametrize("device,rewritten", [("cpu", True), ("cuda", False)])
def test_gloos_all_to_all_forms_never_apply_to_cuda_collectives(monkeypatch, device, rewritten):
    # a group made for several devices ('cpu:gloo,cuda:nccl') says gloo for CPU tensors: the
    # collective's own device keeps CUDA tensors on NCCL's collectives as the partitioner wrote them
    monkeypatch.setattr(ndfunc._src.partition.backends.gloo, "backend_of", lambda group: "gloo")
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        x = stand_in((8, 4), torch.float32, device, NamedSharding(mesh, P("dp")))
        lowered = nf.jit(lambda x: x.sum(0), mesh=mesh, out_shardings=P()).lower(x)
        runs = lowered.compile().runs
    (node, c), = prog.collectives(lowered.program.local)
    assert c.device.type == device and node.target is c10d.all_reduce.default
    assert (runs is not lowered.program.local) is rewritten
    assert any(n.target is c10d.all_to_all_single.default for n in runs.graph.nodes) is rewritten
    # and on NCCL nothing is rewritten, whatever the device
    assert algorithms.for_backend(lowered.program.local, lambda group: "nccl") is lowered.program.local


@pytest.mark.parametrize("where", ["no mesh", "simulated ranks"])
def test_a_cuda_program_keeps_atens_matmuls_wherever_its_ranks_come_from(onednn, where):
    # what runs would still be right (cpu_kernels.mm runs aten's on CUDA operands), but a CUDA
    # program must not be rewritten for a CPU, nor name oneDNN in its text
    if where == "no mesh":
        a = stand_in((256, 256), torch.float32, "cuda")
        compiled = nf.jit(torch.mm).lower(a, a).compile()
    else:
        with nf.simulate(2):
            mesh = nf.make_mesh(dp=2)
            a = stand_in((256, 256), torch.float32, "cuda", NamedSharding(mesh, P("dp")))
            compiled = nf.jit(torch.mm, mesh=mesh).lower(a, a).compile()
    assert not cpu_kernel_calls(compiled.runs)


# --- lowered for CUDA without a GPU (runs here) ----------------------------------------------------

def attention_step(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


@pytest.mark.parametrize("spec", [P("dp"), P(None, "tp"), P("dp", "tp")], ids=["batch", "heads", "both"])
@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, "cuda_flash"), (torch.float32, "cuda_efficient")])
def test_attention_lowered_for_cuda_runs_cudas_kernel_through_the_strategies(spec, dtype, expected, no_gpu_here):
    mesh = AbstractMesh({"dp": 2, "tp": 2})
    shape = (4, 8, 64, 64)  # (B, H, L, K)
    lowered = {device: nf.jit(attention_step, mesh=mesh).lower(
        *[stand_in(shape, dtype, device, NamedSharding(mesh, spec)) for _ in range(3)]) for device in ("cpu", "cuda")}
    text = lowered["cuda"].as_text()
    assert kernel_names(text) == {expected}, text
    assert kernel_names(lowered["cpu"].as_text()) == {"cpu_flash"}
    # the kernel is the device's; the split, the collectives and the flops are the same
    cuda, cpu = (lowered[d].cost_analysis() for d in ("cuda", "cpu"))
    assert cuda["flops"] == cpu["flops"] > 0 and cuda["collectives"] == cpu["collectives"]


def test_ring_attention_lowered_for_cuda_runs_a_cuda_kernel_round_the_ring(no_gpu_here):
    # each rank's block of the causal sequence is masked against the others': the kernel that takes
    # a mask (flash takes none). Read off the program: its text needs fake CUDA indexing (coords[axis])
    mesh = AbstractMesh({"cp": 2})
    seq = NamedSharding(mesh, P(None, None, "cp"))
    args = [stand_in((2, 8, 64, 64), torch.bfloat16, "cuda", seq) for _ in range(3)]
    lowered = nf.jit(attention_step, mesh=mesh, transforms=[nf.ring_attention("cp")]).lower(*args)
    ring_nodes = [n for n in lowered.program.local.graph.nodes if n.target is ring.ring_forward]
    assert [n.kwargs["kernel"] for n in ring_nodes] == ["cuda_efficient"]


# --- on a GPU ------------------------------------------------------------------------------------------

@gpu
def test_a_world_of_one_nccl_process_under_torchrun():
    # nf.init() (NCCL), a mesh of one rank on CUDA, device_put/device_get of CUDA blocks, the llama
    # step on it against eager CUDA and the CPU step, and no CPU-only rewrite in what runs
    proc = torchrun(WORKER, nproc=1)
    assert "rank 0: nccl world of one ok" in proc.stdout, proc.stdout + proc.stderr


@gpu
def test_simulated_ranks_hold_and_compute_on_cuda_blocks(no_tf32):
    # nf.simulate keeps each rank's block where the value was (LocalTensor runs on one device):
    # CUDA values give CUDA blocks, on a mesh whose fake process group says 'cpu'
    full, w = arange((8, 4)).cuda(), arange((4, 3)).cuda() / 10
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        x = nf.device_put(full, NamedSharding(mesh, P("dp")))
        blocks = local_blocks(x.to_local())
        back = nf.device_get(x)
        f = nf.jit(lambda w, x: (x @ w).sum(), mesh=mesh, in_shardings=(P(), P("dp")), out_shardings=P())
        out = nf.device_get(f(w, x))
    assert {b.device.type for b in blocks.values()} == {"cuda"}
    assert torch.equal(blocks[1].cpu(), full[4:].cpu())
    assert back.device.type == "cuda" and torch.equal(back, full)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out, (full @ w).sum(), rtol=1e-6, atol=1e-4)


@gpu
def test_the_jitted_llama_step_on_cuda_equals_eager_on_cuda_and_the_cpu_step(no_tf32):
    cfg, opt, params, batch = llama_case()
    step = train.make_step(cfg, opt)
    state = opt.init(params)
    on_cpu = nf.jit(step)(params, state, batch)
    args = on("cuda", (params, state, batch))
    jitted = nf.jit(step)
    got = jitted(*args)
    assert all(x.device.type == "cuda" for x in optree.tree_leaves(got))
    assert_close(got, step(*args), **FP32_ACROSS_DEVICES)  # the pure step, eager (torch.func)
    assert_close(got, on_cpu, **FP32_ACROSS_DEVICES)
    new_params, loss = torch_adamw_step(cfg, args[0], args[2])  # autograd and torch.optim.AdamW
    assert_close((got[0], got[2]), (new_params, loss), **FP32_ACROSS_DEVICES)
    # fp32 causal attention: CUDA's memory-efficient kernel (flash takes half precision only)
    cuda, cpu = jitted.lower(*args), nf.jit(step).lower(params, state, batch)
    assert kernel_names(cuda.as_text()) == {"cuda_efficient"}
    assert cuda.cost_analysis()["flops"] == cpu.cost_analysis()["flops"]


@gpu
def test_the_compiled_llama_step_on_cuda_equals_eager_and_writes_into_the_donated_buffers(no_tf32):
    # nf.jit(compile=True): the local program through torch.compile (Inductor's CUDA kernels)
    cfg, opt, params, batch = llama_case()
    args = on("cuda", (params, opt.init(params), batch))
    expected = train.make_step(cfg, opt)(*args)  # the pure step, eager
    new_params, loss = torch_adamw_step(cfg, args[0], args[2])  # autograd and torch.optim.AdamW
    donated = optree.tree_map(torch.clone, args[:2])
    buffers = [x.data_ptr() for x in optree.tree_leaves(donated)]
    got = nf.jit(train.make_step(cfg, opt), donate_argnums=(0, 1), compile=True)(*donated, args[2])
    assert_close(got, expected, **FP32_ACROSS_DEVICES)
    assert_close((got[0], got[2]), (new_params, loss), **FP32_ACROSS_DEVICES)
    assert [x.to_local().data_ptr() if hasattr(x, "to_local") else x.data_ptr()
            for x in optree.tree_leaves(got[:2])] == buffers


SDPA_KERNELS = {SDPBackend.FLASH_ATTENTION: "cuda_flash", SDPBackend.EFFICIENT_ATTENTION: "cuda_efficient",
                SDPBackend.CUDNN_ATTENTION: "cuda_cudnn", SDPBackend.MATH: "math"}


@gpu
def test_the_mixed_precision_llama_step_on_cuda_runs_sdpas_kernel_and_keeps_fp32_masters():
    # the kernel torch's SDPA runs for the model's bf16 attention on this GPU (cuDNN on an H200 with torch 2.11)
    cfg, opt, params, batch = llama_case()
    q = torch.empty(8, cfg.n_heads, 16, cfg.dim // cfg.n_heads, dtype=torch.bfloat16, device="cuda")
    sdpas = SDPA_KERNELS[SDPBackend(torch._fused_sdp_choice(q, q, q, None, 0.0, True))]
    step = train.make_step(cfg, opt)
    args = on("cuda", (params, opt.init(params), batch))
    bf16 = nf.mixed_precision(torch.bfloat16, torch.float32)
    jitted = nf.jit(step, transforms=[bf16])
    new_params, state, loss = jitted(*args)
    assert {x.dtype for x in optree.tree_leaves((new_params, state)) if x.is_floating_point()} == {torch.float32}
    assert kernel_names(jitted.lower(*args).as_text()) == {sdpas}
    with bf16.tracing():  # the same casts, eager
        _, _, eager_loss = step(*args)
    _, _, fp32_loss = step(*args)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-2, atol=0)  # bf16: 2**-8 relative, a few of them
    torch.testing.assert_close(loss, fp32_loss, rtol=2e-2, atol=0)


@gpu
@pytest.mark.parametrize("backend,expected", [(SDPBackend.FLASH_ATTENTION, "cuda_flash"),
                                              (SDPBackend.EFFICIENT_ATTENTION, "cuda_efficient"),
                                              (SDPBackend.CUDNN_ATTENTION, "cuda_cudnn")])
@pytest.mark.parametrize("spec", [None, P("dp"), P(None, "dp")], ids=["one-device", "batch", "heads"])
def test_each_cuda_attention_kernel_through_the_strategies_equals_torchs_attention(backend, expected, spec):
    # the kernel sdpa_kernel allows; the batch or the heads split over 2 simulated ranks
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(2, 4, 128, 64, generator=g, dtype=torch.float64) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    loss = (F.scaled_dot_product_attention(*leaves, is_causal=True) * w).sum()  # fp64 on CPU: torch's math
    expected_grads = torch.autograd.grad(loss, leaves)
    cu = [x.to("cuda", torch.bfloat16) for x in (q, k, v, w)]

    def step(q, k, v, w):
        return nf.grad(lambda q, k, v: (F.scaled_dot_product_attention(q, k, v, is_causal=True) * w).sum(),
                       argnums=(0, 1, 2))(q, k, v)

    with sdpa_kernel([backend]):
        if spec is None:
            jitted = nf.jit(step)
            got, text = jitted(*cu), jitted.lower(*cu).as_text()
        else:
            with nf.simulate(2):
                jitted = nf.jit(step, mesh=nf.make_mesh(dp=2), in_shardings=(spec,) * 4, out_shardings=(spec,) * 3)
                got, text = nf.device_get(jitted(*cu)), jitted.lower(*cu).as_text()
    assert kernel_names(text) == {expected}, text
    for a, b in zip(got, expected_grads):
        torch.testing.assert_close(a.double().cpu(), b, **BF16)


@gpu
@pytest.mark.parametrize("length", [
    pytest.param(32, marks=pytest.mark.xfail(strict=True, reason=(
        "open: on an H200 (torch 2.11) the ring over CUDA's memory-efficient kernel with 8 keys a block "
        "gives a loss of -3.318 where full attention gives -4.035; the math kernel's ring, and one "
        "8-key block alone, are right"))),
    64,  # 16 keys a block: right
])
def test_ring_attention_on_simulated_cuda_ranks_equals_full_attention(no_tf32, monkeypatch, length):
    monkeypatch.setattr(test_ring, "L", length)  # the sequence test_ring.inputs makes
    (q, k, v, w), positions = test_ring.inputs(layout="zigzag")
    q, k, v, w = (x[:1, :1] for x in (q, k, v, w))
    args = on("cuda", (q, k, v, positions[:1], w))
    expected = test_ring.attention_step(*args)  # torch's attention on CUDA, the whole sequence
    seq = P(None, None, "cp")
    with nf.simulate(test_ring.N):
        step = nf.jit(test_ring.attention_step, mesh=nf.make_mesh(cp=test_ring.N),
                      in_shardings=(seq, seq, seq, P(None, "cp"), seq), out_shardings=(P(), (seq, seq, seq)),
                      transforms=[nf.ring_attention("cp")])
        got = nf.device_get(step(*args))
        lowered = step.lower(*args)
        text, costs = lowered.as_text(), lowered.cost_analysis()
    assert costs["collectives"]["ppermute"] == 2  # K and V round the ring
    assert kernel_names(text) == {"cuda_efficient"}
    assert_close(got, expected, **FP32_ACROSS_DEVICES)


@gpu
def test_remat_on_cuda_keeps_the_step_and_trades_flops_for_memory(no_tf32):
    cfg, opt, params, batch = llama_case(seq=64, n_layers=4)  # activations worth saving: tests/test_remat.py
    args = on("cuda", (params, opt.init(params), batch))
    expected = train.make_step(cfg, opt)(*args)
    costs = {}
    for policy in (None, "full"):
        step = nf.jit(train.make_step(dataclasses.replace(cfg, remat=policy), opt))
        assert_close(step(*args), expected, **FP32_ACROSS_DEVICES)
        costs[policy] = step.lower(*args).cost_analysis()
    assert costs["full"]["flops"] > costs[None]["flops"]
    assert costs["full"]["peak_memory_bytes"] < costs[None]["peak_memory_bytes"]


@gpu
def test_a_cuda_step_runs_right_with_the_cpu_matmul_rewrite_on(onednn, no_tf32):
    # were the rewrite to bind a CUDA program's matmuls, they would still run as aten's on CUDA
    # operands: the same cuBLAS call
    a = torch.randn(256, 256, device="cuda")
    torch.testing.assert_close(nf.jit(torch.mm)(a, a), a @ a, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("layer", ["lstm", "gru"])
def test_a_recurrent_layer_on_cuda_runs_cudnn_forward_and_backward_split_by_the_batch(layer, no_tf32):
    # ndfunc::rnn runs torch's kernel for the device (cuDNN), and its gradient makes the forward
    # again in training mode (cuDNN differentiates only those)
    torch.manual_seed(0)
    module = (torch.nn.LSTM if layer == "lstm" else torch.nn.GRU)(16, 64, num_layers=2, batch_first=True).cuda()
    params, buffers, apply = nf.nn.functional(module)
    x = torch.randn(8, 12, 16, device="cuda")
    loss = lambda p, x: apply(p, buffers, x)[0].square().mean()  # noqa: E731
    want_grads, want_loss = torch.func.grad_and_value(loss)(params, x)
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                      out_shardings=(P(), P()))
        got_loss, got_grads = nf.device_get(step(params, x))
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grads, want_grads, rtol=1e-4, atol=1e-5)


@gpu
def test_a_mixture_of_experts_on_cuda_runs_transformers_grouped_matmuls_on_each_ranks_tokens():
    # ndfunc::experts runs the implementation the config names (grouped: torch's grouped_mm kernel
    # in bf16 on CUDA) on each rank's own tokens; the eager bf16 model on CUDA is the reference
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=64, attn_implementation="sdpa")
    model = transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
    params, buffers, apply = nf.nn.functional(model)
    ids = torch.randint(0, 64, (8, 32), device="cuda")
    loss = lambda p, ids: apply(p, buffers, ids, labels=ids).loss  # noqa: E731
    want_grads, want_loss = torch.func.grad_and_value(loss)(params, ids)
    with nf.simulate(2):
        mesh = nf.make_mesh(dp_shard=2)
        spec = nf.nn.partition_specs(model, mesh, fsdp="dp_shard")
        step = nf.jit(nf.value_and_grad(loss), mesh=mesh, in_shardings=(spec, P("dp_shard")), out_shardings=(P(), spec))
        got_loss, got_grads = nf.device_get(step(params, ids))
    torch.testing.assert_close(got_loss, want_loss, **BF16)
    for k, g in got_grads.items():
        torch.testing.assert_close(g.float(), want_grads[k].float(), **BF16)
