"""What a lowered step shows as a notebook cell's value: an HTML summary of what one rank's program
costs, built from `cost_analysis()` and `memory_analysis()`.

Pure functions of those results; the page is self-contained (inline styles, no script, no
stylesheet), so it reads the same in Jupyter, VS Code and a saved notebook.
"""

from __future__ import annotations

import html

# one colour per kind of buffer (`passes/breakdown.py`), here and in `figures.py`
KIND_COLORS = {"arguments": "#9e9e9e", "gathered": "#80b1d3", "activations": "#fdb462",
                "backward": "#b3de69", "other": "#bebada"}
_TABLE = 'style="border-collapse:collapse;margin:4px 0 10px 0"'
_CELL = "padding:1px 8px;border-bottom:1px solid #ddd"


def stage_html(title: str, cost: dict, memory) -> str:
    """The page: `title`, then the collectives by mesh axes, bytes sent and flops per rank (`cost`,
    what `cost_analysis()` returns), and the memory per rank (`memory`, a `MemoryAnalysis`)."""
    sent = cost["comm_bytes"]["total"]
    return (f'<div style="font-family:sans-serif;font-size:13px;line-height:1.4">'
            f"<b>{html.escape(title)}</b><br>"
            f"per rank: {format_flops(cost['flops'])}, {_bytes_cell(sent, 'span')} sent, peak memory "
            f"{_bytes_cell(memory.peak_memory_in_bytes, 'span')}"
            f"<div style='display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start'>"
            f"<div>{collectives_html(cost)}</div><div>{memory_html(memory)}</div></div></div>")


def collectives_html(cost: dict) -> str:
    """A table of the collectives by the mesh axes they run over: kind, count, bytes a rank sends."""
    rows = []
    for axes, kinds in cost.get("by_axes", {}).items():
        for i, (kind, c) in enumerate(kinds.items()):
            name = f'<td {_span(len(kinds))}>{html.escape(" x ".join(axes))}</td>' if i == 0 else ""
            rows.append(f"<tr>{name}<td style='{_CELL}'>{kind}</td>{_num(c['count'])}{_bytes_cell(c['bytes'])}</tr>")
    if not rows:
        return "<p>no collectives</p>"
    total = sum(cost["collectives"].values())
    rows.append(f"<tr style='font-weight:bold'><td style='{_CELL}' colspan=2>total</td>{_num(total)}"
                f"{_bytes_cell(cost['comm_bytes']['total'])}</tr>")
    return (f"<table {_TABLE}><caption style='text-align:left'>collectives by mesh axes</caption>"
            f"<tr>{_head('mesh axes', 'kind', 'count', 'sent per rank')}</tr>{''.join(rows)}</table>")


def memory_html(memory) -> str:
    """A table of a rank's memory (arguments, outputs, temporaries, peak; `breakdown` by kind) and
    a bar of what is alive at the peak."""
    rows = [("arguments", memory.argument_size_in_bytes), ("outputs", memory.output_size_in_bytes),
            ("&nbsp;&nbsp;in donated buffers", memory.alias_size_in_bytes),
            ("temporaries", memory.temp_size_in_bytes), ("peak", memory.peak_memory_in_bytes)]
    b = memory.breakdown
    if b is not None:
        rows += [("<i>by kind</i>", None)]
        rows += [(f"argument {html.escape(name)}", size) for name, size in b.arguments.items()]
        rows += [("gradients", b.gradients), ("gathered parameters, most at once", b.gathered),
                 ("activations kept for backward", b.activations)]
    body = "".join(f"<tr><td style='{_CELL}'>{name}</td>{'<td></td>' if size is None else _bytes_cell(size)}</tr>"
                   for name, size in rows)
    return (f"<table {_TABLE}><caption style='text-align:left'>memory per rank</caption>{body}</table>"
            f"{'' if b is None else peak_bar(b.at_peak)}")


def peak_bar(at_peak: dict[str, int]) -> str:
    """A bar of what is alive at the peak, one segment per kind, and its legend."""
    total = sum(at_peak.values())
    if not total:
        return ""
    parts = [(k, v) for k, v in at_peak.items() if v]
    bar = "".join(f'<div title="{k}: {v} B" style="width:{100 * v / total:.2f}%;background:'
                  f'{KIND_COLORS.get(k, "#ccc")}"></div>' for k, v in parts)
    legend = ", ".join(f'<span style="color:{KIND_COLORS.get(k, "#ccc")}">&#9632;</span> {k} '
                       f"{_bytes_cell(v, 'span')}" for k, v in parts)
    return (f"<div>at the peak:</div><div style='display:flex;width:400px;height:14px;border:1px solid #444'>"
            f"{bar}</div><div style='font-size:12px'>{legend}</div>")


def format_bytes(b: float) -> str:
    """`1536` -> `'1.50 KiB'`."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def format_flops(f: float) -> str:
    """`2.1e7` -> `'21.0 MFLOP'`."""
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if f >= size:
            return f"{f / size:.1f} {unit}"
    return f"{f:.0f} FLOP"


def _bytes_cell(b: float, tag: str = "td") -> str:
    """The size, readable, its exact count of bytes in the tooltip."""
    style = f" style='{_CELL};text-align:right'" if tag == "td" else ""
    return f'<{tag} title="{b:.0f} B"{style}>{format_bytes(b)}</{tag}>'


def _num(n: int) -> str:
    return f"<td style='{_CELL};text-align:right'>{n}</td>"


def _span(rows: int) -> str:
    return f"rowspan={rows} style='{_CELL};vertical-align:top'"


def _head(*names: str) -> str:
    return "".join(f"<th style='{_CELL};text-align:left'>{n}</th>" for n in names)
