"""Every layout change, moved for real: the lowering's collectives for each pair of layouts on a
2x2 and a 2x2x2 mesh (every Replicate / Partial / Shard per axis), run on simulated ranks, against
DTensor: its own `redistribute` of the same value on 2x2, its layout of the value on 2x2x2 (2,197
changes; DTensor's redistribute of each in simulation would take minutes more). The 2x2 programs
run through the simulated-tensor mode, op by op; the 2x2x2 ones as a compiled step runs in
simulation (`simulated_program`: each op rank by rank, each collective over the ranks' blocks)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

import ndfunc as nf
from ndfunc._src import pipeline
from ndfunc._src.collective_cost import HOST
from ndfunc._src.partition import lower
from ndfunc._src.partition.planning import redistribute
from ndfunc._src.partition.planning.layout import (
    MANUAL,
    all_layouts,
    describe,
    fits,
    replicated,
)
from ndfunc._src.partition.planning.solve import Plan
from ndfunc._src.partition.planning.strategies import Strategy
from ndfunc._src.runtime import simulation_paused
from ndfunc._src.simulated_program import rank_program, run_on_ranks
from ndfunc._src.torch_compat import (
    LocalTensor,
    bind_ops,
    local_blocks,
    local_tensor_mode,
)

SHAPE = (8, 8)  # every dim divides by every product of axes


def layout_changes(src, dsts, mesh, rank_by_rank: bool) -> callable:
    """The local program that takes a value from `src` to each of `dsts` (ndfunc's lowering of
    each change; one program per source, its results one per destination), run through the
    simulated-tensor mode, or (`rank_by_rank`) as `simulated_program` runs a compiled step."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(SHAPE)
    graph.output([x] * len(dsts))
    sizes = tuple(mesh.axis_sizes)
    plan = Plan(sizes, {x: Strategy((src,), ())}, [((x, 0), dst) for dst in dsts], 0.0)
    # as nf.jit lowers: a run of one collective over several axes as one over them flattened
    gm = lower.lower(graph, plan, mesh.axis_names, *pipeline.process_groups(mesh, range(len(sizes))))
    if not rank_by_rank:
        return bind_ops(gm)
    ranks = tuple(sorted(local_tensor_mode().ranks))
    program = rank_program(gm, ranks)
    assert program is not None, "a layout change's collectives all run rank by rank"

    def run(*args):
        with simulation_paused():
            return run_on_ranks(program, ranks, args)
    return run


def check_every_pair(axes: dict, against_redistribute: bool, rank_by_rank: bool) -> tuple[int, list]:
    """(how many changes ran, those whose result differs from DTensor's). One value `full` in every
    layout (a pending sum: each rank a weighted part, the weights of each axis summing to one) is
    taken to every other by ndfunc's lowering, and each rank's block compared with DTensor's: its
    `redistribute` of the same DTensor (`against_redistribute`), else its `distribute_tensor` of
    `full` in the destination layout."""
    wrong, ran = [], 0
    with nf.simulate(math.prod(axes.values())):
        mesh = nf.make_mesh(**axes)
        sizes, names, dm = tuple(mesh.axis_sizes), mesh.axis_names, mesh.device_mesh
        mode = local_tensor_mode()
        coords = mode.rank_map(lambda r: torch.tensor(mesh.coordinate(r), dtype=torch.int64))
        layouts = all_layouts(SHAPE, sizes)
        full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
        whole = lambda lay: [Replicate() if isinstance(p, Partial) else p for p in lay]  # noqa: E731
        expected = {dst: distribute_tensor(full, dm, whole(dst)).to_local() for dst in layouts}

        def weight(r, lay):  # rank r's share of a pending sum: (c + 1) / (1 + .. + n) per partial axis
            w = 1.0
            for axis, p in enumerate(lay):
                if isinstance(p, Partial):
                    w *= (mesh.coordinate(r)[axis] + 1) / (sizes[axis] * (sizes[axis] + 1) / 2)
            return w

        for src in layouts:
            blocks = local_blocks(expected[src])
            local = mode.rank_map(lambda r: blocks[r] * weight(r, src))
            x = DTensor.from_local(local, dm, src, run_check=False, shape=torch.Size(SHAPE), stride=(SHAPE[1], 1))
            dsts = []
            for dst in layouts:
                if redistribute.plan(src, dst, SHAPE, sizes) is None:
                    # a pending sum is made only from a whole value: a split one alone has no plan
                    assert any(isinstance(d, Partial) and s != d and not isinstance(s, Replicate)
                               for s, d in zip(src, dst)), (src, dst)
                else:
                    dsts.append(dst)
            for dst, ours in zip(dsts, layout_changes(src, dsts, mesh, rank_by_rank)(local, coords)):
                ran += 1
                if any(isinstance(d, Partial) for d in dst):  # any split of the sum will do: compare sums
                    got = DTensor.from_local(ours, dm, dst, run_check=False, shape=torch.Size(SHAPE),
                                             stride=(SHAPE[1], 1)).full_tensor()
                    same = _close(got, full)
                elif against_redistribute:
                    same = _close(ours, x.redistribute(dm, dst).to_local())
                else:
                    same = _close(ours, expected[dst])
                if not same:
                    steps = redistribute.plan(src, dst, SHAPE, sizes)
                    wrong.append(f"{describe(src, names)} -> {describe(dst, names)}: {[s.kind for s in steps]}")
    return ran, wrong


