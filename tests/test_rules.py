import pytest
import torch
from helpers import flax_logical_rules

import ndfunc as nf
from ndfunc._src.sharding.rules import current_rules
from ndfunc.sharding import P, ShardingError, logical_to_mesh, match_rules

PARAMS = {
    "embed": torch.zeros(32, 8),
    "layers": [{"attn": {"wq": torch.zeros(8, 8), "wo": torch.zeros(8, 8)}, "norm": torch.zeros(8)}],
    "step": torch.zeros(()),
}


def test_match_rules_first_match_wins():
    rules = [
        (r"attn\.wq$", P(None, "tp")),
        (r"attn\.w", P("tp", None)),  # would also match wq; the first rule wins
        (r"^embed$", P("tp")),
        (r"norm", P()),
    ]
    assert match_rules(rules, PARAMS) == {
        "embed": P("tp"),
        "layers": [{"attn": {"wq": P(None, "tp"), "wo": P("tp", None)}, "norm": P()}],
        "step": P(),  # scalars are replicated without a rule
    }


def test_match_rules_uses_search_on_dotted_paths():
    assert match_rules([(r"layers\.0\.attn", P("tp")), (".*", P())], PARAMS)["layers"][0]["attn"]["wo"] == P("tp")


def test_match_rules_unmatched_leaf():
    with pytest.raises(
        ShardingError,
        match=r"no rule matches the parameter 'layers.0.norm'; patterns tried, in order: 'attn', '\^embed'\. "
        r"Add a rule for it, or end the list with \('\.\*', P\(\)\)",
    ):
        match_rules([("attn", P("tp")), ("^embed", P())], PARAMS)


# Hand-written cases that read as documentation; the Flax-generated cases below are the reference.
DEFAULT = nf.ParallelConfig().rules


@pytest.mark.parametrize(
    "names, expected",
    [
        (("vocab", "embed"), P("tp", ("dp_shard", "cp"))),
        (("embed", "heads", "head_dim"), P(("dp_shard", "cp"), "tp", None)),
        (("embed", "mlp"), P(("dp_shard", "cp"), "tp")),
        (("mlp", "embed"), P("tp", ("dp_shard", "cp"))),
        (("embed",), P(("dp_shard", "cp"))),
        (("batch", "seq"), P(("dp_replicate", "dp_shard"), "cp")),
        # batch takes dp_shard first, so embed (which needs dp_shard) stays whole: activations.
        (("batch", "seq", "embed"), P(("dp_replicate", "dp_shard"), "cp", None)),
        (("heads", "mlp"), P("tp", None)),  # one tp per tensor
        ((), P()),
        ((None, "mlp"), P(None, "tp")),
        (("unknown_name", "mlp"), P(None, "tp")),
    ],
)
def test_logical_to_mesh_default_rules(names, expected):
    assert logical_to_mesh({"w": names}, DEFAULT)["w"] == expected


@pytest.mark.parametrize("names, expected", [
    (("batch", "seq"), P(("dp_replicate", "dp_shard"), ("cp", "tp"))),  # the residual stream: split over tp too
    (("batch", "seq", None), P(("dp_replicate", "dp_shard"), ("cp", "tp"), None)),
    (("batch", "seq", "heads"), P(("dp_replicate", "dp_shard"), "cp", "tp")),  # heads take tp first
    (("batch", "seq", "mlp"), P(("dp_replicate", "dp_shard"), "cp", "tp")),
    (("batch", "seq", "vocab"), P(("dp_replicate", "dp_shard"), "cp", "tp")),
    (("vocab", "embed"), P("tp", ("dp_shard", "cp"))),  # parameters as without it
    (("embed", "heads", "head_dim"), P(("dp_shard", "cp"), "tp", None)),
])
def test_sequence_parallel_rules_split_a_sequence_beside_no_tp_dim_over_tp_too(names, expected):
    rules = nf.ParallelConfig(sequence_parallel=True).rules
    assert logical_to_mesh({"w": names}, rules)["w"] == expected
    # the same rules without the sequence's first rule are the Flax-checked defaults, reordered
    assert sorted(r for r in rules if r != ("seq", ("cp", "tp"))) == sorted(DEFAULT)


