"""Scaled-dot-product attention as one device-neutral op, and the kernels that run it.

Traced, `F.scaled_dot_product_attention` (without dropout) is one `ndfunc.attention` node and its
gradient one `ndfunc.attention_backward` node, whatever the device: PyTorch's own dispatch would
record the CPU flash kernel on CPU and, on CUDA, whichever of its kernels it picks, each with its
own outputs, so the partitioner's rule, the flop count, `nf.remat` and `nf.ring_attention` would
each have to know them all. Here they read one op:

    attention(q, k, v, attn_mask, is_causal, scale, kernel) -> (out, logsumexp)
    attention_backward(grad_out, q, k, v, out, logsumexp, attn_mask, is_causal, scale, kernel)
        -> (dq, dk, dv)

q is (B, H, L, E), k and v (B, G, S, E) with G dividing H (grouped key/value heads, as
`enable_gqa=True`); `attn_mask` is boolean (True: may attend) or additive, broadcastable to
(B, H, L, S); `is_causal` is the top-left aligned causal mask, as torch's. `logsumexp` is each
query's log-sum-exp of its scaled scores, (B, H, L) in float32 (float64 for float64 inputs), the
same whichever kernel made it: a backward (or `nf.ring_attention`'s merge of blocks) may use another
kernel than its forward.

`kernel` names what runs it (`KERNELS`); "auto" is `choose(...)` for the tensors' device at the
call. The lowering fixes it for the mesh's device: the CPU flash kernel on CPU; on CUDA flash
(fp16/bf16, no mask), memory-efficient (any mask, fp32 too), cuDNN, as torch's
`torch.nn.attention.sdpa_kernel` allows them when the step is lowered; else "math", plain ops that
run anywhere. The CUDA kernels' extra outputs (dropout's random state, which with no dropout
nothing reads) are not kept; their log-sum-exps are brought to the common shape (the
memory-efficient kernel's is padded to a multiple of 32 queries, cuDNN's has a trailing 1).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend

from ndfunc._src import swaps
from ndfunc._src.contexts import set_within
from ndfunc._src.torch_compat import sdpa_choice

aten = torch.ops.aten

_lib = torch.library.Library("ndfunc", "FRAGMENT")
_lib.define("attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, bool is_causal=False, "
            "float? scale=None, str kernel='auto') -> (Tensor, Tensor)")
_lib.define("attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
            "Tensor logsumexp, Tensor? attn_mask=None, bool is_causal=False, float? scale=None, "
            "str kernel='auto') -> (Tensor, Tensor, Tensor)")
attention_op = torch.ops.ndfunc.attention.default
attention_backward_op = torch.ops.ndfunc.attention_backward.default
_KERNEL_SLOT = {attention_op: 6, attention_backward_op: 9}


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype: float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


# --- the kernels -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Kernel:
    """One way to run attention: `forward(q, k, v, mask, causal, scale) -> (out, lse)` and
    `backward(grad_out, q, k, v, out, lse, mask, causal, scale) -> (dq, dk, dv)`, both over the
    op's arguments (grouped heads, a boolean or additive mask, `scale` given)."""

    forward: Callable
    backward: Callable


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: may attend) as the kernels take it: 0 where allowed, -inf where not."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    allowed, masked = (torch.scalar_tensor(x, dtype=dtype, device=mask.device) for x in (0.0, -math.inf))
    return torch.where(mask, allowed, masked)  # one op, as torch's SDPA converts it


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped key/value heads repeated to the query heads they serve."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_expand`: the query heads a key/value head served, summed into it."""
    return dx if dx.shape[1] == groups else dx.unflatten(1, (groups, dx.shape[1] // groups)).sum(2)


def _four_dims(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask of 1 or 3 dims with leading ones: CPU's flash kernel takes 2 or 4 (SDPA broadcasts any)."""
    return mask if mask is None or mask.ndim in (2, 4) else mask.view((1,) * (4 - mask.ndim) + tuple(mask.shape))


def _cpu_flash_forward(q, k, v, mask, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=additive(_four_dims(mask), q.dtype), scale=scale)


def _cpu_flash_backward(g, q, k, v, out, lse, mask, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, causal, attn_mask=additive(_four_dims(mask), q.dtype), scale=scale)


def _bias(mask, causal: bool, rows: int, cols: int, dtype, device) -> torch.Tensor | None:
    """The additive bias of a mask and/or the top-left causal mask."""
    bias = additive(mask, dtype)
    if causal:
        allowed = torch.ones(rows, cols, dtype=torch.bool, device=device).tril()
        tri = torch.zeros(rows, cols, dtype=dtype, device=device).masked_fill(~allowed, -math.inf)
        bias = tri if bias is None else bias + tri
    return bias


def _probabilities(q, k, mask, causal, scale, lse=None):
    """Scaled scores' softmax (and their log-sum-exp), in the accumulator dtype; a query that may
    attend to no key gets all zeros (and a log-sum-exp of -inf)."""
    acc = accumulator(q.dtype)
    scores = (q.to(acc) @ _expand(k, q.shape[1]).to(acc).transpose(-2, -1)) * scale
    bias = _bias(mask, causal, q.shape[2], k.shape[2], acc, q.device)
    if bias is not None:
        scores = scores + bias
    if lse is None:
        lse = scores.logsumexp(-1)
    shift = lse.masked_fill(lse == -math.inf, 0.0).unsqueeze(-1)
    return torch.exp(scores - shift), lse


def _math_forward(q, k, v, mask, causal, scale):
    p, lse = _probabilities(q, k, mask, causal, scale)
    out = (p @ _expand(v, q.shape[1]).to(p.dtype)).to(q.dtype)
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse  # laid out as the flash kernels lay it


def _math_backward(g, q, k, v, out, lse, mask, causal, scale):
    p, _ = _probabilities(q, k, mask, causal, scale, lse)
    acc, heads, groups = p.dtype, q.shape[1], k.shape[1]
    g32 = g.to(acc)
    dv = p.transpose(-2, -1) @ g32
    dp = g32 @ _expand(v, heads).to(acc).transpose(-2, -1)
    ds = p * (dp - (g32 * out.to(acc)).sum(-1, keepdim=True))
    dq = (ds @ _expand(k, heads).to(acc)) * scale
    dk = (ds.transpose(-2, -1) @ q.to(acc)) * scale
    return dq.to(q.dtype), _fold(dk, groups).to(k.dtype), _fold(dv, groups).to(v.dtype)


def _cuda_flash_forward(q, k, v, mask, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), 0.0,
                                                            causal, False, scale=scale)
    return out, lse


def _cuda_flash_backward(g, q, k, v, out, lse, mask, causal, scale):
    heads, groups = q.shape[1], k.shape[1]
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout's random state: none is read
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        g.contiguous(), q, _expand(k, heads), _expand(v, heads), out, lse, None, None, q.shape[2], k.shape[2], 0.0,
        causal, seed, offset, scale=scale)
    return dq, _fold(dk, groups), _fold(dv, groups)


_LSE_ALIGN = 32  # the memory-efficient kernel's log-sum-exp: queries padded to a multiple of this


def _aligned_bias(mask, q, k) -> torch.Tensor | None:
    """The mask as the memory-efficient kernel takes it: additive, (B, H, L, S), its rows 16-aligned
    in memory (as torch pads it)."""
    bias = additive(mask, q.dtype)
    if bias is None:
        return None
    b, h, rows, cols = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    bias = bias.to(q.dtype).expand(b, h, rows, cols)
    if cols % 16:
        padded = torch.zeros(b, h, rows, -(-cols // 16) * 16, dtype=q.dtype, device=q.device)
        bias = padded[..., :cols].copy_(bias)
    return bias


def _cuda_efficient_forward(q, k, v, mask, causal, scale):
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
        q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), _aligned_bias(mask, q, k), True, 0.0, causal, scale=scale)
    return out, lse[..., :q.shape[2]]


def _cuda_efficient_backward(g, q, k, v, out, lse, mask, causal, scale):
    heads, groups, rows = q.shape[1], k.shape[1], q.shape[2]
    padded = torch.nn.functional.pad(lse, (0, -(-rows // _LSE_ALIGN) * _LSE_ALIGN - rows))
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        g.contiguous(), q, _expand(k, heads), _expand(v, heads), _aligned_bias(mask, q, k), out, padded, seed, seed,
        0.0, [True, True, True, False], causal, scale=scale)
    return dq, _fold(dk, groups), _fold(dv, groups)


def _cuda_cudnn_forward(q, k, v, mask, causal, scale):
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(
        q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), None, True, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3])


def _cuda_cudnn_backward(g, q, k, v, out, lse, mask, causal, scale):
    heads, groups = q.shape[1], k.shape[1]
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        g.contiguous(), q, _expand(k, heads), _expand(v, heads), out, lse.unsqueeze(-1), seed, seed, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale)
    return dq, _fold(dk, groups), _fold(dv, groups)


