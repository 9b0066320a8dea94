"""MkDocs hooks: the README is the site's home page and the notebooks are pages, read from where
they live in the repository (so that each stays one file)."""

from __future__ import annotations

import pathlib
import re

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parents[1]


@event_priority(100)  # before mkdocs-jupyter, which turns the notebooks into pages
def on_files(files, config):
    files.append(File.generated(config, "index.md", content=_readme()))
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        # a File read from the repository's root (mkdocs-jupyter reads a notebook by its path)
        files.append(File(f"notebooks/{notebook.name}", src_dir=str(ROOT), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files


def on_page_markdown(markdown, page, config, files):
    """A page's link to the README is a link to the home page."""
    return markdown.replace("](../README.md)", "](index.md)")


def _readme() -> str:
    """The README, its links into docs/ made relative to the site's root."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text(encoding="utf-8"))