def _close(a, b) -> bool:
    """Every rank's block of `a` like `b`'s (or like `b`, a plain tensor), to the rounding of sums in
    another order."""
    ours = local_blocks(a)
    theirs = local_blocks(b) if isinstance(b, LocalTensor) else dict.fromkeys(ours, b)
    return all(torch.allclose(ours[r], theirs[r], rtol=1e-6, atol=1e-6) for r in ours)


@pytest.mark.slow
def test_every_layout_change_on_a_2x2_mesh_moves_what_dtensor_moves():
    ran, wrong = check_every_pair({"a": 2, "b": 2}, against_redistribute=True, rank_by_rank=False)
    # per axis 4 placements each way, less the 2 that would make a pending sum of a split: 14
    assert ran == 14 ** 2
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_every_layout_change_on_a_2x2x2_mesh_moves_what_dtensor_moves():
    ran, wrong = check_every_pair({"a": 2, "b": 2, "c": 2}, against_redistribute=False, rank_by_rank=True)
    assert ran == 14 ** 3
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("sizes", [(2, 2, 2), (2, 32, 4, 4)])
def test_layout_changes_priced_together_cost_what_each_walked_alone_costs(sizes):
    """`priced_pairs` (a column of changes from one layout, or to one, walked at once) against
    `priced(coded_steps(...))` pair by pair: the same float, inf where there is no plan. Every pair
    of codes (replicated, sums, a max, splits of three dims) on three axes; on four, from every
    eleventh layout."""
    import numpy as np

    codes = [-1, -2, -4, 0, 1, 2]  # Replicate, Partial sum, Partial max, Shard(0..2)
    layouts = list(itertools.product(codes, repeat=len(sizes)))
    table = np.array(layouts, dtype=np.int64)
    for numel, itemsize in [(2 ** 20 * 3 * 128, 2), (4096 * 96, 4)]:
        for one in layouts[::1 if len(sizes) == 3 else 11]:
            row = np.array([one], dtype=np.int64)
            outward = redistribute.priced_pairs(row, table, sizes, numel, itemsize).tolist()
            inward = redistribute.priced_pairs(table, row, sizes, numel, itemsize).tolist()
            assert outward == [redistribute.priced(redistribute.coded_steps(one, b, sizes), numel, itemsize)
                               for b in layouts]
            assert inward == [redistribute.priced(redistribute.coded_steps(b, one, sizes), numel, itemsize)
                              for b in layouts]
    assert math.inf in outward and 0.0 in outward  # some changes have no plan; one is no change


@pytest.mark.parametrize("sizes", [(2, 2, 2), (4, 2), (2, 3, 4)])
def test_the_cost_the_partitioner_reads_is_the_sum_over_the_plans_steps(sizes):
    """`cost` walks `plan`'s steps on ints: for every pair of layouts (avg partials included) it is
    the steps' bytes plus a collective's fixed cost (this machine's overhead, in bytes at its
    bandwidth: the partitioner's unit) or a slice's copy, summed in step order, the
    same float (a whole value made a pending reduction: a slice's copy plus `LAST_RESORT`); and
    impossible where `plan` has no steps."""
    shape, itemsize = (24, 12, 48), 2
    per_axis = [Replicate(), Partial("sum"), Partial("avg"), Shard(0), Shard(1), Shard(2)]
    layouts = [lay for lay in itertools.product(per_axis, repeat=len(sizes)) if fits(lay, shape, sizes)]
    assert len(layouts) > 6 ** len(sizes) // 2  # the shape fits most layouts
    for src in layouts:
        for dst in layouts:
            steps = redistribute.plan(src, dst, shape, sizes, swaps=False)
            if steps is None:
                assert redistribute.cost(src, dst, shape, sizes, itemsize) == float("inf")
                continue
            expected = sum(s.moved_bytes(itemsize) + (
                HOST.overhead * HOST.bandwidth if s.kind in redistribute.COLLECTIVES
                else redistribute.SLICE * math.prod(s.out_shape) * itemsize
                + (redistribute.LAST_RESORT if s.kind == "partition" else 0.0)) for s in steps)
            assert redistribute.cost(src, dst, shape, sizes, itemsize) == expected, (src, dst)
    assert redistribute.cost(MANUAL, replicated(len(sizes)), shape, sizes, itemsize) == float("inf")


