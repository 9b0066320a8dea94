"""Plans kept on disk between processes, as JAX's persistent compilation cache keeps programs.

Set `NDFUNC_PLAN_CACHE_DIR` to a directory (on a filesystem every rank sees, for a cluster) and a
plan the partitioner searched for is written there; a later process - a run restarted after a
fault, every rank of a job after the first, the next notebook session - that lowers the same
problem reads it back instead of searching again, which at 4 live axes and 70B scale is minutes.

An entry is named by a digest of everything the search reads (`solve._problem_key`), of torch's
version and of the partitioner's own source, so a changed rule or cost model never serves an old
plan. Writes are atomic (a temporary file, then a rename), so ranks writing the same entry at once
leave one whole file. An entry is JSON (layouts as numbers and names), so a directory shared by a
cluster holds nothing that runs code when read, as a pickle could; an entry that cannot be read as
one is planned again, with a warning, and rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import tempfile
import warnings

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ndfunc._src.partition.planning.layout import MANUAL
from ndfunc._src.partition.planning.strategies import Strategy

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
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
        if stored["key"] != text:
            return None  # another problem under the same digest: as good as absent
        plan = _decoded(stored)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - any unreadable entry is a miss
        warnings.warn(f"ndfunc: the plan cache entry {path} cannot be read as a plan ({type(e).__name__}: "
                      f"{str(e)[:200]}); planning again and rewriting it.", RuntimeWarning, stacklevel=3)
        return None
    return plan if len(plan[0]) == num_nodes else None


def store(at: tuple[pathlib.Path, str] | None, plan: tuple) -> None:
    """Keep `plan` at `at` (`entry`), atomically."""
    if at is None:
        return
    path, text = at
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, suffix=".partial", delete=False) as f:
        json.dump({"key": text, **_encoded(plan)}, f)
    os.replace(f.name, path)


def _encoded(plan: tuple) -> dict:
    """`solve.partition`'s by-position plan as JSON values: a placement as its dim (a split), "R",
    "P<op>" (a pending reduction) or "manual"."""
    strategies, outputs, cost, whole, bound = plan
    return {"strategies": [None if s is None else [_layouts(s.outs), _layouts(s.ins), s.late] for s in strategies],
            "outputs": [[n, j, _layout(lay)] for n, j, lay in outputs], "cost": cost, "whole": whole, "bound": bound}


def _decoded(stored: dict) -> tuple:
    strategies = [None if s is None else Strategy(_from_layouts(s[0]), _from_layouts(s[1]), late=bool(s[2]))
                  for s in stored["strategies"]]
    outputs = [(int(n), int(j), _from_layout(lay)) for n, j, lay in stored["outputs"]]
    bound = stored["bound"]
    return (strategies, outputs, float(stored["cost"]), [int(i) for i in stored["whole"]],
            None if bound is None else float(bound))


def _layouts(layouts: tuple) -> list:
    return [None if lay is None else _layout(lay) for lay in layouts]


def _from_layouts(layouts: list) -> tuple:
    return tuple(None if lay is None else _from_layout(lay) for lay in layouts)


def _layout(layout: tuple) -> list | str:
    if layout == MANUAL:
        return "manual"
    return [_placement(p) for p in layout]


def _placement(p) -> int | str:
    kind = type(p)  # exactly these: a plan holds no other placement (`layout.fits`)
    if kind is Shard:
        return p.dim
    if kind is Replicate:
        return "R"
    if kind is Partial:
        return f"P{p.reduce_op}"
    raise TypeError(f"a plan's layout holds {p!r}, which the plan cache does not keep")


def _from_layout(layout: list | str) -> tuple:
    if layout == "manual":
        return MANUAL
    return tuple(Shard(p) if type(p) is int else Replicate() if p == "R" else Partial(p[1:]) for p in layout)


@functools.cache
def _code_version() -> str:
    """torch's version and a digest of the partitioner's source: what makes a plan."""
    package = pathlib.Path(__file__).resolve().parent.parent  # ndfunc/_src/partition
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(path.read_bytes())
    return f"torch {torch.__version__}, partitioner {source.hexdigest()}"
