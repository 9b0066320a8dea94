"""Pictures of a lowered step, with matplotlib: a rank's memory over its program, and its replay's
timeline on a cluster's streams.

Pure functions of numbers (no ndfunc object is read here): `MemoryAnalysis.plot` and
`ProgramTime.plot` hand them their data. matplotlib is imported when a figure is drawn, so ndfunc
runs without it (`pip install 'ndfunc[notebook]'` brings it). A figure is made through pyplot and
closed there at once: it is shown once when it is a notebook cell's value, and pyplot keeps no
reference to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ndfunc._src.display import KIND_COLORS, format_bytes

# collectives: one colour per set of mesh axes, in the order they first run
_AXES_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
_EXPOSED = "#d62728"
_COMPUTE = "#606060"


def pyplot():
    """`matplotlib.pyplot`, or an ImportError that says how to install it."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("drawing this figure needs matplotlib, which ndfunc does not install by itself: "
                          "pip install 'ndfunc[notebook]'") from e
    return plt


def memory_figure(by_kind: dict[str, Sequence[int]], ops: Sequence[str], forward_ends: int | None, ax=None):
    """Bytes alive at each op of a program (`by_kind[k][i]`: of kind `k` at op `i`, named
    `ops[i]`), stacked by kind; the peak marked, and where the backward begins. Returns the Figure."""
    plt = pyplot()
    fig, ax, own = _axes(plt, ax, (10, 3.6))
    total = [sum(column) for column in zip(*by_kind.values())]
    unit, size = _unit(max(total, default=0))
    x = range(len(ops))
    kinds = [k for k, ys in by_kind.items() if any(ys)]
    ax.stackplot(x, *[[b / size for b in by_kind[k]] for k in kinds], labels=kinds,
                 colors=[KIND_COLORS.get(k) for k in kinds], step="post", linewidth=0)
    ax.step(x, [b / size for b in total], where="post", color="black", linewidth=0.8, label="total")
    if total:
        at = max(range(len(total)), key=total.__getitem__)
        ax.axhline(total[at] / size, color=_EXPOSED, linewidth=0.8, linestyle="--")
        ax.plot([at], [total[at] / size], "o", color=_EXPOSED, label=f"peak {format_bytes(total[at])}\nat {ops[at]}")
    if forward_ends is not None:
        ax.axvline(forward_ends + 0.5, color="#555555", linewidth=0.8, linestyle=":")
        ax.annotate("backward \u2192", (forward_ends + 0.5, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="#555555")
    ax.set_xlim(0, max(len(ops) - 1, 1))
    ax.set_ylim(0, max(total, default=0) / size * 1.08 or 1)
    ax.set_xlabel("op of the local program (every rank runs this one program)")
    ax.set_ylabel(f"{unit} alive on a rank")
    ax.set_title("a rank's memory over its program")
    _legend(fig, ax, own)
    return fig


def timeline_figure(lanes: dict[str, Sequence[tuple[float, float, str]]], waits: Sequence[tuple[float, float]],
                    total: float, ax=None):
    """A horizontal bar per event, one lane per stream: `lanes[name]` holds `(start, end, label)`
    (the compute stream first: its label ''; a link's: what its collective runs over, one colour
    each). `waits`: the spans the compute stream waited on communication, hatched red on its lane.
    The x axis runs from 0 to `total` seconds. Returns the Figure."""
    plt = pyplot()
    fig, ax, own = _axes(plt, ax, (10, 0.9 + 0.5 * len(lanes)))
    names = list(lanes)
    colors: dict[str, str] = {}
    for row, name in enumerate(names):
        y = (len(names) - 1 - row, 0.7)  # the first lane on top
        by_label: dict[str, list] = {}
        for start, end, label in lanes[name]:
            by_label.setdefault(label, []).append((start, end - start))
        for label, spans in by_label.items():
            color = _COMPUTE if not label else colors.setdefault(label, _AXES_COLORS[len(colors) % len(_AXES_COLORS)])
            ax.broken_barh(spans, y, facecolors=color, edgecolor=color, linewidth=0.3, label=label or "compute")
        if row == 0 and waits:
            ax.broken_barh([(start, end - start) for start, end in waits], y, facecolors="none",
                           edgecolor=_EXPOSED, hatch="////", linewidth=0.5, label="waiting on communication")
    ax.set_yticks([i + 0.35 for i in range(len(names))], names[::-1])
    ax.set_ylim(-0.3, len(names) - 0.1)
    ax.set_xlim(0, total)
    ax.xaxis.set_major_formatter(lambda s, _: _seconds(s))
    ax.set_xlabel("time in the step")
    busy = sum(end - start for start, end, _ in lanes.get("compute", ()))
    waited = sum(end - start for start, end in waits)
    ax.set_title(f"replayed: {_seconds(total)} (compute {_seconds(busy)}, waiting on communication "
                 f"{_seconds(waited)})")
    _legend(fig, ax, own)
    return fig


def _axes(plt, ax, size):
    """`(figure, axes, whether the figure is ours)`: a new figure unless `ax` is given."""
    if ax is not None:
        return ax.figure, ax, False
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    plt.close(fig)  # pyplot shows nothing of it by itself, and holds no reference
    return fig, ax, True


def _legend(fig, ax, own: bool) -> None:
    """Beside the axes in a figure of ours; inside them in the caller's."""
    if own:
        fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8, frameon=False)
    else:
        ax.legend(fontsize=8)


def _unit(b: float) -> tuple[str, int]:
    """The unit to draw `b` bytes in, and its size (a power of two: the scaled values are exact)."""
    return next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if b >= s), ("bytes", 1))


def _seconds(s: float) -> str:
    """`0.0123` -> `'12.3 ms'`."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= size:
            return f"{s / size:.3g} {unit}"
    return "0" if s == 0 else f"{s / 1e-9:.3g} ns"
