"""Which rank holds which block: a grid for 1-d and 2-d values, a per-dim summary otherwise.

`block_grid` is the pure layout (testable with no ranks), `grid_caption` says which mesh axes split
its rows and columns; `visualize_sharding` draws both with rich in a terminal and as an HTML table
in Jupyter.
"""

from __future__ import annotations

import html
import sys
from collections.abc import Sequence

from ndfunc._src.sharding.named_sharding import NamedSharding

_COLORS = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
           "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")


def block_grid(shape: Sequence[int], sharding: NamedSharding) -> list[list[tuple[int, ...]]]:
    """For a 1-d or 2-d value: `grid[i][j]` is the ranks holding block (i, j), sorted.

    A 1-d value is one row. Blocks follow the value's own order: row i covers rows
    `i*b0:(i+1)*b0` of the value.
    """
    if len(shape) not in (1, 2):
        raise ValueError(f"block_grid draws 1-d and 2-d values, got shape {tuple(shape)}.")
    shape2 = (1, *shape) if len(shape) == 1 else tuple(shape)
    if len(shape) == 1:
        rows, cols = 1, sharding.num_blocks(0)
    else:
        rows, cols = sharding.num_blocks(0), sharding.num_blocks(1)
    grid: list[list[list[int]]] = [[[] for _ in range(cols)] for _ in range(rows)]
    for rank, index in enumerate(sharding.shard_indices(shape)):
        index2 = (slice(0, 1), *index) if len(shape) == 1 else index
        block = [s.start // ((n // k) or 1) for s, n, k in zip(index2, shape2, (rows, cols))]
        grid[block[0]][block[1]].append(rank)
    return [[tuple(sorted(cell)) for cell in row] for row in grid]


def format_ranks(ranks: Sequence[int]) -> str:
    """`(0, 1, 2, 3, 6)` -> `'0-3,6'`."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else (f"{a},{b}" if b == a + 1 else f"{a}-{b}") for a, b in runs)


def summary(shape: Sequence[int], sharding: NamedSharding) -> str:
    """A per-dim description of the layout, for values of any rank."""
    mesh = sharding.abstract_mesh
    lines = [f"shape {tuple(shape)}, {sharding.spec!r} on mesh {mesh.shape}"]
    for dim, size in enumerate(shape):
        axes = sharding.spec.dim_axes(dim)
        if axes:
            k = sharding.num_blocks(dim)
            lines.append(f"  dim {dim} (size {size}): {k} blocks of {size // k}, over {' x '.join(axes)}")
        else:
            lines.append(f"  dim {dim} (size {size}): whole on every rank")
    replicated = [a for a in mesh.axis_names if a not in sharding.spec.axes and mesh.axis_size(a) > 1]
    lines.append(f"  replicated over: {', '.join(replicated) if replicated else 'no axis'}")
    lines.append(f"  each rank holds {sharding.shard_shape(shape)}")
    return "\n".join(lines)


def grid_caption(shape: Sequence[int], sharding: NamedSharding) -> str:
    """Which mesh axes split which dim of the grid `block_grid` draws (rows, columns), and which
    axes hold copies: `'rows: dim 0 split over dp_shard (4); columns: dim 1 split over tp (2)'`."""
    mesh = sharding.abstract_mesh
    parts = []
    for dim, where in enumerate(("rows", "columns") if len(shape) == 2 else ("columns",)):
        axes = [a for a in sharding.spec.dim_axes(dim) if mesh.axis_size(a) > 1]  # a size-1 axis splits nothing
        sizes = " x ".join(str(mesh.axis_size(a)) for a in axes)
        split = f"split over {' x '.join(axes)} ({sizes})" if axes else "whole"
        parts.append(f"{where}: dim {dim} {split}")
    if all(part.endswith("whole") for part in parts):
        return "whole on every rank"
    copies = [f"{a} ({n})" for a, n in mesh.shape.items() if n > 1 and a not in sharding.spec.axes]
    return "; ".join(parts + ([f"replicated over {', '.join(copies)}"] if copies else []))


def to_html(shape: Sequence[int], sharding: NamedSharding) -> str:
    """The block grid as an HTML table, one colour per set of ranks (blocks of a dim are equal)."""
    if len(shape) not in (1, 2):
        return f"<pre>{html.escape(summary(shape, sharding))}</pre>"
    grid = block_grid(shape, sharding)
    colors = _color_map(grid)
    width = max(40, min(600, 40 * len(grid[0])))
    height = max(30, min(400, 30 * len(grid)))
    cells = "".join(
        "<tr>" + "".join(
            f'<td style="background:{colors[cell]};border:1px solid #444;text-align:center;'
            f'font-family:monospace;color:#000">{html.escape(format_ranks(cell))}</td>'
            for cell in row
        ) + "</tr>"
        for row in grid
    )
    caption = (f'<caption style="font-family:monospace;font-size:12px">'
               f'{html.escape(grid_caption(shape, sharding))}</caption>')
    return (f'<table style="border-collapse:collapse;width:{width}px;height:{height}px" '
            f'title="{html.escape(repr(sharding.spec))}">{caption}{cells}</table>')


def visualize_sharding(x, *, file=None) -> None:
    """Draw which ranks hold which block of `x` (a DTensor; a plain tensor is whole everywhere).

    In a terminal the grid is drawn with rich; in Jupyter as an HTML table; above it, which mesh
    axes split its rows and columns. Values of rank 3 or more get a per-dim summary instead of a grid.
    """
    from ndfunc._src.transfer import sharding_of

    sharding = sharding_of(x)
    shape = tuple(x.shape)
    if sharding is None:
        from ndfunc._src.runtime import world_size
        from ndfunc._src.sharding.mesh import AbstractMesh
        from ndfunc._src.sharding.partition_spec import PartitionSpec

        sharding = NamedSharding(AbstractMesh({"all": world_size()}), PartitionSpec())
    if file is None and _in_jupyter():
        from IPython.display import HTML, display

        display(HTML(to_html(shape, sharding)))
        return
    _print_rich(shape, sharding, file)


def _print_rich(shape: Sequence[int], sharding: NamedSharding, file) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, highlight=False)
    if len(shape) not in (1, 2) or 0 in shape:
        console.print(summary(shape, sharding))
        return
    grid = block_grid(shape, sharding)
    colors = _color_map(grid)
    table = Table(show_header=False, box=box.SQUARE, show_lines=True, padding=(0, 1))
    cell_width = max(len(format_ranks(c)) for row in grid for c in row) + 2
    for _ in grid[0]:
        table.add_column(justify="center", min_width=cell_width)
    for row in grid:
        table.add_row(*[f"[black on {colors[c]}]{format_ranks(c):^{cell_width}}[/]" for c in row])
    console.print(grid_caption(shape, sharding), markup=False, soft_wrap=True)
    console.print(table)


def _color_map(grid) -> dict[tuple[int, ...], str]:
    cells = sorted({c for row in grid for c in row})
    return {c: _COLORS[i % len(_COLORS)] for i, c in enumerate(cells)}


def _in_jupyter() -> bool:
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
