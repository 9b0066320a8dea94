import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ndfunc.sharding import (
    AbstractMesh,
    IndivisibleError,
    NamedSharding,
    P,
    RankError,
    ShardingError,
    UnknownAxisError,
)

MESH = AbstractMesh({"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2})


def test_shard_shape_and_indices():
    sharding = NamedSharding(MESH, P(("dp_replicate", "dp_shard"), "tp"))
    assert sharding.shard_shape((16, 32)) == (4, 16)
    indices = sharding.shard_indices((16, 32))
    assert len(indices) == 8
    # rank 5 sits at (dp_replicate=1, dp_shard=0, cp=0, tp=1): row block 1*2+0 = 2, column block 1.
    assert indices[5] == (slice(8, 12), slice(16, 32))


def test_placements_follow_dtensor_order():
    assert NamedSharding(MESH, P("dp_shard", "tp")).placements == (Replicate(), Shard(0), Replicate(), Shard(1))
    # tp is more major than dp_shard but later in the mesh: dp_shard splits a dim tp already split.
    assert NamedSharding(MESH, P(("tp", "dp_shard"))).placements == (
        Replicate(), _StridedShard(0, split_factor=2), Replicate(), Shard(0),
    )


def test_from_placements():
    strided = (_StridedShard(1, split_factor=2), Replicate(), Replicate(), Shard(1))
    sharding = NamedSharding.from_placements(MESH, strided, 2)
    assert sharding.spec == P(None, ("tp", "dp_replicate"))
    assert sharding.placements == strided
    assert NamedSharding.from_placements(MESH, (Replicate(), Shard(0), Replicate(), Shard(-1)), 2).spec == P("dp_shard", "tp")


def test_from_placements_rejects_what_no_spec_describes():
    with pytest.raises(ShardingError, match=r"on mesh axes \('dp_replicate', 'tp'\) split dim 1 in a way no PartitionSpec describes"):
        NamedSharding.from_placements(MESH, (Shard(1), Replicate(), Replicate(), _StridedShard(1, split_factor=2)), 2)
    with pytest.raises(ShardingError, match=r"shards dim 2, but the value has rank 2"):
        NamedSharding.from_placements(MESH, (Shard(2), Replicate(), Replicate(), Replicate()), 2)


def test_a_pending_sum_is_an_unreduced_axis_and_back():
    s = NamedSharding.from_placements(MESH, (Partial(), Replicate(), Replicate(), Shard(1)), 2)
    assert s.spec == P(None, "tp", unreduced={"dp_replicate"}) and not s.is_fully_replicated
    assert s.placements == (Partial(), Replicate(), Replicate(), Shard(1))
    assert s.shard_shape((8, 8)) == (8, 4)  # a part of the sum is as big as the value


def test_from_placements_rejects_a_pending_max():
    with pytest.raises(ShardingError) as e:
        NamedSharding.from_placements(MESH, (Partial("max"), Replicate(), Replicate(), Replicate()), 2)
    assert str(e.value) == ("placement P(max) on mesh axis 'dp_replicate' is a pending max, which no PartitionSpec "
                            "describes (only a pending sum: unreduced); reduce it first (redistribute to "
                            "Replicate or Shard).")


def test_is_fully_replicated():
    assert NamedSharding(MESH, P()).is_fully_replicated
    assert NamedSharding(MESH, P("cp")).is_fully_replicated  # cp has size 1
    assert not NamedSharding(MESH, P(None, "tp")).is_fully_replicated


def test_unknown_axis_error():
    with pytest.raises(
        UnknownAxisError,
        match=r"P\('data'\) names mesh axis 'data', which the mesh does not have; its axes are "
        r"\('dp_replicate', 'dp_shard', 'cp', 'tp'\)",
    ):
        NamedSharding(MESH, P("data"))


def test_rank_error_names_path_and_ranks():
    sharding = NamedSharding(MESH, P("dp_shard", "tp", None))
    with pytest.raises(
        RankError,
        match=r"'layers.0.wq': P\('dp_shard', 'tp', None\) is only valid for values of rank at least 3, "
        r"but was applied to a value of rank 2 \(shape \(4, 4\)\)",
    ):
        sharding.shard_shape((4, 4), path="layers.0.wq")
    with pytest.raises(RankError, match=r"For scalars the PartitionSpec should be P\(\)"):
        NamedSharding(MESH, P("tp")).shard_shape(())


def test_indivisible_error_says_what_to_do():
    sharding = NamedSharding(MESH, P(("dp_shard", "tp"), None))
    with pytest.raises(
        IndivisibleError,
        match=r"'embed': dim 0 of shape \(50, 8\) has size 50, which P\(\('dp_shard', 'tp'\), None\) splits "
        r"over mesh axes \('dp_shard', 'tp'\) \(dp_shard=2 x tp=2\) into 4 blocks; 50 is not divisible "
        r"by 4. Pad the dim to a multiple of 4 \(here 52: a vocabulary is padded with unused tokens\), "
        r"shard it over fewer axes, or leave it unsharded.",
    ):
        sharding.shard_shape((50, 8), path="embed")


def test_errors_are_value_errors():
    for error in (IndivisibleError, RankError, UnknownAxisError):
        assert issubclass(error, ShardingError) and issubclass(error, ValueError)


def test_wrong_types():
    with pytest.raises(TypeError, match=r"expects a PartitionSpec, got \('dp',\); write P\('dp'\)"):
        NamedSharding(MESH, ("dp",))
    with pytest.raises(TypeError, match="expects a Mesh or AbstractMesh, got dict"):
        NamedSharding({"dp": 2}, P())


def test_value_semantics():
    a = NamedSharding(MESH, P("tp"))
    assert a == NamedSharding(AbstractMesh(MESH.shape), P(("tp",)))
    assert hash(a) == hash(NamedSharding(MESH, P("tp")))
    assert a.is_equivalent_to(NamedSharding(MESH, P("tp", None)), ndim=2)
    # cp has size 1: sharding over it splits nothing, as in JAX's equivalence.
    assert NamedSharding(MESH, P("cp")).is_equivalent_to(NamedSharding(MESH, P()), ndim=1)
    assert NamedSharding(MESH, P(("tp", "cp"))).is_equivalent_to(NamedSharding(MESH, P(("cp", "tp"))), ndim=1)
    assert not NamedSharding(MESH, P(("tp", "dp_shard"))).is_equivalent_to(NamedSharding(MESH, P(("dp_shard", "tp"))), ndim=1)
    assert not a.is_equivalent_to(NamedSharding(AbstractMesh({"tp": 2}), P("tp")), ndim=1)
    assert repr(a) == "NamedSharding(mesh=AbstractMesh({'dp_replicate': 2, 'dp_shard': 2, 'cp': 1, 'tp': 2}), spec=P('tp'))"
    with pytest.raises(AttributeError):
        a._spec = P()


def test_sharded_data_matches_slices_without_ranks():
    # The pure math alone, against torch.chunk as the reference for a single axis.
    full = torch.arange(64.0).reshape(8, 8)
    sharding = NamedSharding(AbstractMesh({"tp": 4}), P(None, "tp"))
    for rank, index in enumerate(sharding.shard_indices(full.shape)):
        assert torch.equal(full[index], full.chunk(4, dim=1)[rank])
