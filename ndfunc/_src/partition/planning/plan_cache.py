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


def load(key: tuple, num_nodes: int) -> tuple | None:
    """The plan kept for `key` (`solve.partition`'s by-position form), or None."""
    where = directory()
    if where is None:
        return None
    path = where / f"{_digest(key)}.plan"
    try:
        with open(path, "rb") as f:
            stored_key, plan = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - any unreadable entry is a miss
        warnings.warn(f"ndfunc: the plan cache entry {path} cannot be read ({type(e).__name__}: {e}); "
                      f"planning again and rewriting it.", RuntimeWarning, stacklevel=3)
        return None
    if stored_key != repr(key) or len(plan[0]) != num_nodes:
        return None  # another problem under the same digest: as good as absent
    return plan


def store(key: tuple, plan: tuple) -> None:
    """Keep `plan` for `key`, atomically."""
    where = directory()
    if where is None:
        return
    where.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=where, suffix=".partial", delete=False) as f:
        pickle.dump((repr(key), plan), f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(f.name, where / f"{_digest(key)}.plan")


def _digest(key: tuple) -> str:
    return hashlib.sha256(f"{_code_version()}\n{key!r}".encode()).hexdigest()[:40]


@functools.cache
def _code_version() -> str:
    """torch's version and a digest of the partitioner's source: what makes a plan."""
    package = pathlib.Path(__file__).resolve().parent.parent  # ndfunc/_src/partition
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(path.read_bytes())
    return f"torch {torch.__version__}, partitioner {source.hexdigest()}"