def test_rules_are_priorities_with_fallbacks():
    rules = [("embed", "tp"), ("mlp", "tp"), ("mlp", "dp"), ("embed", "dp")]
    # embed's rule comes first, so it takes tp even though mlp is the earlier dim; mlp falls back.
    assert logical_to_mesh(("mlp", "embed"), rules) == P("dp", "tp")
    assert logical_to_mesh(("mlp",), rules) == P("tp")


def test_explicit_none_rule_keeps_a_dim_whole():
    rules = [("head_dim", None), ("head_dim", "tp")]
    assert logical_to_mesh(("head_dim",), rules) == P(None)


def test_logical_to_mesh_trees():
    axes = {"embed": ("vocab", "embed"), "layers": [{"w1": ("embed", "mlp"), "scale": ("embed",)}]}
    assert logical_to_mesh(axes, DEFAULT) == {
        "embed": P("tp", ("dp_shard", "cp")),
        "layers": [{"w1": P(("dp_shard", "cp"), "tp"), "scale": P(("dp_shard", "cp"))}],
    }


def test_repeated_logical_name_is_an_error():
    with pytest.raises(ShardingError, match=r"'layers.0.w' names logical axis 'embed' twice in \('embed', 'embed'\)"):
        logical_to_mesh({"layers": [{"w": ("embed", "embed")}]}, DEFAULT)


def test_logical_axes_as_partition_specs_as_flax_writes_them():
    assert logical_to_mesh({"w": P("embed", "mlp")}, DEFAULT) == {"w": P(("dp_shard", "cp"), "tp")}


def test_logical_axes_must_be_tuples():
    with pytest.raises(ShardingError, match=r"'w' is 'embed'; expected a tuple of logical dim names, one per dim"):
        logical_to_mesh({"w": "embed"}, DEFAULT)
    with pytest.raises(ShardingError, match=r"'w.0' is 'embed'; expected a tuple of logical dim names"):
        logical_to_mesh({"w": ["embed", "mlp"]}, DEFAULT)


def test_match_rules_bad_regex():
    with pytest.raises(ShardingError, match=r"rule 1 has pattern .*, which is not a valid regular expression: missing \)"):
        match_rules([("embed", P()), (r"attn\.(w", P())], PARAMS)


FLAX = flax_logical_rules()


@pytest.mark.parametrize("case", FLAX["cases"], ids=lambda c: f"{c['rules']}-{c['names']}")
def test_logical_to_mesh_matches_flax(case):
    names, rules = tuple(case["names"]), FLAX["rule_sets"][case["rules"]]
    if "error" in case:
        with pytest.raises(ShardingError, match="twice in"):
            logical_to_mesh(names, rules)
    else:
        assert logical_to_mesh(names, rules) == P(*case["spec"])


def test_default_rules_are_the_ones_checked_against_flax():
    assert FLAX["rule_sets"]["accelerate"] == DEFAULT


def test_a_logical_constraint_does_nothing_without_rules():
    x = torch.ones(4, 2)
    assert nf.with_logical_constraint(x, ("batch", None)) is x


def test_axis_rules_lay_out_a_logically_named_activation_inside_jit():
    rules = [("batch", "dp"), ("embed", None)]

    @nf.sharding.axis_rules(rules)
    def f(x):
        return nf.with_logical_constraint(x * 2, ("batch", "embed")) + 1

    x = torch.arange(16.0).reshape(8, 2)
    with nf.simulate(4):
        out = nf.jit(f, mesh=nf.make_mesh(dp=4))(x)  # x replicated, the result's layout left free
        assert nf.sharding_of(out).spec == P("dp")  # where the constraint put it
        torch.testing.assert_close(nf.device_get(out), x * 2 + 1)
    assert current_rules() is None  # the rules were for f's body only


def test_a_logical_constraint_needs_one_name_per_dim():
    with nf.sharding.axis_rules([("batch", "dp")]):
        with pytest.raises(nf.sharding.RankError) as e:
            nf.with_logical_constraint(torch.ones(4, 2), ("batch",))
    assert str(e.value) == ("with_logical_constraint got names ('batch',) for a value of rank 2 (shape (4, 2)); "
                            "give one logical name (or None) per dim.")