KERNELS = {
    "cpu_flash": Kernel(_cpu_flash_forward, _cpu_flash_backward),
    "cuda_flash": Kernel(_cuda_flash_forward, _cuda_flash_backward),
    "cuda_efficient": Kernel(_cuda_efficient_forward, _cuda_efficient_backward),
    "cuda_cudnn": Kernel(_cuda_cudnn_forward, _cuda_cudnn_backward),
    "math": Kernel(_math_forward, _math_backward),
}
_HALF = (torch.float16, torch.bfloat16)


def choose(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool, value_dim: int | None = None) -> str:
    """The kernel (a `KERNELS` name) for attention on `device_type` over `dtype` with head dim
    `head_dim` (the values' `value_dim`, where it differs: DeepSeek's latent attention), with an
    explicit mask or not. On CUDA, where a GPU is here, the kernel torch's SDPA would pick
    (`torch._fused_sdp_choice`: its priorities for this GPU, cuDNN first on Hopper, and the
    `sdpa_kernel` flags); else the first of flash, memory-efficient and cuDNN that takes these
    inputs and that the flags allow; else math. The flash kernels (the CPU's too) and cuDNN take
    one head dim for queries and values."""
    value_dim = head_dim if value_dim is None else value_dim
    same = value_dim == head_dim
    if device_type == "cpu":
        return "cpu_flash" if same and dtype in (*_HALF, torch.float32, torch.float64) else "math"
    if device_type == "cuda":
        picked = _sdpa_choice(dtype, head_dim, masked, value_dim) if torch.cuda.is_available() else None
        if picked is not None:
            return picked
        flags = torch.backends.cuda
        if flags.flash_sdp_enabled() and same and dtype in _HALF and not masked and head_dim % 8 == 0 and \
                head_dim <= 256:
            return "cuda_flash"
        if flags.mem_efficient_sdp_enabled() and dtype in (*_HALF, torch.float32) and all(
                d % (8 if dtype in _HALF else 4) == 0 for d in (head_dim, value_dim)):
            return "cuda_efficient"
        if flags.cudnn_sdp_enabled() and same and dtype in _HALF and not masked and head_dim % 8 == 0 and \
                head_dim <= 128:
            return "cuda_cudnn"
    return "math"


