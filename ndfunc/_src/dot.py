"""A product of two tensors over some of their dims, traced with every other dim kept as it is.

PyTorch traces `einsum("bld,dhk->blhk", x, wq)`, `x_BLD @ w` and `F.linear` of a 3-D input as a
view of the input to (B*L, D), a `mm` and a view back. Where the batch is split over the
data-parallel axes and the sequence over `cp`, each rank's tokens are strided in that flattened
dim: no layout of it is a split of (B*L), so the partitioner gathered the whole sequence over `cp`
before every linear layer. XLA's `dot_general` keeps the batch and sequence dims apart. So does
`ndfunc::dot`:

    dot(x, w, dims)          x (*A, *C), w (*C, *O) -> (*A, *O)    x's last `dims` dims with w's first
    dot_leading(x, y, dims)  x (*B, *C), y (*B, *O) -> (*C, *O)    their first `dims` dims (a weight's
                                                                   gradient: over every token)

Each is one contraction, with a rule (`planning/dots.py`) that splits any dim of the result as its
operand is split, and leaves a sum pending where the contracted dims are split alike. On each rank
the blocks are contiguous, so the lowering flattens them there and multiplies them with `mm`.
Their gradients are dots again (`_Dot`, `_DotLeading`).

`TRACED_AS` holds the tracer's forms of `torch.einsum`, `torch.matmul` / `@` and `F.linear`
(`traced_as.TRACED_AS` takes them in): a product of a batch of rows and a weight, or an einsum of
two operands without dims both keep (no batched matmul), of real floating tensors of one dtype,
outside autocast and any `torch.func` transform but a gradient, is one `dot`; anything else is
torch's own.
"""

from __future__ import annotations

import math
import string

import torch

from ndfunc._src import torch_compat

_lib = torch.library.Library("ndfunc", "FRAGMENT")
_lib.define("dot(Tensor x, Tensor w, int dims, Tensor? bias=None) -> Tensor")
_lib.define("dot_leading(Tensor x, Tensor y, int dims) -> Tensor")


