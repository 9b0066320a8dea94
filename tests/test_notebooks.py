"""The notebooks run: those of simulated ranks cell by cell in this process, as a kernel would run
them (no Jupyter needed), and `real_ranks.ipynb` in a real Jupyter kernel, its worker processes and
its outputs checked."""

import json
import pathlib

import pytest
import torch.distributed as dist

FOLDER = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
REAL_RANKS = FOLDER / "real_ranks.ipynb"
NOTEBOOKS = sorted(p for p in FOLDER.glob("*.ipynb") if p != REAL_RANKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_cells_run(path, capsys):
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {}
    try:
        for cell in cells:
            if cell["cell_type"] == "code":
                exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
        assert not dist.is_initialized(), "the notebook must leave its simulation at the end"
    finally:
        if "sim" in namespace:
            namespace["sim"].stop()  # a failed notebook must not leave its ranks to the next test
    out = capsys.readouterr().out
    assert "│" in out  # the sharding grids were drawn
    assert "False" not in out  # the notebooks print their checks against single-device results


@pytest.mark.gloo
def test_the_real_ranks_notebook_trains_on_worker_processes_in_a_kernel():
    nbclient, nbformat = pytest.importorskip("nbclient"), pytest.importorskip("nbformat")
    notebook = nbformat.read(REAL_RANKS, as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(FOLDER.parent)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    streams = "".join(o.text for o in outputs if o.output_type == "stream")
    shown = [o.data for o in outputs if o.output_type in ("execute_result", "display_data")]
    assert "Warning" not in streams, streams
    assert "4 workers started" in streams and "losses equal to simulation: True" in streams
    assert "parameters equal to simulation: True" in streams
    first, last = (float(x) for x in streams.split("loss ", 1)[1].split("\n")[0].split(" -> "))
    assert last < first - 1
    # the Array handle, the sharding grid with its axes, the lowered step's table, two figures
    assert any("Array(shape=(64, 128)" in d.get("text/plain", "") for d in shown)
    assert any("split over dp_shard" in d.get("text/html", "") for d in shown)
    assert any("collectives" in d.get("text/html", "").lower() and "all_reduce" in d.get("text/html", "") for d in shown)
    assert sum("image/png" in d for d in shown) == 2