_SDPA_KERNELS = {SDPBackend.FLASH_ATTENTION.value: "cuda_flash", SDPBackend.EFFICIENT_ATTENTION.value: "cuda_efficient",
                 SDPBackend.CUDNN_ATTENTION.value: "cuda_cudnn", SDPBackend.MATH.value: "math"}
_PROBE_DEVICE = "cuda"  # where `_sdpa_choice` asks torch


def _sdpa_choice(dtype: torch.dtype, head_dim: int, masked: bool, value_dim: int) -> str | None:
    """What torch's SDPA runs on this GPU for such inputs; None where it is no kernel of ours
    (cuDNN with a mask: ours passes none). Asked once per inputs and `sdpa_kernel` flags: an eager
    call ("auto") chooses on every call."""
    flags = torch.backends.cuda
    return _asked_sdpa(dtype, head_dim, masked, value_dim, flags.flash_sdp_enabled(),
                       flags.mem_efficient_sdp_enabled(), flags.cudnn_sdp_enabled(), flags.math_sdp_enabled())


@functools.lru_cache(maxsize=256)
def _asked_sdpa(dtype: torch.dtype, head_dim: int, masked: bool, value_dim: int, *flags: bool) -> str | None:
    """`_sdpa_choice`, asked of torch over small tensors (`flags`: part of the key only)."""
    q = torch.empty((1, 1, 128, head_dim), dtype=dtype, device=_PROBE_DEVICE)
    v = q if value_dim == head_dim else torch.empty((1, 1, 128, value_dim), dtype=dtype, device=_PROBE_DEVICE)
    mask = torch.ones((1, 1, 128, 128), dtype=torch.bool, device=_PROBE_DEVICE) if masked else None
    picked = _SDPA_KERNELS.get(sdpa_choice(q, q, v, mask))
    return None if picked == "cuda_cudnn" and masked else picked


