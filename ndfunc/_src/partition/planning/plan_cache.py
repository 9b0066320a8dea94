"""Plans kept on disk between processes, as JAX's persistent compilation cache keeps programs.

Set `NDFUNC_PLAN_CACHE_DIR` to a directory (on a filesystem every rank sees, for a cluster) and a
plan the partitioner searched for is written there; a later process - a run restarted after a
fault, every rank of a job after the first, the next notebook session - that lowers the same
problem reads it back instead of searching again, which at 4 live axes and 70B scale is minutes.

An entry is named by a digest of everything the search reads (`solve._problem_key`), of torch's
version and of the partitioner's own source, so a changed rule or cost model never serves an old
plan. Writes are atomic (a temporary file, then a rename), so ranks writing the same entry at once
leave one whole file. An entry that cannot be read is planned again, with a warning, and rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import pickle
import tempfile
import warnings

import torch

ENV = "NDFUNC_PLAN_CACHE_DIR"


def directory() -> pathlib.Path | None:
    """Where plans are kept (`NDFUNC_PLAN_CACHE_DIR`), or None: no plan is kept on disk."""
    where = os.environ.get(ENV)
    return pathlib.Path(where) if where else None


def entry(key: tuple) -> tuple[pathlib.Path, str] | None:
    """Where the plan for `key` is kept, and the key as text (what the entry is checked against),
    made once per problem; None without `NDFUNC_PLAN_CACHE_DIR`."""
    where = directory()
    if where is None:
        return None
    text = repr(key)
    digest = hashlib.sha256(f"{_code_version()}\n{text}".encode()).hexdigest()[:40]
    return where / f"{digest}.plan", text


def load(at: tuple[pathlib.Path, str] | None, num_nodes: int) -> tuple | None:
    """The plan kept at `at` (`entry`; `solve.partition`'s by-position form), or None."""
    if at is None:
        return None
    path, text = at
    try:
        with open(path, "rb") as f:
            stored_key, plan = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - any unreadable entry is a miss
        warnings.warn(f"ndfunc: the plan cache entry {path} cannot be read ({type(e).__name__}: {e}); "
                      f"planning again and rewriting it.", RuntimeWarning, stacklevel=3)
        return None
    if stored_key != text or len(plan[0]) != num_nodes:
        return None  # another problem under the same digest: as good as absent
    return plan


def store(at: tuple[pathlib.Path, str] | None, plan: tuple) -> None:
    """Keep `plan` at `at` (`entry`), atomically."""
    if at is None:
        return
    path, text = at
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".partial", delete=False) as f:
        pickle.dump((text, plan), f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(f.name, path)


@functools.cache
def _code_version() -> str:
    """torch's version and a digest of the partitioner's source: what makes a plan."""
    package = pathlib.Path(__file__).resolve().parent.parent  # ndfunc/_src/partition
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(path.read_bytes())
    return f"torch {torch.__version__}, partitioner {source.hexdigest()}"
