"""What a plan holds per rank through the program: the cost model's memory term.

The cost model prices time only, and its optimum gathers whatever saves a collective: at a toy's
dims a batch held whole, at any dims a sequence-parallel layer's input or a vocabulary-parallel
loss's logits. So the exact solver and the refinement (`exact`, `refine`) bound memory as XLA's
auto-sharding does, by a per-rank budget on the bytes live at each point of the program (here,
what the search's plan holds there: `refine.bound`):

- a value is held in the layout its producer makes from its producer to its last reader (a step's
  output, to the end);
- a copy of it in another layout is held from its first reader to its last, where any reader takes
  it so (the lowering makes one copy per layout and every reader that takes it reads it,
  `lower._Emitter.local`; made at the first such reader, so this is an upper bound).

Points are the nodes in program order. Most points are below another: what is live at a point
where only values end is within what was live before it, so the bound is kept only at a point
where something ends after something began (`Spans.points`), a few hundred a layer: a plan within
the bound there peaks no higher than the bound's largest.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from torch.distributed.tensor import Shard

from ndfunc._src.partition.planning.layout import MANUAL


@dataclasses.dataclass(frozen=True)
class Spans:
    """Per value, the points it is held over: as made (`made`), as copies (`read`: its first reader
    to its last, None where it has none); the points at which the bound is kept (`points`)."""

    made: list[tuple[int, int]]
    read: list[tuple[int, int] | None]
    points: np.ndarray


def spans(problem) -> Spans:
    """`problem`'s spans, found once."""
    found = problem.__dict__.get("_memory_spans")
    if found is None:
        end = len(problem.nodes)
        made, read = [], []
        for v, (n, _) in enumerate(problem.values):
            readers = [m for m, _ in problem.consumers[v]]
            last = end if v in problem.final else max(readers, default=n)
            made.append((n, last))
            read.append((min(readers), max(readers)) if readers else None)
        found = problem.__dict__["_memory_spans"] = Spans(made, read, _points([*made, *filter(None, read)]))
    return found


def _points(intervals: list[tuple[int, int]]) -> np.ndarray:
    """The ends of `intervals` after which something began since the end before: the peaks of any
    sum of non-negative weights over them (a point where only intervals end holds a subset of
    what the point before it held)."""
    starts = np.array(sorted(s for s, _ in intervals))
    kept, last = [], -1
    for e in sorted({e for _, e in intervals}):
        if np.searchsorted(starts, e, side="right") > np.searchsorted(starts, last, side="right"):
            kept.append(e)
        last = e
    return np.array(kept, dtype=np.int64)


def held(problem, v: int, lay: int) -> float:
    """Bytes per rank of value `v` in layout `lay`."""
    shape, itemsize = problem.value_meta[v]
    return math.prod(shape) * itemsize / _blocks(problem, lay)


def _blocks(problem, lay: int) -> int:
    """How many blocks layout `lay` cuts a value into (1: whole on every rank; a value in a manual
    region is its rank's block already)."""
    table = problem.__dict__.setdefault("_memory_blocks", [])
    while len(table) < len(problem.layouts):
        layout = problem.layouts[len(table)]
        table.append(1 if layout == MANUAL else
                     math.prod(n for p, n in zip(layout, problem.sizes) if isinstance(p, Shard)))
    return table[lay]


def profile(problem, choice: list) -> np.ndarray:
    """Bytes per rank live at each of `spans(problem).points` under `choice`."""
    s = spans(problem)
    delta = np.zeros(len(problem.nodes) + 2)
    for v, (n, j) in enumerate(problem.values):
        made = problem.c_outs[n][choice[n]][j]
        if made is None:
            continue
        born, dies = s.made[v]
        size = held(problem, v, made)
        delta[born] += size
        delta[dies + 1] -= size
        if s.read[v] is None:
            continue
        first, last = s.read[v]
        for b in {problem.c_ins[m][choice[m]][slot] for m, slot in problem.consumers[v]} - {made}:
            size = held(problem, v, b)
            delta[first] += size
            delta[last + 1] -= size
    return np.cumsum(delta)[s.points]


def rows(problem, cols, rows_, made: dict, readers: dict, limits: dict[int, float], price: float = 0.0) -> None:
    """Adds to an integer program (`exact._model`'s columns and rows) a row per point in `limits`
    (its index among `spans(problem).points` -> the bytes it may hold) keeping the bytes held there
    within its limit; or, at a `price` per byte, those bytes to its objective instead (which keeps
    the program's relaxation integral where rows would make it branch: `refine`). `made`: value
    -> layout -> the columns choosing it ([None]: always); `readers`: value -> per reader, the
    same of the layouts it takes."""
    s = spans(problem)
    kept = np.array(sorted(limits), dtype=np.int64)
    fixed = np.zeros(len(problem.nodes) + 2)  # bytes no choice changes, as a running difference
    terms: list[dict] = [{} for _ in s.points]  # per point, column -> bytes (a node's outputs share its columns)

    at = s.points[kept]

    def hold(span, size: float, col: int | None) -> None:
        if col is None:
            fixed[span[0]] += size
            fixed[span[1] + 1] -= size
            return
        for r in kept[np.searchsorted(at, span[0]):np.searchsorted(at, span[1], side="right")]:
            terms[r][col] = terms[r].get(col, 0.0) + size

    for v, lays in made.items():
        for a, chosen in lays.items():
            size = held(problem, v, a)
            for col in chosen:
                hold(s.made[v], size, col)
        read = s.read[v]
        if read is None or not lays or np.searchsorted(at, read[0]) == np.searchsorted(at, read[1], side="right"):
            continue  # (no copy, or none held at a point bounded here)
        for b in {b for taken in readers[v] for b in taken}:
            copy = _copy(cols, rows_, lays.get(b, []), [taken.get(b, []) for taken in readers[v]])
            if copy is not False:
                hold(read, held(problem, v, b), copy)
    if price:
        for r in kept:
            for col, size in terms[r].items():
                cols.c[col] += price * size
        return
    held_fixed = np.cumsum(fixed)[s.points]
    for r in kept:
        row, limit = terms[r], limits[r] - held_fixed[r]
        if row:
            rows_.add(list(row.items()), -np.inf, limit)
        elif limit < 0:
            rows_.add([(cols.add(0.0, False, upper=0.0), 1.0)], 1.0, np.inf)  # (over budget whatever is chosen)


def _copy(cols, rows_, made: list, taken: list[list]):
    """A column at least 1 where some reader takes the layout and the producer does not make it
    (a copy held), None where one is always held, False where none ever is. (`made` is [None] or
    columns only: a node held at one candidate makes one layout.)"""
    if made == [None]:
        return False
    if not made and any(t == [None] for t in taken):
        return None
    col = None
    for t in filter(None, taken):
        col = cols.add(0.0, False) if col is None else col
        rows_.add([(col, 1.0), *[(c, -1.0) for c in t if c is not None], *[(c, 1.0) for c in made]],
                  float(t == [None]), np.inf)
    return False if col is None else col
