"""The documentation: the site builds with MkDocs (the notebooks executed) with no broken link,
anchor or reference, and every Python example in the README and the docs runs as written."""

from __future__ import annotations

import pathlib
import re
import os
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def examples(page: pathlib.Path) -> list[str]:
    return FENCE.findall(page.read_text(encoding="utf-8"))


HEAVY = {"planning.md", "processes.md"}  # plans at cluster scale; starts worker processes


@pytest.mark.parametrize("page", [pytest.param(p, marks=[pytest.mark.slow] if p.name in HEAVY else [])
                                  for p in PAGES if examples(p)], ids=lambda p: p.name)
def test_each_pages_python_examples_run_in_order(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (an example that writes files writes them here)
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(examples(page)):
        exec(compile(block, f"{page.name} example {i + 1}", "exec"), namespace)


@pytest.mark.slow
def test_the_site_builds_strict_with_the_notebooks_executed(tmp_path):
    pytest.importorskip("mkdocs_jupyter", reason="the docs extra: pip install 'ndfunc[docs]'")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    executed = (tmp_path / "site" / "notebooks" / "sharding" / "index.html").read_text()
    assert "dim 0 split over dp_shard (4)" in executed  # the sharding grids the notebook draws when run
