"""Candidates that read a pending reduction no producer makes, left out before the search.

A value reaches a layout with a pending reduction on a mesh axis (`Partial`) only if its producer
makes it so: a layout change may finish a pending reduction, never start one, other than by the
last resort of taking a replicated block as a pending one (`redistribute.LAST_RESORT`, priced so
that a plan takes it only where nothing else works). Plans do take it for a sum, where a transform
asks for one pending: `nf.accumulate(reduce="end")` carries its running sums pending over
dp_shard, and a whole gradient joins them as one rank's part. So a pending sum is counted within
reach of every value; a pending mean, max, min or product, which no transform asks for, only where
some candidate of the producer makes it. A candidate reading one that none makes is not chosen
while anything else works. DTensor's rules list such candidates for every op on every axis: an
elementwise op over a 4-axis mesh has some 14,000 candidates. Left out in program order (a
producer's candidates first, then what they can make), a 4-axis llama step keeps about a third of
its candidates, and its search runs 20-30% faster. The search may then settle elsewhere: the
candidates left out no longer crowd a move's few tries (one of 29 layouts measured, +0.24% by the
cost model).

Which pending ops a layout holds where, and which a value's producer can make, is one int each: a
bit per (mesh axis, reduce op) (`bits`), so a candidate reads only what is made where its layouts'
bits lie within its inputs'. Meshes of more axes than an int64 holds bits for keep every candidate
(`applies`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ndfunc._src.partition.planning import redistribute
from ndfunc._src.partition.planning.strategies import Fitted, Strategy

_OPS = len(redistribute._PARTIALS)  # bits per mesh axis
_SUM = -2 - redistribute._PARTIALS["sum"]  # its bit on an axis


def applies(k: int) -> bool:
    """Whether the bits of `k` mesh axes fit an int64 (`kept` compares them as arrays)."""
    return k * _OPS < 63


def sums(k: int) -> int:
    """The bits of a pending sum on each of `k` mesh axes: always within reach (the last resort)."""
    return sum(1 << (m * _OPS + _SUM) for m in range(k))


def bits(codes: tuple[int, ...] | None) -> int:
    """The pending reductions of a layout (`redistribute.codes`) as bits: one per (axis, op); 0 for
    a layout without codes (a manual one: nothing here says what it reads)."""
    if codes is None:
        return 0
    out = 0
    for m, c in enumerate(codes):
        if c <= -2:
            out |= 1 << (m * _OPS + (-2 - c))
    return out


def kept(strategies: Sequence[Strategy], reads: tuple[int, ...], lay_bits) -> Sequence[Strategy]:
    """`strategies` without those reading, in some input slot, a pending reduction outside that
    slot's `reads` (bits a producer makes); all of them where that would leave none (nothing is
    reachable without the last resort), and the same object where none is left out. `lay_bits`:
    of a `Fitted`, its layouts' `bits` as an int64 array; else a function of a layout."""
    if isinstance(strategies, Fitted):
        if not lay_bits.any():
            return strategies
        local_ins, local_outs = strategies.arrays
        ok = np.ones(len(strategies), dtype=bool)
        for slot, made in enumerate(reads):
            ok &= (lay_bits[local_ins[:, slot]] & ~made) == 0
        if ok.all() or not ok.any():
            return strategies
        keep = np.flatnonzero(ok)
        new = {old: k for k, old in enumerate(keep.tolist())}
        return Fitted(strategies.layouts, local_outs[keep], local_ins[keep],
                      frozenset(new[i] for i in strategies.late if i in new))
    ok = [all(lay_bits(lay) & ~made == 0 for lay, made in zip(st.ins, reads)) for st in strategies]
    if all(ok) or not any(ok):
        return strategies
    return [st for st, fine in zip(strategies, ok) if fine]
