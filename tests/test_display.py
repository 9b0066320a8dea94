"""What a notebook shows: a lowered step's HTML summary against its `cost_analysis()` and
`memory_analysis()`, the memory figure's peak against the analysis's, and the replay's timeline
against the times `program_time` reports."""

from __future__ import annotations

import html.parser
import sys

import optree
import pytest
import torch
from helpers import tanh_mlp_step

import ndfunc as nf
from ndfunc._src.display import format_bytes, format_flops
from ndfunc.plan import Cluster, program_time
from ndfunc.sharding import AbstractMesh, NamedSharding, P

REL = 1e-12  # a replay's spans are sums of the same float seconds, in another order


@pytest.fixture
def matplotlib():
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    return mpl


def _fsdp_tp_step(n_layers: int = 2):
    """A tanh MLP's SGD step over dp 2 x tp 2, its weights split over both: gathers over dp, sums
    over tp. Returns the jitted step and its arguments."""
    step = tanh_mlp_step(n_layers, nf.optim.sgd(0.1))
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(16, 16, generator=g) / 4 for i in range(n_layers)}
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    mesh = nf.make_mesh(dp=2, tp=2)
    split = optree.tree_map(lambda _: P("dp", "tp"), params)
    jitted = nf.jit(step, mesh=mesh, in_shardings=(split, P(), P("dp"), P("dp")), out_shardings=(split, P(), P()))
    return jitted, (params, nf.optim.sgd(0.1).init(params), x, y)