# --- the ops ---------------------------------------------------------------------------------

def default_scale(q: torch.Tensor, scale: float | None) -> float:
    """`scale`, or torch's default: one over the square root of the head dim."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _kernel(name: str, q: torch.Tensor, v: torch.Tensor, mask) -> Kernel:
    if name == "auto":
        name = choose(q.device.type, q.dtype, q.shape[-1], mask is not None, v.shape[-1])
    return KERNELS[name]


def _laid_out(x: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """`x` with strides `stride` (a copy only where they differ): what the ops return is laid out as
    their fake kernels say, which a compiler of the program (torch.compile) holds them to."""
    if x.stride() == tuple(stride):
        return x
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)


def _out_stride(b: int, h: int, rows: int, e: int) -> tuple[int, ...]:
    """The output's strides, laid out (B, L, H, E) in memory as torch's flash and memory-efficient
    kernels make it: the heads' merge that follows (transpose, reshape) is then a view, not a copy."""
    return rows * h * e, e, h * e, 1


def _forward(q, k, v, attn_mask=None, is_causal=False, scale=None, kernel="auto"):
    out, lse = _kernel(kernel, q, v, attn_mask).forward(q, k, v, attn_mask, is_causal, default_scale(q, scale))
    return _laid_out(out, _out_stride(*out.shape)), lse.contiguous()


def _backward(g, q, k, v, out, lse, attn_mask=None, is_causal=False, scale=None, kernel="auto"):
    grads = _kernel(kernel, q, v, attn_mask).backward(g, q, k, v, out, lse, attn_mask, is_causal,
                                                   default_scale(q, scale))
    return tuple(_laid_out_like(d, x) for d, x in zip(grads, (q, k, v)))


def _laid_out_like(d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`d`, a kernel's new tensor, laid out as `empty_like(x)` (the fake kernel's). Where it has
    `x`'s strides already, those describe a dense block, which `empty_like` keeps: no meta tensor
    made per call."""
    return d if d.stride() == x.stride() else _laid_out(d, torch.empty_like(x, device="meta").stride())


def _forward_meta(q, k, v, attn_mask=None, is_causal=False, scale=None, kernel="auto"):
    b, h, rows, _ = q.shape
    shape = (b, h, rows, v.shape[-1])
    return q.new_empty_strided(shape, _out_stride(*shape)), q.new_empty(q.shape[:-1], dtype=accumulator(q.dtype))


def _backward_meta(g, q, k, v, out, lse, attn_mask=None, is_causal=False, scale=None, kernel="auto"):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_lib.impl("attention", _forward, "CompositeExplicitAutograd")
_lib.impl("attention_backward", _backward, "CompositeExplicitAutograd")
torch.library.register_fake("ndfunc::attention", _forward_meta, lib=_lib)
torch.library.register_fake("ndfunc::attention_backward", _backward_meta, lib=_lib)


def with_kernel(op, args: tuple, kernel: str) -> tuple:
    """`args` of an `attention`/`attention_backward` call with its kernel set to `kernel`."""
    slot = _KERNEL_SLOT[op]
    schema = op._schema.arguments
    full = list(args) + [a.default_value for a in schema[len(args):slot]]
    return (*full[:slot], kernel)


def argument(node: torch.fx.Node, name: str):
    """The value of argument `name` of a node (an `attention`/`attention_backward` one, or of the
    kernels they run)."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, a.default_value)
    raise KeyError(name)


