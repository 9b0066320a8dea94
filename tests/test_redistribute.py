"""Every layout change, moved for real: the lowering's collectives for each pair of layouts on a
2x2 and a 2x2x2 mesh (every Replicate / Partial / Shard per axis), run on simulated ranks, against
DTensor's own `redistribute` of the same value."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial

import ndfunc as nf
from ndfunc._torch_compat import bind_ops, local_tensor_mode
from ndfunc.partition import lower, redistribute
from ndfunc.partition.layout import all_layouts, describe, local_shape
from ndfunc.partition.solve import Plan
from ndfunc.partition.strategies import Strategy

SHAPE = (8, 8)  # every dim divides by every product of axes


def layout_changes(src, dsts, mesh) -> callable:
    """The local program that takes a value from `src` to each of `dsts` (ndfunc's lowering of
    each change; one program per source, its results one per destination)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(SHAPE)
    graph.output([x] * len(dsts))
    sizes = tuple(mesh.axis_sizes)
    plan = Plan(sizes, {x: Strategy((src,), ())}, [((x, 0), dst) for dst in dsts], 0.0)
    groups = [mesh.device_mesh.get_group(i).group_name for i in range(len(sizes))]
    return bind_ops(lower.lower(graph, plan, mesh.axis_names, groups))


def check_every_pair(axes: dict) -> tuple[int, list]:
    """(how many changes ran, those whose result differs from DTensor's)."""
    wrong, ran = [], 0
    with nf.simulate(math.prod(axes.values())):
        mesh = nf.make_mesh(**axes)
        sizes, names = tuple(mesh.axis_sizes), mesh.axis_names
        mode = local_tensor_mode()
        coords = mode.rank_map(lambda r: torch.tensor(mesh.coordinate(r), dtype=torch.int64))
        layouts = all_layouts(SHAPE, sizes)
        g = torch.Generator().manual_seed(0)
        for src in layouts:
            # each rank's own block, random (a pending sum: each rank's own part of it)
            parts = {r: torch.randn(local_shape(SHAPE, src, sizes), generator=g) for r in range(mesh.size)}
            x = DTensor.from_local(mode.rank_map(lambda r: parts[r].clone()), mesh.device_mesh, src, run_check=False,
                                   shape=torch.Size(SHAPE), stride=(SHAPE[1], 1))
            dsts = []
            for dst in layouts:
                if redistribute.plan(src, dst, SHAPE, sizes) is None:
                    # a pending sum is never made from data: those changes alone have no plan
                    assert any(isinstance(d, Partial) and s != d for s, d in zip(src, dst)), (src, dst)
                else:
                    dsts.append(dst)
            for dst, ours in zip(dsts, layout_changes(src, dsts, mesh)(x.to_local(), coords)):
                theirs = x.redistribute(mesh.device_mesh, dst)
                ran += 1
                if any(isinstance(d, Partial) for d in dst):  # any split of the sum will do: compare sums
                    got = DTensor.from_local(ours, mesh.device_mesh, dst, run_check=False,
                                             shape=torch.Size(SHAPE), stride=(SHAPE[1], 1))
                    same = torch.allclose(got.full_tensor(), theirs.full_tensor(), rtol=1e-6, atol=1e-6)
                else:  # each rank's block, as DTensor lays it out (sums in another order: to rounding)
                    same = torch.allclose(ours, theirs.to_local(), rtol=1e-6, atol=1e-6)
                if not same:
                    steps = redistribute.plan(src, dst, SHAPE, sizes)
                    wrong.append(f"{describe(src, names)} -> {describe(dst, names)}: {[s.kind for s in steps]}")
    return ran, wrong


def test_every_layout_change_on_a_2x2_mesh_moves_what_dtensor_moves():
    ran, wrong = check_every_pair({"a": 2, "b": 2})
    # per axis 4 placements each way, less the 3 that would make a pending sum from data: 13
    assert ran == 13 ** 2
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_every_layout_change_on_a_2x2x2_mesh_moves_what_dtensor_moves():
    ran, wrong = check_every_pair({"a": 2, "b": 2, "c": 2})
    assert ran == 13 ** 3
    assert not wrong, "\n".join(wrong)
