"""Which kernel runs the local program's fp32 matmuls on CPU.

PyTorch runs an fp32 `mm` on CPU through MKL's sgemm, and MKL picks its code path by CPU vendor:
on an AMD CPU it takes the AVX2 path whatever the chip offers. On an AMD EPYC with AVX-512 that
path reaches about 106 GFLOP/s on one core, where oneDNN's matmul (the kernel PyTorch itself
uses for reduced-precision matmuls on CPU) reaches 220-245 on the same shapes
(`python benchmarks/cpu_matmul.py`). So there, the local program's fp32 `mm`s, and its `bmm`s of
one matrix (what `einsum` makes of a projection), of at least `ONEDNN_MIN_MACS` multiply-adds run
as oneDNN's. Smaller ones stay with aten: oneDNN's call costs about 12 us against aten's 1, and
the two break even near 128 x 128 x 128.

The arithmetic is the same: fp32 products summed in fp32 (oneDNN's default, no reduced-precision
mode), in another order, so results agree with MKL's to fp32 rounding. Every rank runs the same
kernel for the same shapes, so values the ranks compute alike stay alike. Only plain CPU tensors
take this path; simulated ranks (`nf.simulate`), other devices and dtypes run aten's op.

`ONEDNN_MATMUL` is read when a step is compiled: set it to False, or the environment variable
`NDFUNC_ATEN_MATMUL=1` before ndfunc is imported, to run every matmul as aten's.
"""

from __future__ import annotations

import os

import torch

aten = torch.ops.aten
ONEDNN_MIN_MACS = 128 * 128 * 128
_MM, _BMM = aten.mm.default._op, aten.bmm.default._op


def _mkl_takes_a_slow_path() -> bool:
    """Whether this is an x86 CPU with AVX2 or better that is not Intel's, and oneDNN is built in."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
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


def _takes_onednn(a: torch.Tensor, b: torch.Tensor, macs: int) -> bool:
    return (type(a) is torch.Tensor and type(b) is torch.Tensor and a.dtype is torch.float32
            and b.dtype is torch.float32 and a.device.type == "cpu" and macs >= ONEDNN_MIN_MACS)


def _onednn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a linear layer's kernel: x @ w.T, here with w = b.T (any strides; no bias, no fused op)
    return torch.ops.mkldnn._linear_pointwise.default(a, b.t(), None, "none", [], "")


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`aten.mm(a, b)`, as oneDNN's matmul where it is faster (see the module docstring)."""
    if a.dim() == 2 and b.dim() == 2 and _takes_onednn(a, b, a.shape[0] * a.shape[1] * b.shape[1]):
        return _onednn(a, b)
    return _MM(a, b)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`aten.bmm(a, b)`; a batch of one matrix (as `einsum` makes of a projection) as `mm`."""
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] == 1 and b.shape[0] == 1 and _takes_onednn(
            a, b, a.shape[1] * a.shape[2] * b.shape[2]):
        return _onednn(a[0], b[0]).unsqueeze(0)
    return _BMM(a, b)


def for_cpu() -> dict:
    """The ops the local program runs as another kernel here: {aten op: function}."""
    return {aten.mm.default: mm, aten.bmm.default: bmm} if ONEDNN_MATMUL else {}
