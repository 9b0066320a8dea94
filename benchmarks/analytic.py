"""What a lowered Llama 3 step holds and moves per rank, against the closed forms of each strategy.

    python benchmarks/analytic.py [--shapes llama3_8b,llama3_70b] [--seq-len 8192]

For the 8B and 70B shapes (two of their layers: every figure is per layer or the head's) under
FSDP, TP, FSDP+TP, HSDP and CP, with FSDP2's schedule and full recomputation, lowered on abstract
meshes: `memory_analysis().breakdown` (parameters, Adam's moments, gradients, gathered units,
activations kept for backward) and `cost_analysis`'s traffic per collective, each beside the closed
form `tests/test_analytic.py` holds it to (`closed_forms` there says where each comes from), and
their ratio. Nothing is allocated: seconds per row.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.test_analytic import STRATEGIES, lowered_figures  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="llama3_8b,llama3_70b")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per rank")
    args = parser.parse_args(argv)
    table = Table("shape", "strategy", "figure", "lowered (GB)", "closed form (GB)", "ratio",
                  title="per rank: the lowered program against the closed forms")
    for shape in args.shapes.split(","):
        for name, sizes in STRATEGIES.items():
            got, expected = lowered_figures(sizes, shape, args.seq_len)
            for part, value in expected.items():
                ratio = got[part] / value if value else float("nan") if got[part] else 1.0
                table.add_row(shape, name, part, f"{got[part] / 1e9:.3f}", f"{value / 1e9:.3f}", f"{ratio:.3f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