def _dot(x: torch.Tensor, w: torch.Tensor, dims: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    lead, out = x.shape[:x.dim() - dims], w.shape[dims:]
    m, k, n = math.prod(lead), math.prod(w.shape[:dims]), math.prod(out)
    x2, w2 = x.reshape(m, k), w.reshape(k, n)
    made = torch.mm(x2, w2) if bias is None else torch.addmm(bias.reshape(n), x2, w2)
    return made.view(*lead, *out)


def _dot_leading(x: torch.Tensor, y: torch.Tensor, dims: int) -> torch.Tensor:
    left, right = x.shape[dims:], y.shape[dims:]
    m = math.prod(x.shape[:dims])
    return torch.mm(x.reshape(m, math.prod(left)).t(), y.reshape(m, math.prod(right))).view(*left, *right)


_lib.impl("dot", _dot, "CompositeExplicitAutograd")
_lib.impl("dot_leading", _dot_leading, "CompositeExplicitAutograd")
torch.library.register_fake("ndfunc::dot", lambda x, w, dims, bias=None: x.new_empty(*x.shape[:x.dim() - dims],
                                                                                      *w.shape[dims:]), lib=_lib)
torch.library.register_fake("ndfunc::dot_leading", lambda x, y, dims: x.new_empty(*x.shape[dims:], *y.shape[dims:]),
                            lib=_lib)
dot_op = torch.ops.ndfunc.dot.default
dot_leading_op = torch.ops.ndfunc.dot_leading.default


def _transposed(t: torch.Tensor, first: int) -> torch.Tensor:
    """`t` with its first `first` dims moved after the others."""
    return t.permute(*range(first, t.dim()), *range(first))


class _Dot(torch.autograd.Function):
    """`ndfunc::dot`; its gradients: x's a `dot` of the incoming gradient with w's dims turned
    round, w's a `dot_leading` of x and the incoming gradient, the bias's the incoming gradient
    summed over x's kept dims."""

    @staticmethod
    def forward(x, w, dims, bias):
        return dot_op(x, w, dims, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, ctx.dims, _ = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        dims, kept = ctx.dims, x.dim() - ctx.dims
        gx = _Dot.apply(grad, _transposed(w, dims), w.dim() - dims, None) if ctx.needs_input_grad[0] else None
        gw = _DotLeading.apply(x, grad, kept) if ctx.needs_input_grad[1] else None
        gb = grad.sum(list(range(kept))) if ctx.needs_input_grad[3] else None
        return gx, gw, None, gb


class _DotLeading(torch.autograd.Function):
    """`ndfunc::dot_leading`; its gradients are `dot`s of the other operand and the incoming one."""

    @staticmethod
    def forward(x, y, dims):
        return dot_leading_op(x, y, dims)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, ctx.dims = inputs
        ctx.save_for_backward(x, y)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        left = x.dim() - ctx.dims  # grad: (*x's kept dims, *y's kept dims)
        gx = _Dot.apply(y, _transposed(grad, left), y.dim() - ctx.dims, None) if ctx.needs_input_grad[0] else None
        gy = _Dot.apply(x, grad, left, None) if ctx.needs_input_grad[1] else None
        return gx, gy, None


def dot(x: torch.Tensor, w: torch.Tensor, dims: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (*A, *C) times w (*C, *O) over C, the last `dims` dims of x: (*A, *O), as one `ndfunc::dot`;
    `bias` (*O), added as `addmm` adds it (rounded once, with the product)."""
    return _Dot.apply(x, w, dims, bias)


def _takes(*tensors: torch.Tensor) -> bool:
    """Whether a product of `tensors` can be a `dot`: real floating tensors of one dtype and device,
    no autocast on that device (it would cast aten's product, not this op), and no `torch.func`
    transform but a gradient (the op has no batching or forward-mode rule)."""
    first = tensors[0]
    return (all(isinstance(t, torch.Tensor) and t.dtype == first.dtype and t.device == first.device
                for t in tensors)
            and first.is_floating_point() and not torch.is_autocast_enabled(first.device.type)
            and torch_compat.func_transforms() in ([], ["Grad"]))


def _rows_times_matrix(x, w) -> bool:
    """Whether `x @ w` is a batch of rows (x of 3 dims or more) times a matrix that can be a `dot`:
    torch flattens x's leading dims into one, which the partitioner cannot split where the batch
    and the sequence are split over different axes."""
    return (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() >= 3 and w.dim() == 2
            and x.shape[-1] == w.shape[0] and _takes(x, w))


def _rows_times_matrix_as_dot(own):
    """`own` (a matmul of torch's) traced as a `dot` where it is a batch of rows times a matrix."""
    def traced(x, w, **kwargs):
        return dot(x, w, 1) if kwargs.get("out") is None and _rows_times_matrix(x, w) else own(x, w, **kwargs)
    return traced


def _linear(input, weight, bias=None):
    """`F.linear` of a batch of rows (3 dims or more) as a `dot` with the weight's transpose. A bias
    is added as ATen's `linear` adds it: inside the product (`addmm`) for a contiguous input, after
    it for another (in bfloat16 the two round differently)."""
    if not (_takes(input, weight) and input.dim() >= 3 and weight.dim() == 2 and input.shape[-1] == weight.shape[1]
            and (bias is None or (isinstance(bias, torch.Tensor) and bias.dtype == input.dtype))):
        return torch.nn.functional.linear(input, weight, bias)
    if bias is not None and input.is_contiguous() and bias.shape == weight.shape[:1]:
        return dot(input, weight.t(), 1, bias)
    out = dot(input, weight.t(), 1)
    return out if bias is None else out + bias


def _einsum(*args):
    """`torch.einsum` of two operands over dims only one keeps (`"bld,dhk->blhk"`, `"bhlk,hkd->bld"`)
    as a `dot`: each operand permuted to put the contracted dims last (the first) and next to each
    other, the result permuted to the order asked. Dims both keep (a batched matmul), a dim summed
    out of one operand alone, a repeated letter, or a shape einsum broadcasts: torch's own."""
    found = _contraction(args)
    if found is None:
        return torch.einsum(*args)
    return _contract(*found)


def _contraction(args) -> tuple | None:
    """(x, w, x's letters, w's letters, the result's letters, x's kept letters, w's kept letters,
    the contracted ones) of an einsum call `_einsum` takes as a `dot`, ellipses spelled out; None
    for any other."""
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        args = (args[0], *args[1])
    if len(args) != 3 or not isinstance(args[0], str):
        return None
    equation, x, w = args
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and _takes(x, w)):
        return None
    equation = equation.replace(" ", "")
    inputs, arrow, out = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        return None
    spare = iter(c for c in string.ascii_letters if c not in equation)
    ellipsis = ""
    if "..." in equation:
        if "..." in terms[1] or terms[0].count("...") != 1 or (arrow and out.count("...") != 1):
            return None  # (an ellipsis both operands have broadcasts, which a `dot` does not)
        n = x.dim() - len(terms[0].replace("...", ""))
        if n < 0:
            return None
        ellipsis = "".join(next(spare) for _ in range(n))
    xs, ws = terms[0].replace("...", ellipsis), terms[1]
    if not arrow:  # the implicit form: the letters that appear once, in alphabetical order (after an ellipsis)
        out = ellipsis + "".join(sorted(c for c in set(xs + ws) if (xs + ws).count(c) == 1 and c not in ellipsis))
    out = out.replace("...", ellipsis)
    letters = xs + ws + out
    if not all(c in string.ascii_letters for c in letters) or len(xs) != x.dim() or len(ws) != w.dim():
        return None
    if len(set(xs)) != len(xs) or len(set(ws)) != len(ws) or len(set(out)) != len(out):
        return None
    kept_x = [c for c in xs if c in out]
    kept_w = [c for c in ws if c in out]
    contracted = [c for c in xs if c in ws]
    if (set(kept_x) & set(ws) or set(kept_w) & set(xs) or set(out) - set(xs) - set(ws)
            or set(xs) - set(out) - set(ws) or set(ws) - set(out) - set(xs)
            or not (kept_x and kept_w and contracted)):
        return None
    if any(x.shape[xs.index(c)] != w.shape[ws.index(c)] for c in contracted):
        return None
    return x, w, xs, ws, out, kept_x, kept_w, contracted


def _contract(x, w, xs: str, ws: str, out: str, kept_x: list, kept_w: list, contracted: list) -> torch.Tensor:
    x_order = [xs.index(c) for c in (*kept_x, *contracted)]
    w_order = [ws.index(c) for c in (*contracted, *kept_w)]
    x = x if x_order == sorted(x_order) else x.permute(x_order)
    w = w if w_order == sorted(w_order) else w.permute(w_order)
    made = dot(x, w, len(contracted))
    made_letters = kept_x + kept_w
    order = [made_letters.index(c) for c in out]
    return made if order == sorted(order) else made.permute(order)


TRACED_AS = {torch.einsum: _einsum, torch.nn.functional.linear: _linear,
             **{own: _rows_times_matrix_as_dot(own) for own in (torch.matmul, torch.Tensor.matmul,
                                                                  torch.Tensor.__matmul__)}}