class _Attention(torch.autograd.Function):
    """`ndfunc.attention` with `ndfunc.attention_backward` as its gradient (a Function: torch.func's
    transforms trace through it; the mask gets no gradient)."""

    @staticmethod
    def forward(q, k, v, mask, causal, scale):
        return attention_op(q, k, v, mask, causal, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, ctx.causal, ctx.scale = inputs
        ctx.save_for_backward(q, k, v, mask, *output)
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # no zeros made for the log-sum-exp's (absent) gradient

    @staticmethod
    def backward(ctx, grad_out, _):
        q, k, v, mask, out, lse = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None, None
        dq, dk, dv = attention_backward_op(grad_out, q, k, v, out, lse, mask, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def traced_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` as the tracer records it: one `ndfunc.attention`. What the op
    does not express (dropout, a mask that needs a gradient, grouped heads without `enable_gqa`,
    other ranks than 4) is torch's own."""
    own = (query.ndim == key.ndim == value.ndim == 4 and dropout_p == 0.0
           and (attn_mask is None or (not attn_mask.requires_grad and not is_causal))
           and (key.shape[1] == query.shape[1] or (enable_gqa and query.shape[1] % key.shape[1] == 0))
           and key.shape[1] == value.shape[1])
    if not own:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    # a boolean mask made additive in the program, as torch's own SDPA does (so the partitioner
    # lays out, and the memory model counts, what the kernels read)
    out, _ = _Attention.apply(query, key, value, additive(attn_mask, query.dtype), is_causal, scale)
    return out


_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("ndfunc_attention_traced", default=False)


# how the tracer records torch's attention (`traced_as.TRACED_AS` takes it in)
TRACED_AS = {torch.nn.functional.scaled_dot_product_attention: traced_sdpa}


def traced() -> contextlib.AbstractContextManager:
    """Inside (in this thread and context, with `swaps.swapped()`, as the tracer enters both),
    transformers' SDPA attention passes grouped key/value heads to `F.scaled_dot_product_attention`
    as they are (`enable_gqa`), with a mask too: it repeats them for each query head where a mask is
    given, because CUDA's fused kernels take no mask with grouped heads; traced, the call is one
    `ndfunc.attention`, whose kernels read them grouped (and repeat them locally where they must).
    A sequence split over `cp` then gathers the keys and values once, not once per query head
    (Llama 3 8B's dims: 1/4 of the bytes)."""
    return set_within(_TRACING)


@swaps.register("transformers.integrations.sdpa_attention", "use_gqa_in_sdpa")  # (ndfunc never imports it)
def _grouped_when_traced(theirs: Callable) -> Callable:
    def use_gqa_in_sdpa(*args, **kwargs):
        return True if _TRACING.get() else theirs(*args, **kwargs)

    return use_gqa_in_sdpa


_CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def cpu_flash_as_attention(gm: torch.fx.GraphModule) -> None:
    """CPU flash attention's forward and backward nodes in a traced step (an SDPA call the tracer did
    not see as one: inside a function torch dispatches whole, as `nn.MultiheadAttention`'s), without
    dropout, as `ndfunc.attention` and `ndfunc.attention_backward` running that same kernel: the same
    outputs, laid out by the attention rule (batch and heads split, `nf.ring_attention`'s ring)
    instead of run whole on every rank."""
    changed = False
    for node in [*gm.graph.find_nodes(op="call_function", target=_CPU_FLASH),
                 *gm.graph.find_nodes(op="call_function", target=_CPU_FLASH_BACKWARD)]:
        if argument(node, "dropout_p") != 0.0:
            continue
        op = attention_op if node.target is _CPU_FLASH else attention_backward_op
        args = (*(argument(node, a.name) for a in op._schema.arguments[:_KERNEL_SLOT[op]]), "cpu_flash")
        with gm.graph.inserting_before(node):
            made = gm.graph.call_function(op, args)
        made.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        fakes = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        made.meta["val"] = op(*fakes)
        node.replace_all_uses_with(made)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
