"""The notebooks' code cells run, in order, as a kernel would run them (no Jupyter needed)."""

import json
import pathlib

import pytest
import torch.distributed as dist

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


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
