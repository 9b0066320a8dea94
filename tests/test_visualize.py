import io

import torch

import ndfunc as nf
from ndfunc._src.visualize import block_grid, format_ranks, grid_caption, summary, to_html
from ndfunc.sharding import AbstractMesh, NamedSharding, P

MESH = AbstractMesh({"dp_shard": 4, "tp": 2})


def test_block_grid_2d():
    # Rank r = 2 * dp_shard + tp holds row block dp_shard and column block tp.
    assert block_grid((16, 32), NamedSharding(MESH, P("dp_shard", "tp"))) == [
        [(0,), (1,)], [(2,), (3,)], [(4,), (5,)], [(6,), (7,)],
    ]
    assert block_grid((16, 32), NamedSharding(MESH, P(None, "tp"))) == [[(0, 2, 4, 6), (1, 3, 5, 7)]]
    # tp major: the first half of the rows belongs to tp=0, i.e. ranks 0, 2, 4, 6.
    assert block_grid((8, 2), NamedSharding(MESH, P(("tp", "dp_shard")))) == [
        [(0,)], [(2,)], [(4,)], [(6,)], [(1,)], [(3,)], [(5,)], [(7,)],
    ]


def test_block_grid_1d():
    assert block_grid((8,), NamedSharding(MESH, P("tp"))) == [[(0, 2, 4, 6), (1, 3, 5, 7)]]
    assert block_grid((8,), NamedSharding(MESH, P())) == [[tuple(range(8))]]


def test_format_ranks():
    assert format_ranks((0, 1, 2, 3, 6)) == "0-3,6"
    assert format_ranks((0, 1, 4, 5)) == "0,1,4,5"
    assert format_ranks((7,)) == "7"


def test_terminal_grid_and_summary():
    with nf.simulate(8):
        mesh = nf.make_mesh({"dp_shard": 4, "tp": 2})
        x = nf.device_put(torch.zeros(16, 32), NamedSharding(mesh, P("dp_shard", "tp")))
        out = io.StringIO()
        nf.visualize_sharding(x, file=out)
        rows = [line for line in out.getvalue().splitlines() if "│" in line]
        assert [line.split("│")[1:-1] for line in rows] == [
            ["  0  ", "  1  "], ["  2  ", "  3  "], ["  4  ", "  5  "], ["  6  ", "  7  "],
        ]
        out = io.StringIO()
        nf.visualize_sharding(nf.device_put(torch.zeros(2, 8, 4), NamedSharding(mesh, P(None, "dp_shard"))), file=out)
        assert out.getvalue().splitlines() == [
            "shape (2, 8, 4), P(None, 'dp_shard') on mesh {'dp_shard': 4, 'tp': 2}",
            "  dim 0 (size 2): whole on every rank",
            "  dim 1 (size 8): 4 blocks of 2, over dp_shard",
            "  dim 2 (size 4): whole on every rank",
            "  replicated over: tp",
            "  each rank holds (2, 2, 4)",
        ]


def test_the_grid_says_which_mesh_axes_split_its_rows_and_columns():
    def caption(shape, spec, mesh=MESH):
        return grid_caption(shape, NamedSharding(mesh, spec))

    assert caption((16, 32), P("dp_shard", "tp")) == (
        "rows: dim 0 split over dp_shard (4); columns: dim 1 split over tp (2)")
    assert caption((16, 32), P(None, "tp")) == ("rows: dim 0 whole; columns: dim 1 split over tp (2); "
                                                "replicated over dp_shard (4)")
    assert caption((8, 2), P(("tp", "dp_shard"))) == (
        "rows: dim 0 split over tp x dp_shard (2 x 4); columns: dim 1 whole")
    assert caption((8,), P("tp")) == "columns: dim 0 split over tp (2); replicated over dp_shard (4)"
    assert caption((8, 8), P()) == "whole on every rank"
    # a size-1 axis splits nothing and holds no copy
    assert caption((8, 8), P("cp", "tp"), AbstractMesh({"cp": 1, "tp": 2})) == (
        "rows: dim 0 whole; columns: dim 1 split over tp (2)")
    with nf.simulate(8):  # the caption is the line above the grid, in a terminal and in a notebook
        mesh = nf.make_mesh({"dp_shard": 4, "tp": 2})
        out = io.StringIO()
        nf.visualize_sharding(nf.device_put(torch.zeros(16, 32), NamedSharding(mesh, P(None, "tp"))), file=out)
        assert out.getvalue().splitlines()[:2] == [caption((16, 32), P(None, "tp")), "┌───────────┬───────────┐"]
    assert to_html((16, 32), NamedSharding(MESH, P("dp_shard", "tp"))).count(
        ">rows: dim 0 split over dp_shard (4); columns: dim 1 split over tp (2)</caption>") == 1


def test_plain_tensor_is_one_block():
    out = io.StringIO()
    nf.visualize_sharding(torch.zeros(4, 4), file=out)
    assert "│  0  │" in out.getvalue()


def test_html_view():
    page = to_html((16, 32), NamedSharding(MESH, P(None, "tp")))
    assert page.count("<tr>") == 1 and page.count("<td") == 2
    assert ">0,2,4,6</td>" in page and ">1,3,5,7</td>" in page
    assert to_html((2, 2, 2), NamedSharding(MESH, P())).startswith("<pre>shape (2, 2, 2)")
    assert summary((4,), NamedSharding(MESH, P("tp"))).endswith("each rank holds (2,)")


def test_plain_tensor_is_held_by_every_rank():
    with nf.simulate(4):
        out = io.StringIO()
        nf.visualize_sharding(torch.zeros(4, 4), file=out)
        assert "│  0-3  │" in out.getvalue() and out.getvalue().startswith("whole on every rank\n")


def test_jupyter_gets_an_html_table(monkeypatch):
    import sys
    import types

    shown = []

    class ZMQInteractiveShell:  # what a Jupyter kernel's IPython shell is called
        pass

    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: ZMQInteractiveShell()
    display = types.ModuleType("IPython.display")
    display.HTML = lambda html: ("HTML", html)
    display.display = shown.append
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    with nf.simulate(8):
        mesh = nf.make_mesh({"dp_shard": 4, "tp": 2})
        nf.visualize_sharding(nf.device_put(torch.zeros(16, 32), NamedSharding(mesh, P("dp_shard", "tp"))))
    [(kind, page)] = shown
    assert kind == "HTML" and page.count("<tr>") == 4 and ">7</td>" in page
