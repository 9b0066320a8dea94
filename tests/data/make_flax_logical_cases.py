"""Generate flax_logical_rules.json with Flax itself (not part of the test run).

    python -m venv /tmp/flaxenv && /tmp/flaxenv/bin/pip install flax
    /tmp/flaxenv/bin/python tests/data/make_flax_logical_cases.py

Every tuple of up to three logical names (each from the rule set's names, an unknown name, or
None) under each rule set, mapped by `flax.linen.partitioning.logical_to_mesh_axes`; a ValueError
from Flax (a name repeated within one tensor) is recorded as an error.
"""

import itertools
import json
import pathlib

import flax
import jax
from flax.linen import partitioning

RULE_SETS = {
    "accelerate": [("batch", ("dp_replicate", "dp_shard")), ("seq", "cp"), ("vocab", "tp"), ("heads", "tp"),
                   ("kv_heads", "tp"), ("mlp", "tp"), ("embed", ("dp_shard", "cp"))],
    "fallbacks": [("embed", "tp"), ("mlp", "tp"), ("mlp", "dp"), ("embed", "dp")],
    "none_rules": [("head_dim", None), ("head_dim", "tp"), ("heads", "tp"), ("batch", ("dp", "fsdp")), ("embed", "fsdp")],
    "overlapping": [("a", ("x", "y")), ("b", "y"), ("b", "x"), ("c", None), ("a", "z"), ("c", "z")],
}


def main() -> None:
    cases = []
    for name, rules in RULE_SETS.items():
        pool = sorted({n for n, _ in rules}) + ["unknown", None]
        for length in range(4):
            for names in itertools.product(pool, repeat=length):
                case = {"rules": name, "names": list(names)}
                try:
                    spec = partitioning.logical_to_mesh_axes(names, rules)
                    case["spec"] = [list(e) if isinstance(e, tuple) else e for e in spec]
                except ValueError as e:
                    case["error"] = str(e)
                cases.append(case)
    out = {
        "source": f"generated with flax {flax.__version__} (jax {jax.__version__}) "
                  f"flax.linen.partitioning.logical_to_mesh_axes",
        "rule_sets": {k: [[n, list(a) if isinstance(a, tuple) else a] for n, a in v] for k, v in RULE_SETS.items()},
        "cases": cases,
    }
    path = pathlib.Path(__file__).with_name("flax_logical_rules.json")
    path.write_text(json.dumps(out))
    print(f"{len(cases)} cases -> {path}")


if __name__ == "__main__":
    main()
