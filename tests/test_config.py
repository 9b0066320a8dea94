import pytest

import ndfunc as nf
from ndfunc import ParallelConfig
from ndfunc.sharding import P

# (kwargs, world size, resolved sizes (dp_replicate, dp_shard, cp, tp), dp_world_size)
VALID = [
    ({}, 1, (1, 1, 1, 1), 1),
    ({"dp_replicate_size": 8}, 8, (8, 1, 1, 1), 8),  # DP
    ({"dp_shard_size": 8}, 8, (1, 8, 1, 1), 8),  # FSDP
    ({"tp_size": 8}, 8, (1, 1, 1, 8), 1),  # TP
    ({"cp_size": 8}, 8, (1, 1, 8, 1), 1),  # CP
    ({"dp_replicate_size": 2, "dp_shard_size": 4}, 8, (2, 4, 1, 1), 8),  # HSDP
    ({"dp_shard_size": 4, "tp_size": 2}, 8, (1, 4, 1, 2), 4),  # FSDP + TP
    ({"dp_shard_size": 4, "cp_size": 2}, 8, (1, 4, 2, 1), 4),  # FSDP + CP
    ({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, 8, (2, 2, 1, 2), 4),  # HSDP + TP
    ({"dp_replicate_size": 2, "dp_shard_size": 2, "cp_size": 2, "tp_size": 2}, 16, (2, 2, 2, 2), 4),  # 4D
    ({"dp_shard_size": -1, "tp_size": 2}, 8, (1, 4, 1, 2), 4),  # -1 takes the rest
    ({"dp_shard_size": -1}, 6, (1, 6, 1, 1), 6),
]


@pytest.mark.parametrize("kwargs, world, sizes, dp_world", VALID)
def test_valid_configurations(kwargs, world, sizes, dp_world):
    config = ParallelConfig(**kwargs).resolve(world)
    assert tuple(config.sizes.values()) == sizes
    assert config.total_size == world
    assert config.dp_world_size == dp_world


INVALID = [
    ({"tp_size": 0}, None, ValueError, r"ParallelConfig.tp_size must be >= 1, got 0"),
    ({"dp_shard_size": -2}, None, ValueError, r"dp_shard_size must be >= 1 \(or -1 to take the rest of the world\), got -2"),
    ({"cp_size": -1}, None, ValueError, r"ParallelConfig.cp_size must be >= 1, got -1"),
    ({"tp_size": 2.0}, None, TypeError, r"ParallelConfig.tp_size must be an int, got 2.0"),
    ({"sequence_parallel": 1}, None, TypeError, r"^ParallelConfig.sequence_parallel must be a bool, got 1\.$"),
    ({"dp_shard_size": 2, "tp_size": 2}, 8, ValueError,
     r"dp_replicate\(1\) x dp_shard\(2\) x cp\(1\) x tp\(2\) = 4, but the world has 8 ranks; choose sizes whose product is 8"),
    ({"dp_shard_size": -1, "tp_size": 3}, 8, ValueError,
     r"world size 8 is not divisible by dp_replicate\(1\) x cp\(1\) x tp\(3\) = 3"),
]


@pytest.mark.parametrize("kwargs, world, error, message", INVALID)
def test_invalid_configurations(kwargs, world, error, message):
    with pytest.raises(error, match=message):
        ParallelConfig(**kwargs).resolve(world)


def test_unresolved_sizes_are_refused():
    with pytest.raises(ValueError, match=r"ParallelConfig.dp_world_size needs every size, but dp_shard_size is -1; call .resolve\(world_size\) first"):
        ParallelConfig(dp_shard_size=-1).dp_world_size


def test_from_env():
    env = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "4", "PARALLELISM_CONFIG_TP_SIZE": "2", "OTHER": "x"}
    assert ParallelConfig.from_env(env) == ParallelConfig(dp_shard_size=4, tp_size=2)
    assert ParallelConfig.from_env({"PARALLELISM_CONFIG_CP_SIZE": "2", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "3"}) == ParallelConfig(dp_replicate_size=3, cp_size=2)
    with pytest.raises(ValueError, match=r"PARALLELISM_CONFIG_TP_SIZE='two' is not an integer"):
        ParallelConfig.from_env({"PARALLELISM_CONFIG_TP_SIZE": "two"})


def test_build_mesh_has_four_axes_in_order():
    with nf.simulate(8):
        mesh = ParallelConfig(dp_shard_size=-1, tp_size=2).build_mesh()
        assert mesh.shape == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2}
        with pytest.raises(ValueError, match=r"= 4, but the world has 8 ranks"):
            ParallelConfig(dp_shard_size=4).build_mesh()


def test_rules_and_batch_spec():
    config = ParallelConfig(dp_shard_size=2, cp_size=2, tp_size=2)
    rules = dict(config.rules)
    assert rules["embed"] == ("dp_shard", "cp")
    assert {rules[name] for name in ("heads", "kv_heads", "mlp", "vocab")} == {"tp"}
    assert rules["batch"] == ("dp_replicate", "dp_shard") and rules["seq"] == "cp"
    assert config.batch_spec == P(("dp_replicate", "dp_shard"), "cp")


def test_effective_batch_size_counts_data_parallel_ranks_only():
    # micro_batch x grad_accum x dp_replicate x dp_shard; cp and tp peers share samples.
    config = ParallelConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2)
    assert config.effective_batch_size(4, 8) == 4 * 8 * 2 * 2
    assert ParallelConfig(tp_size=8).effective_batch_size(4) == 4
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be an int >= 1, got 0"):
        config.effective_batch_size(4, 0)


def test_scale_lr():
    assert ParallelConfig.scale_lr(0.1, 256, 1024) == pytest.approx(0.4)
    assert ParallelConfig().scale_lr(3e-4, 64, 256, rule="sqrt") == pytest.approx(6e-4)
    with pytest.raises(ValueError, match="scale_lr rule must be 'linear' or 'sqrt', got 'cubic'"):
        ParallelConfig.scale_lr(0.1, 1, 2, rule="cubic")
