import pickle

import pytest

from ndfunc.sharding import DuplicateAxisError, P, PartitionSpec, ShardingError


@pytest.mark.parametrize(
    "given, normalized",
    [
        ((), ()),
        ((None,), (None,)),
        (("dp",), ("dp",)),
        ((("dp",), None), ("dp", None)),  # a one-element tuple is its axis
        (([], "tp"), (None, "tp")),  # () and [] mean unsharded
        (((), "tp"), (None, "tp")),
        ((["dp", "tp"],), (("dp", "tp"),)),  # a list is a tuple
        ((("dp_replicate", "dp_shard"), "cp"), (("dp_replicate", "dp_shard"), "cp")),
    ],
)
def test_entries_normalize_as_in_jax(given, normalized):
    spec = P(*given)
    assert tuple(spec) == normalized
    assert spec == P(*normalized)
    assert hash(spec) == hash(P(*normalized))


@pytest.mark.parametrize("spec", [P(), P(None), P("dp_shard", None), P(("dp_replicate", "dp_shard"), "cp", None)])
def test_repr_pastes_back(spec):
    assert eval(repr(spec), {"P": P}) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_repr_reads_as_written():
    assert repr(P("dp_shard", None)) == "P('dp_shard', None)"
    assert repr(P(("dp", "tp"))) == "P(('dp', 'tp'))"


def test_is_immutable_and_hashable():
    spec = P("dp")
    with pytest.raises(AttributeError, match="immutable"):
        spec._entries = ()
    assert {P("dp"): 1}[P(("dp",))] == 1
    assert PartitionSpec is P


def test_axes_and_dim_axes():
    spec = P(("dp_replicate", "dp_shard"), None, "tp")
    assert spec.axes == ("dp_replicate", "dp_shard", "tp")
    assert spec.dim_axes(0) == ("dp_replicate", "dp_shard")
    assert spec.dim_axes(1) == ()
    assert spec.dim_axes(5) == ()  # trailing dims are unsharded


def test_equivalence_ignores_trailing_none():
    assert P("tp").is_equivalent_to(P("tp", None), ndim=2)
    assert P().is_equivalent_to(P(None, None), ndim=2)
    assert not P("tp").is_equivalent_to(P(None, "tp"), ndim=2)
    assert not P(("a", "b")).is_equivalent_to(P(("b", "a")), ndim=1)  # order is major to minor
    assert not P(None, None, "tp").is_equivalent_to(P(), ndim=2)  # too long for rank 2


def test_duplicate_axis_is_an_error():
    with pytest.raises(DuplicateAxisError, match=r"uses mesh axis 'dp' more than once.*P\(\('dp_shard', 'tp'\)\)"):
        P("dp", ("tp", "dp"))


def test_nested_tuple_is_an_error():
    with pytest.raises(ShardingError, match=r"entry 0 is \('dp', \('tp',\)\): a tuple of axes holds axis names only"):
        P(("dp", ("tp",)))


def test_wrong_entry_type_is_an_error():
    with pytest.raises(ShardingError, match="entry 1 is 3 of type int; expected None, a mesh axis name"):
        P("dp", 3)


def test_equality_with_tuples_is_consistent_with_hashing():
    assert P("a") == ("a",) and hash(P("a")) == hash(("a",))
    assert {("a", None): 1}.get(P("a", None)) == 1
    assert P() != (1,)  # not a valid spec: unequal, not an error
    assert P("b") != ("a", "a")


def test_unreduced_axes_are_part_of_the_spec():
    s = P(None, "tp", unreduced={"dp"})
    assert repr(s) == "P(None, 'tp', unreduced={'dp'})" and repr(P(unreduced="dp")) == "P(unreduced={'dp'})"
    assert s.unreduced == {"dp"} and s.axes == ("tp",)
    assert s != P(None, "tp") and s != (None, "tp") and hash(s) == hash(P(None, "tp", unreduced=["dp"]))
    assert pickle.loads(pickle.dumps(s)) == s


def test_an_axis_cannot_both_split_a_dim_and_be_unreduced():
    with pytest.raises(DuplicateAxisError) as e:
        P("dp", unreduced={"dp"})
    assert str(e.value) == ("PartitionSpec('dp') shards a dim over mesh axis 'dp' and also lists it as unreduced; "
                            "an axis either splits the value or holds parts of a sum.")
