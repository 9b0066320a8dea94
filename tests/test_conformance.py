"""JAX's own sharding results (tests/data/jax_partition_spec_cases.json), checked three ways:
the pure block math, the DTensor placements it maps to (by moving real data in 8 simulated
ranks), and the inverse map from placements back to a spec."""

import json

import pytest
import torch
from helpers import arange, case_id, conformance_cases

import ndfunc as nf
from ndfunc.sharding import AbstractMesh, IndivisibleError, NamedSharding, P

CASES = conformance_cases()
VALID = [c for c in CASES if "error" not in c]
INDIVISIBLE = [c for c in CASES if c.get("error") == "IndivisibleError"]


def test_cases_are_all_here():
    assert len(CASES) == 613 and len(VALID) == 471 and len(INDIVISIBLE) == 142


@pytest.mark.parametrize("case", VALID, ids=case_id)
def test_shard_indices_match_jax(case):
    sharding = NamedSharding(AbstractMesh(case["mesh"]), P(*case["spec"]))
    indices = sharding.shard_indices(case["shape"])
    assert [[[s.start, s.stop] for s in index] for index in indices] == case["shards"]
    assert all(
        tuple(s.stop - s.start for s in index) == sharding.shard_shape(case["shape"]) for index in indices
    )


@pytest.mark.parametrize("case", INDIVISIBLE, ids=case_id)
def test_indivisible_cases_raise(case):
    sharding = NamedSharding(AbstractMesh(case["mesh"]), P(*case["spec"]))
    with pytest.raises(IndivisibleError, match="is not divisible by"):
        sharding.shard_indices(case["shape"])


@pytest.mark.parametrize("case", VALID, ids=case_id)
def test_placements_round_trip(case):
    mesh = AbstractMesh(case["mesh"])
    sharding = NamedSharding(mesh, P(*case["spec"]))
    back = NamedSharding.from_placements(mesh, sharding.placements, len(case["shape"]))
    assert back.spec.is_equivalent_to(sharding.spec, len(case["shape"])) or (
        # Axes of size 1 split nothing, so their order within a dim is not recoverable.
        back.shard_indices(case["shape"]) == sharding.shard_indices(case["shape"])
    )


def _by_mesh(cases):
    groups: dict[str, list] = {}
    for case in cases:
        groups.setdefault(json.dumps(case["mesh"]), []).append(case)
    return [(json.loads(mesh), group) for mesh, group in groups.items()]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, cases", _by_mesh(VALID), ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_device_put_moves_jax_blocks_in_simulation(mesh_shape, cases):
    with nf.simulate(AbstractMesh(mesh_shape).size):
        mesh = nf.make_mesh(mesh_shape)
        for case in cases:
            full = arange(case["shape"])
            sharding = NamedSharding(mesh, P(*case["spec"]))
            x = nf.device_put(full, sharding)
            blocks = x.to_local()._local_tensors
            for rank, shard in enumerate(case["shards"]):
                expected = full[tuple(slice(a, b) for a, b in shard)]
                assert torch.equal(blocks[rank], expected), (case_id(case), rank)
            assert torch.equal(nf.device_get(x), full), case_id(case)
            assert nf.sharding_of(x).shard_indices(case["shape"]) == sharding.shard_indices(case["shape"])


RESHARD_SPECS = [P(), P("a"), P(None, "c"), P(("a", "b")), P(("b", "a")), P(("c", "a"), "b"),
                 P("c", ("b", "a")), P(("a", "b", "c")), P(("c", "b", "a")), P(("b", "c", "a")), P(None, ("c", "a", "b"))]


def test_device_put_reshards_a_dtensor_between_any_two_layouts():
    # Every pair, strided layouts included, through DTensor's redistribute; the reference is the
    # slice of the full tensor that JAX's block math (checked above) gives each rank.
    with nf.simulate(8):
        mesh = nf.make_mesh(a=2, b=2, c=2)
        full = arange((8, 8))
        for source in RESHARD_SPECS:
            x = nf.device_put(full, NamedSharding(mesh, source))
            for target in RESHARD_SPECS:
                sharding = NamedSharding(mesh, target)
                blocks = nf.device_put(x, sharding).to_local()._local_tensors
                for rank, index in enumerate(sharding.shard_indices(full.shape)):
                    assert torch.equal(blocks[rank], full[index]), (source, target, rank)