class _Tables(html.parser.HTMLParser):
    """Each `<tr>`'s cells as `(text, title)`, and every element's `title`."""

    def __init__(self, page: str):
        super().__init__()
        self.rows, self.titles, self._cell = [], [], None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        title = dict(attrs).get("title")
        if title is not None:
            self.titles.append(title)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = ["", title]

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(tuple(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[0] += data


def test_cost_analysis_counts_collectives_by_mesh_axes():
    with nf.simulate(4):
        jitted, args = _fsdp_tp_step()
        cost = jitted.lower(*args).cost_analysis()
    by_axes = cost["by_axes"]
    assert {axes for axes in by_axes} <= {("dp",), ("tp",), ("dp", "tp")} and ("dp",) in by_axes
    for kind, count in cost["collectives"].items():  # the same collectives, grouped another way
        assert sum(kinds.get(kind, {}).get("count", 0) for kinds in by_axes.values()) == count
        assert sum(kinds.get(kind, {}).get("bytes", 0) for kinds in by_axes.values()) == cost["comm_bytes"][kind]


@pytest.mark.parametrize("stage", ["lowered", "compiled"])
def test_a_stage_shows_its_collectives_by_axes_and_its_memory_as_html(stage):
    with nf.simulate(4):
        jitted, args = _fsdp_tp_step()
        shown = jitted.lower(*args)
        if stage == "compiled":
            shown = shown.compile()
        page, cost, memory = shown._repr_html_(), shown.cost_analysis(), shown.memory_analysis()
    assert "<script" not in page and "<link" not in page and "<style" not in page  # self-contained
    tables = _Tables(page)
    assert tables.rows[0] == [(name, None) for name in ("mesh axes", "kind", "count", "sent per rank")]
    rows, axes = {}, None
    for row in tables.rows[1:tables.rows.index(next(r for r in tables.rows if r[0][0] == "total"))]:
        if len(row) == 4:  # the first of its mesh axes' rows
            axes = row.pop(0)[0]
        rows[axes, row[0][0]] = (int(row[1][0]), row[2])  # kind, count, bytes sent per rank
    expected = {(" x ".join(a), kind): c for a, kinds in cost["by_axes"].items() for kind, c in kinds.items()}
    assert expected and set(rows) == expected.keys()
    for key, (count, (text, title)) in rows.items():
        assert count == expected[key]["count"]
        assert title == f"{expected[key]['bytes']:.0f} B" and text == format_bytes(expected[key]["bytes"])
    total = next(r for r in tables.rows if r and r[0][0] == "total")
    assert total[1][0] == str(sum(cost["collectives"].values()))
    assert total[2][1] == f"{cost['comm_bytes']['total']:.0f} B"
    memory_rows = {r[0][0]: r[1][1] for r in tables.rows if len(r) == 2}
    assert memory_rows["peak"] == f"{memory.peak_memory_in_bytes} B"
    assert memory_rows["arguments"] == f"{memory.argument_size_in_bytes} B"
    assert memory_rows["temporaries"] == f"{memory.temp_size_in_bytes} B"
    assert memory_rows["activations kept for backward"] == f"{memory.breakdown.activations} B"
    at_peak = [t for t in tables.titles if ": " in t and t.endswith(" B")]  # the bar's segments
    assert at_peak == [f"{k}: {v} B" for k, v in memory.breakdown.at_peak.items() if v]
    assert f"per rank: {format_flops(cost['flops'])}," in page


def test_memory_figure_peaks_at_the_analysis_peak(matplotlib):
    with nf.simulate(4):
        jitted, args = _fsdp_tp_step(3)
        memory = jitted.lower(*args).memory_analysis()
    live = memory.breakdown.live
    peak_op = max(range(len(live.ops)), key=live.total().__getitem__)
    # the account by kind at the peak is the breakdown's, and adds up to the peak
    assert {k: v[peak_op] for k, v in live.by_kind.items()} == memory.breakdown.at_peak
    assert live.total()[peak_op] == memory.peak_memory_in_bytes
    assert live.forward_ends is not None and 0 < live.forward_ends < peak_op <= len(live.ops)

    fig = memory.plot()
    [ax] = fig.axes
    [total] = [line for line in ax.get_lines() if line.get_label() == "total"]
    unit = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "bytes": 1}[ax.get_ylabel().split()[0]]
    assert max(total.get_ydata()) * unit == memory.peak_memory_in_bytes  # a power of two: exact
    [marker] = [line for line in ax.get_lines() if line.get_label().startswith("peak ")]
    assert list(marker.get_xdata()) == [peak_op] and marker.get_ydata()[0] * unit == memory.peak_memory_in_bytes
    assert live.ops[peak_op] in marker.get_label()
    drawn = [k for k, v in live.by_kind.items() if any(v)]
    assert {"arguments", "gathered", "activations", "backward"} <= set(drawn)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [*drawn, "total", marker.get_label()]


def test_a_memory_analysis_made_by_hand_says_it_has_nothing_to_draw(matplotlib):
    from ndfunc._src.partition.passes.analysis import MemoryAnalysis

    with pytest.raises(ValueError, match=r"^MemoryAnalysis.plot: this analysis has no account of each op"):
        MemoryAnalysis(1, 1, 0, 0, 2).plot()


def test_figures_without_matplotlib_say_how_to_install_it(monkeypatch):
    mesh = AbstractMesh({"dp_shard": 8})
    w = nf.ShapeDtypeStruct((64, 64), torch.bfloat16, sharding=NamedSharding(mesh, P("dp_shard")))
    lowered = nf.jit(lambda w: w * 2, mesh=mesh, out_shardings=P()).lower(w)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    for draw in (lowered.memory_analysis().plot, program_time(lowered, Cluster.of("h100", 8)).plot):
        with pytest.raises(ImportError, match=r"needs matplotlib.*pip install 'ndfunc\[notebook\]'$"):
            draw()


def _lanes(ax) -> dict[str, list[tuple[float, float]]]:
    """Each lane's bars, `(start, end)`, by the lane's name (its y tick), and the hatched ones under 'waits'."""
    names = {round(tick, 6): label.get_text() for tick, label in zip(ax.get_yticks(), ax.get_yticklabels())}
    lanes: dict[str, list] = {}
    for bars in ax.collections:
        for path in bars.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(0), path.vertices.max(0)
            name = "waits" if bars.get_hatch() else names[round((y0 + y1) / 2, 6)]
            lanes.setdefault(name, []).append((float(x0), float(x1)))
    return lanes


def test_timeline_draws_a_lane_per_stream_and_spans_the_step(matplotlib):
    # 16 GPUs, 8 a node, dp_shard 2 x tp 8: tp's gathers stay in a node, dp_shard's cross nodes;
    # each doubled value is gathered first, so the compute stream waits for both links
    mesh = AbstractMesh({"dp_shard": 2, "tp": 8})
    a = nf.ShapeDtypeStruct((1024, 1024), torch.bfloat16, sharding=NamedSharding(mesh, P("dp_shard")))
    b = nf.ShapeDtypeStruct((1024, 1024), torch.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    lowered = nf.jit(lambda a, b: (a * 2, b * 2), mesh=mesh, out_shardings=(P(), P())).lower(a, b)
    t = program_time(lowered, Cluster.of("h100", 16))
    fig = t.plot()
    [ax] = fig.axes
    assert [label.get_text() for label in ax.get_yticklabels()] == ["inter-node link", "intra-node link", "compute"]
    assert ax.get_xlim() == (0.0, t.total)
    lanes = _lanes(ax)
    assert max(end for bars in lanes.values() for _, end in bars) == pytest.approx(t.total, rel=REL)
    assert sum(e - s for s, e in lanes["compute"]) == pytest.approx(t.compute, rel=REL)
    assert sum(e - s for s, e in lanes["waits"]) == pytest.approx(t.exposed, rel=REL)  # exposed, hatched
    for level in ("intra", "inter"):
        assert sum(e - s for s, e in lanes[f"{level}-node link"]) == pytest.approx(t.links[level], rel=REL)
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    assert {"compute", "waiting on communication", "dp_shard", "tp"} <= set(legend)


def test_a_step_of_several_runs_draws_them_one_after_another(matplotlib):
    mesh = AbstractMesh({"dp_shard": 8})
    w = nf.ShapeDtypeStruct((4096, 4096), torch.bfloat16, sharding=NamedSharding(mesh, P("dp_shard")))
    lowered = nf.jit(lambda w: w * 2, mesh=mesh, out_shardings=P()).lower(w)
    one = program_time(lowered, Cluster.of("h100", 8))
    three = one.times(2) + one
    assert three == one.times(3) and len(three.runs) == 3  # the numbers are what they were
    [ax] = three.plot().axes
    assert [label.get_text() for label in ax.get_yticklabels()] == ["intra-node link", "compute"]
    lanes = _lanes(ax)
    assert ax.get_xlim() == (0.0, three.total)
    assert max(end for _, end in lanes["compute"]) == pytest.approx(three.total, rel=REL)
    # each run gathers, waits for it, then doubles: the second run starts where the first ends
    assert [s for s, _ in lanes["intra-node link"]] == pytest.approx([0, one.total, 2 * one.total], rel=REL)
    assert sum(e - s for s, e in lanes["waits"]) == pytest.approx(3 * one.exposed, rel=REL)
