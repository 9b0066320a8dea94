"""Candidates reading a pending mean, max, min or product that no producer makes are left out
before the search (`planning.reachable`): what that rests on (a layout change never starts a pending reduction
but at the last resort), what it leaves out, and that the search then ends where it did with every
candidate. (A pending sum stays within reach: `tests/test_train.py`'s accumulation until the end
takes a whole gradient as one rank's part of a running sum.)"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import ndfunc as nf
from models import llama, train
from ndfunc._src.partition.planning import reachable, redistribute, solve
from ndfunc._src.partition.planning.strategies import Fitted

R = Replicate()
SUM, MAX = Partial("sum"), Partial("max")


@pytest.mark.parametrize("sizes", [(2, 2), (2, 3, 2)])
def test_a_pending_reduction_is_reached_only_from_itself_or_at_the_last_resort(sizes):
    """What leaving candidates out rests on: every layout change the partitioner prices into a
    layout pending an op on an axis, from one not pending that op there, costs at least the last
    resort (a replicated block taken as a pending one) or has no plan: walked alone
    (`coded_cost`) and as the search's columns (`priced_pairs`)."""
    pending = [Partial(op) for op in ("sum", "avg", "max", "min", "product")]
    lays = [tuple(p) for p in itertools.product([R, Shard(0), Shard(1), *pending], repeat=len(sizes))]
    codes = [redistribute.codes(lay) for lay in lays]
    table = np.array(codes, dtype=np.int64)
    checked = 0
    for s in codes:
        columns = redistribute.priced_pairs(np.array([s], dtype=np.int64), table, sizes, 144, 4)
        for d, walked in zip(codes, columns.tolist()):
            if reachable.bits(d) & ~reachable.bits(s):
                checked += 1
                assert walked >= redistribute.LAST_RESORT, (s, d)
                assert redistribute.coded_cost(s, d, (12, 12), sizes, 4) >= redistribute.LAST_RESORT, (s, d)
    assert checked > 0.5 * len(codes) ** 2


def test_a_candidate_is_kept_where_each_input_can_be_made_as_it_reads_it():
    layouts = [(R, R), (SUM, R), (MAX, R), (R, SUM)]
    bits = [reachable.bits(redistribute.codes(lay)) for lay in layouts]
    lay_bits = np.array(bits, dtype=np.int64)
    ins = [(0, 0), (1, 0), (2, 0), (3, 3), (1, 3)]  # (x, y) layouts of an add's candidates
    fitted = Fitted(layouts, [(i,) for i, _ in ins], ins, late=frozenset({1, 4}))
    # x may come pending a sum over axis 0, y only replicated or split (`Problem` counts a pending
    # sum within reach of every value; `kept` takes what it is given)
    kept = reachable.kept(fitted, (bits[1], 0), lay_bits)
    assert kept.ins == [(0, 0), (1, 0)] and kept.late == frozenset({1})
    assert [s.ins for s in kept] == [((R, R), (R, R)), ((SUM, R), (R, R))]
    assert reachable.kept(fitted, (bits[1] | bits[2] | bits[3], bits[3]), lay_bits) is fitted  # all can be made
    only_pending = Fitted(layouts, [(2,)], [(2, 3)])
    assert reachable.kept(only_pending, (0, 0), lay_bits) is only_pending  # none would be left: all stay
    # the same as a list of `Strategy`s (an op's own rule), each layout's bits asked of a function
    listed = list(fitted)
    of_layout = dict(zip(layouts, bits)).__getitem__
    assert reachable.kept(listed, (bits[1], 0), of_layout) == listed[:2]
    assert reachable.kept(listed, (bits[1] | bits[2] | bits[3], bits[3]), of_layout) is listed


@pytest.mark.slow  # two searches of a 4-axis step, one over every candidate: about 9 s
def test_the_search_ends_where_it_ends_with_every_candidate_in_a_third_of_the_candidates(monkeypatch):
    """The 4-axis tiny llama step: the plan is the one searched over DTensor's whole candidate lists,
    over far fewer candidates (a candidate left out is never chosen)."""
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=2)
    program = train.lower_abstract(cfg, nf.ParallelConfig(2, 2, 2, 2), seq_len=64).program
    args = (program.traced.graph, program.sizes, program.in_layouts, program.out_layouts)
    kept = solve.Problem(*args)
    plan = kept.solve()
    monkeypatch.setattr(solve.Problem, "_reachable", lambda self, strategies, ins: strategies)
    whole = solve.Problem(*args)
    assert sum(map(len, kept.c_ins)) < 0.35 * sum(map(len, whole.c_ins))
    every = whole.solve()
    assert plan.strategy == every.strategy and plan.outputs == every.outputs and plan.cost == every.cost


def test_a_fitted_list_reads_the_same_made_of_arrays_or_of_lists():
    """`Fitted` keeps a walk's indices as arrays and makes lists only when read (`strategies`):
    both forms give the same strategies, and each is made from the other."""
    layouts = [(R, R), (SUM, R), (Shard(0), R)]
    ins, outs = [(0, 0), (1, 0), (2, 2)], [(0,), (1,), (-1,)]
    listed = Fitted(layouts, outs, ins, late=frozenset({2}))
    arrays = Fitted(layouts, np.array(outs, dtype=np.int64), np.array(ins, dtype=np.int64), late=frozenset({2}))
    assert len(arrays) == len(listed) == 3
    assert list(arrays) == list(listed) and arrays[1:] == listed[1:]
    assert arrays[2].late and arrays[2].outs == (None,)
    assert arrays.ins == ins and arrays.outs == outs
    assert all((a == b).all() for a, b in zip(listed.arrays, arrays.arrays))
