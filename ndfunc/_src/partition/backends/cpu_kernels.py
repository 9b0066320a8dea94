"""Which kernel runs the local program's fp32 matmuls (and its accumulating index_puts) on CPU.

PyTorch runs an fp32 `mm` on CPU through MKL's sgemm, and MKL picks its code path by CPU vendor:
on an AMD CPU it takes the AVX2 path whatever the chip offers. On an AMD EPYC with AVX-512 that
path reaches about 106 GFLOP/s on one core, where oneDNN's matmul (the kernel PyTorch itself
uses for reduced-precision matmuls on CPU) reaches 170-245 on a llama's shapes
(`python benchmarks/cpu_matmul.py`). So there (AMD, AVX-512, torch built with MKL and oneDNN,
oneDNN enabled) `choose` binds the program's fp32 `mm`s, and its `bmm`s of one matrix (what
`einsum` makes of a projection), of at least `ONEDNN_MIN_MACS` multiply-adds to oneDNN's matmul.
Smaller ones stay with aten: oneDNN's call costs about 12 us against aten's 1, and the two break
even near 128 x 128 x 128. Others (`addmm`, batched `bmm`) stay with aten too.

At run time a bound matmul still runs as aten's unless its operands are plain CPU tensors (a
simulated rank's block is one, as `simulated_program` runs it; a `LocalTensor` is not), the second lies row- or column-major without overlap (oneDNN
takes it as it lies), and the first is row-major or at most `ONEDNN_COPY_MAX` bytes: oneDNN reads
it row-major, so a transposed one (a weight's gradient, `x.T @ dy`) is copied first, a transient
`cost_analysis` does not count.

The arithmetic is fp32 products summed in fp32 (oneDNN's default, no reduced-precision mode), in
another order: results stay within fp32's rounding bound of the exact product, though further from
it than MKL's (about twice on a llama's shapes, up to four times for sums of thousands of terms).
Every rank runs the same kernel for the same shapes, so values the ranks compute alike stay alike.

`ONEDNN_MATMUL` is read when a step is compiled: set it to False, or the environment variable
`NDFUNC_ATEN_MATMUL=1` before ndfunc is imported, to run every matmul as aten's.

One more CPU kernel keeps ranks alike: `index_put` with `accumulate=True` (the backward of
indexing a tensor by rows: a mixture of experts' `weights[expert_ids]`) adds rows that collide
in whatever order CPU threads take them, so two ranks computing one replicated value from the
same inputs hold it differently in its last bits, and their replicas drift apart. With one integer
index it runs as `index_add`, which adds them in index order (`index_put_in_order`).
"""

from __future__ import annotations

import math
import os

import torch

from ndfunc._src.partition.program import shape_dtype
from ndfunc._src.torch_compat import onednn_available, onednn_linear

aten = torch.ops.aten
ONEDNN_MIN_MACS = 128 * 128 * 128
ONEDNN_COPY_MAX = 16 * 2**20
_MM, _BMM = aten.mm.default._op, aten.bmm.default._op


def _mkl_takes_a_slow_path() -> bool:
    """Whether torch's fp32 `mm` is MKL's on an AMD CPU with AVX-512, and oneDNN is built in."""
    if not (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
            and onednn_available()):
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:  # not Linux: keep PyTorch's own choice
        return False
    return vendor in ("AuthenticAMD", "HygonGenuine")


def _asked_for_aten() -> bool:
    value = os.environ.get("NDFUNC_ATEN_MATMUL", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"NDFUNC_ATEN_MATMUL must be 1 (every matmul as aten's) or 0 or unset (ndfunc's choice), "
                         f"not {value!r}")
    return value == "1"


ONEDNN_MATMUL = not _asked_for_aten() and _mkl_takes_a_slow_path()


_onednn = onednn_linear


def _plain(t: torch.Tensor) -> bool:
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.layout is torch.strided


def _takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether oneDNN takes these operands (2-D) as they lie, `a` copied at most ONEDNN_COPY_MAX."""
    (k, n), (s0, s1) = b.shape, b.stride()
    return (_plain(a) and _plain(b) and a.device.type == "cpu"
            and ((s1 == 1 and s0 >= n) or (s0 == 1 and s1 >= k))
            and (a.is_contiguous() or a.numel() * a.element_size() <= ONEDNN_COPY_MAX))


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`aten.mm(a, b)`, as oneDNN's matmul where it takes the operands (see the module docstring)."""
    return _onednn(a, b) if _takes(a, b) else _MM(a, b)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`aten.bmm(a, b)` of one matrix each, as `mm`."""
    a0, b0 = a[0], b[0]
    if not _takes(a0, b0):
        return _BMM(a, b)
    return _onednn(a0, b0).unsqueeze_(0)  # in place: a tensor of its own, as aten's, not a view


_INDEX_PUT = aten.index_put.default._op


def index_put_in_order(x: torch.Tensor, indices: list, values: torch.Tensor,
                       accumulate: bool = False) -> torch.Tensor:
    """`aten.index_put`; with `accumulate` and one integer index, CPU tensors, as `index_add` (see
    the module docstring): the rows of `values` added to `x`'s in index order."""
    index = indices[0] if len(indices) == 1 else None
    if not (accumulate and index is not None and _plain(x) and x.device.type == "cpu"
            and index.dtype in (torch.int64, torch.int32) and values.dtype == x.dtype):
        return _INDEX_PUT(x, indices, values, accumulate)
    rows = x.shape[0]
    flat = torch.where(index < 0, index + rows, index).reshape(-1)
    return x.index_add(0, flat, values.expand(*index.shape, *x.shape[1:]).reshape(-1, *x.shape[1:]))


_KERNELS = {aten.mm.default: mm, aten.bmm.default: bmm}
KERNELS = frozenset([*_KERNELS.values(), index_put_in_order])  # what a program may call in place of aten's


def _worth_it(node: torch.fx.Node) -> bool:
    known = [shape_dtype(x) if isinstance(x, torch.fx.Node) else None for x in node.args[:2]]
    if None in known or any(dtype is not torch.float32 for _, dtype in known):
        return False
    (a, _), (b, _) = known
    if node.target is aten.bmm.default:
        if a[0] != 1:
            return False
        a, b = a[1:], b[1:]
    return math.prod(a) * b[-1] >= ONEDNN_MIN_MACS


def choose(gm: torch.fx.GraphModule, device_type: str | None) -> torch.fx.GraphModule:
    """A copy of `gm` whose fp32 matmuls big enough for oneDNN call `mm` or `bmm` above, and whose
    accumulating `index_put`s call `index_put_in_order` (`gm` itself if none does, or the program
    runs elsewhere than on CPU: `device_type`, None if not known)."""
    if device_type not in (None, "cpu"):
        return gm
    onednn = ONEDNN_MATMUL and torch.backends.mkldnn.enabled
    picked = {n: _KERNELS[n.target] for n in gm.graph.nodes
              if onednn and n.op == "call_function" and n.target in _KERNELS and _worth_it(n)}
    picked.update({n: index_put_in_order for n in gm.graph.find_nodes(op="call_function",
                                                                      target=aten.index_put.default)
                   if (n.args[3] if len(n.args) > 3 else n.kwargs.get("accumulate", False))})
    if not picked:
        return gm
    graph, copies = torch.fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for node, kernel in picked.items():
        copies[node].target = kernel
    return torch.fx.GraphModule(gm, graph)
