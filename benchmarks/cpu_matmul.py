"""fp32 matmuls on one CPU core: PyTorch's `torch.mm` (MKL's sgemm) against oneDNN's matmul, the
kernel ndfunc's local program runs them as where MKL takes a slow path (ndfunc._src.partition.backends.cpu_kernels).

    python benchmarks/cpu_matmul.py [--repeats 50]

Shapes: a llama step's projections and their gradients (benchmarks/fsdp.py's `mid` model, a rank's
256 tokens), the LM head, and smaller ones around the bound (`kernels.ONEDNN_MIN_MACS`) below
which ndfunc keeps aten's op. Each as `a @ b` with `a` and `b` contiguous, then with `a` transposed
(a weight's gradient, `x.T @ dy`). Reported: each kernel's GFLOP/s, the time ratio
oneDNN / aten (below 1, oneDNN is faster), and the largest difference of either from a float64
product, relative to the product's largest entry.
"""

from __future__ import annotations

import argparse
import time

import torch

from ndfunc._src.partition.backends import cpu_kernels as kernels

SHAPES = [(64, 64, 64), (64, 128, 128), (128, 128, 128), (256, 256, 64), (256, 256, 256), (256, 256, 768),
          (256, 768, 256), (256, 256, 4096), (256, 4096, 256), (1024, 1024, 1024)]  # m, k, n


def seconds(f, repeats: int) -> float:
    for _ in range(5):
        f()
    start = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        raise SystemExit("this torch is built without oneDNN: nothing to compare")
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; ndfunc runs big fp32 matmuls as oneDNN's "
          f"here: {kernels.ONEDNN_MATMUL} (bound {kernels.ONEDNN_MIN_MACS} multiply-adds)")
    print(f"{'m x k x n':>18} {'layout':>8} {'aten GF/s':>10} {'oneDNN GF/s':>12} {'ratio':>6} "
          f"{'aten err':>9} {'oneDNN err':>10}")
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        for layout in ("a @ b", "a.T @ b"):
            a = torch.randn(m, k, generator=g) if layout == "a @ b" else torch.randn(k, m, generator=g).t()
            b = torch.randn(k, n, generator=g)
            exact = a.double() @ b.double()
            aten_s = seconds(lambda: torch.mm(a, b), args.repeats)  # noqa: B023
            onednn_s = seconds(lambda: kernels._onednn(a, b), args.repeats)  # noqa: B023
            err = [((f(a, b).double() - exact).abs().max() / exact.abs().max()).item()
                   for f in (torch.mm, kernels._onednn)]
            flops = 2 * m * k * n
            print(f"{f'{m} x {k} x {n}':>18} {layout:>8} {flops / aten_s / 1e9:10.0f} {flops / onednn_s / 1e9:12.0f} "
                  f"{onednn_s / aten_s:6.2f} {err[0]:9.1e} {err[1]:10.1e}")


if __name__ == "__main__":
    main()