def test_axes_moving_their_splits_in_turn_exchange_blocks_by_all_to_alls_alone():
    """Where several axes move their splits between dims and mesh order would nest them wrong
    (an embedding's output, its width split over two axes, to batch and sequence), they move one
    at a time in an order that keeps every split innermost: all-to-alls only. Every such change of
    a (4, 8, 8) value on a 2x2x2 mesh, moved for real, against DTensor's layout of the value."""
    shape = (4, 8, 8)
    with nf.simulate(8):
        mesh = nf.make_mesh(a=2, b=2, c=2)
        sizes, dm = tuple(mesh.axis_sizes), mesh.device_mesh
        mode = local_tensor_mode()
        coords = mode.rank_map(lambda r: torch.tensor(mesh.coordinate(r), dtype=torch.int64))
        layouts = [lay for lay in itertools.product([Shard(0), Shard(1), Shard(2)], repeat=3) if fits(lay, shape, sizes)]
        full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        chained = [(src, dst) for src in layouts for dst in layouts
                   if (steps := redistribute.plan(src, dst, shape, sizes)) and len(steps) > 1
                   and {s.kind for s in steps} == {"all_to_all"}]
        assert len(chained) > 20
        for src, dst in chained:
            graph = torch.fx.Graph()
            x = graph.placeholder("x")
            x.meta["val"] = torch.empty(shape)
            graph.output([x])
            plan = Plan(sizes, {x: Strategy((src,), ())}, [((x, 0), dst)], 0.0)
            gm = bind_ops(lower.lower(graph, plan, mesh.axis_names, *pipeline.process_groups(mesh, range(3))))
            (got,) = gm(distribute_tensor(full, dm, src).to_local(), coords)
            assert _close(got, distribute_tensor(full, dm, dst).to_local()), (src, dst)


def test_a_run_of_one_collective_over_several_axes_is_one_over_them_flattened():
    """FSDP over ('dp_shard', 'cp') gathers a parameter in one all-gather and scatters its gradient
    in one reduce-scatter over the two axes flattened, as torchtitan's dp_shard_cp group does: the
    same bytes, one collective. Every layout change's merged steps run against DTensor above."""
    sizes, shape = (2, 4, 2), (64, 32)  # dp_shard, cp, tp
    fsdp, whole = (Shard(0), Shard(0), Replicate()), replicated(3)
    (gather,) = redistribute.merged(redistribute.plan(fsdp, whole, shape, sizes))
    assert (gather.kind, gather.over, gather.size, gather.in_shape, gather.out_shape) == (
        "all_gather", (0, 1), 8, (8, 32), (64, 32))
    partial = (Partial(), Partial(), Replicate())
    (scatter,) = redistribute.merged(redistribute.plan(partial, fsdp, shape, sizes))
    assert (scatter.kind, scatter.over, scatter.size, scatter.out_shape) == ("reduce_scatter", (0, 1), 8, (8, 32))
    steps = redistribute.plan(fsdp, whole, shape, sizes)
    assert sum(s.moved_bytes(4) for s in steps) == gather.moved_bytes(4)  # the same bytes, in one
    # an all-reduce over n1 x n2 ranks, ring: 2(n-1)/n of the value, less than one per axis
    (total,) = redistribute.merged(redistribute.plan((Partial(), Replicate(), Partial()), whole, shape, sizes))
    assert total.over == (0, 2) and total.size == 4
    # splits of two dims, or another kind between, stay apart
    two_dims = (Shard(0), Shard(1), Replicate())
    assert [s.over for s in redistribute.merged(redistribute.plan(two_dims, whole, shape, sizes))] == [(1,), (0,)]
    mixed = redistribute.merged(redistribute.plan((Partial(), Partial(), Replicate()), (Shard(0), Replicate(), Replicate()),
                                                  shape, sizes))
    assert [(s.kind, s.over) for s in mixed] == [("reduce_scatter", (0,)), ("all_reduce", (1,))]
