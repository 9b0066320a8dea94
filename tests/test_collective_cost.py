"""One price of a collective (`collective_cost`): the partitioner's cost, `nf.plan`'s closed forms
and the replay's time of one all-gather agree with the alpha-beta seconds worked out here by hand
from the cluster's figures; a slow axis is priced so by the partitioner when `nf.jit` is given the
cluster; and without one the partitioner prices as this machine always has."""

from __future__ import annotations

import pytest
import torch

import ndfunc as nf
from ndfunc._src import collective_cost
from ndfunc._src.collective_cost import Link
from ndfunc._src.partition import program as prog
from ndfunc.plan import Cluster, Layout, program_time
from ndfunc.sharding import AbstractMesh, NamedSharding, P

REL = 1e-12  # the same sums in another order
# 2 nodes of 8 H100s: NVLink 450 GB/s each way and 1 us a ring step; NDR 50 GB/s and 10 us
CLUSTER = Cluster.of("h100", 16)
MESH = AbstractMesh({"dp_replicate": 2, "tp": 8})  # dp_replicate's two ranks are 8 apart: a node each
WHOLE = 4096 * 1024 * 2  # a (4096, 1024) bf16 value, in bytes


def _stand_in(spec):
    return nf.ShapeDtypeStruct((4096, 1024), torch.bfloat16, sharding=NamedSharding(MESH, spec))


def _gathered(cluster):
    """A value split over dp_replicate, asked whole: one all-gather over the fabric."""
    return nf.jit(lambda w: w, mesh=MESH, out_shardings=P(), cluster=cluster).lower(_stand_in(P("dp_replicate")))


def _collectives(lowered):
    return [(c.kind, c.axes) for c in map(prog.comm, lowered.program.local.graph.nodes) if c is not None]


def test_the_partitioner_the_closed_forms_and_the_replay_price_a_gather_alike():
    # over the fabric: one ring step of 10 us, and half the value sent at 50 GB/s
    by_hand = 10e-6 + WHOLE / 2 / 50e9
    lowered = _gathered(CLUSTER)
    assert _collectives(lowered) == [("all_gather", ("dp_replicate",))]
    # the partitioner's unit is a byte sent at the fastest link's rate, NVLink's
    assert lowered.program.plan.cost == pytest.approx(by_hand * 450e9, rel=REL)
    link = Layout(dp_replicate=2, tp=8).link("dp_replicate", CLUSTER)
    assert link.all_gather(2, WHOLE) == pytest.approx(by_hand, rel=REL)
    t = program_time(lowered, CLUSTER)
    assert t.links == {"intra": 0.0, "inter": pytest.approx(by_hand, rel=REL)}
    assert t.sent == {"intra": 0.0, "inter": WHOLE / 2}


def test_without_a_cluster_a_collective_costs_its_bytes_and_a_fixed_4096():
    # this machine's defaults, as the partitioner always priced a move: the bytes a rank sends and
    # 4,096 bytes' worth once per collective, whatever the axis
    assert _gathered(None).program.plan.cost == WHOLE / 2 + 4096
    on = collective_cost.machine({"dp_replicate": 2, "tp": 8})
    assert on.cost("all_gather", ("dp_replicate",), 2) == (0.5, 4096.0)
    assert on.cost("all_reduce", ("tp",), 8) == (2 * 7 / 8, 4096.0)
    assert on.flops_per_unit == 100.0


def test_a_cluster_makes_the_partitioner_move_over_nvlink_rather_than_the_fabric():
    # a + b, a split over dp_replicate and b over tp: gathering a over 2 ranks sends less than
    # gathering b over 8 (1/2 against 7/8 of the value), but over the fabric, not NVLink
    a, b = _stand_in(P("dp_replicate")), _stand_in(P("tp"))
    lowered = {c: nf.jit(lambda a, b: a + b, mesh=MESH, cluster=c).lower(a, b) for c in (None, CLUSTER)}
    assert _collectives(lowered[None]) == [("all_gather", ("dp_replicate",))]
    assert _collectives(lowered[CLUSTER]) == [("all_gather", ("tp",))]


def test_each_kind_sends_a_rings_share_and_waits_its_steps():
    link = Link(bandwidth=100e9, latency=1e-6, overhead=5e-6)
    size = 400e6
    # over 4 ranks: 3 steps sending a quarter each; an all-reduce twice that
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_cost.sent_bytes(kind, 4, size) == 3 / 4 * size
        assert collective_cost.seconds(kind, 4, size, link) == pytest.approx(5e-6 + 3e-6 + 300e6 / 100e9, rel=REL)
    assert collective_cost.seconds("all_reduce", 4, size, link) == pytest.approx(5e-6 + 6e-6 + 600e6 / 100e9, rel=REL)
    # a permute sends its block to one peer; a ring attention's three hops of it, three steps
    assert collective_cost.seconds("ppermute", 4, size, link) == pytest.approx(5e-6 + 1e-6 + size / 100e9, rel=REL)
    assert collective_cost.seconds("ppermute", 4, size, link, sent=3 * size) == pytest.approx(
        5e-6 + 3e-6 + 3 * size / 100e9, rel=REL)
    # over one rank a collective is the identity
    assert collective_cost.seconds("all_reduce", 1, size, link) == 0.0
    assert collective_cost.sent_bytes("all_gather", 1, size) == 0.0
    with pytest.raises(ValueError, match=r"no price for a collective of kind 'broadcast'; expected one of all_gather"):
        collective_cost.fraction("broadcast", 4)


def test_a_group_crosses_the_slowest_link_of_its_axes():
    on = collective_cost.machine({"dp_replicate": 2, "tp": 8}, CLUSTER)
    assert on.link(("tp",)) == ("intra", CLUSTER.intra)
    assert on.link(("dp_replicate", "tp")) == ("inter", CLUSTER.inter)
    assert on.unit == 450e9 and on.flops == CLUSTER.device.peak_bf16_flops


def test_jit_refuses_a_cluster_that_is_not_one_or_not_the_meshs():
    with pytest.raises(TypeError, match=r"^nf.jit: cluster must be a Cluster, got 'h100'"):
        nf.jit(lambda w: w, mesh=MESH, cluster="h100")
    with pytest.raises(ValueError, match=r"mesh \{'dp_replicate': 2, 'tp': 8\} has 16 ranks; its cluster has 8 GPUs"):
        nf.jit(lambda w: w, mesh=MESH, cluster=Cluster.of("h100", 8)).lower(_stand_in(P("dp_replicate")))
