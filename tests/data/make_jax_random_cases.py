"""Generate jax_random.json with JAX itself (not part of the test run).

    python -m venv /tmp/flaxenv && /tmp/flaxenv/bin/pip install jax
    /tmp/flaxenv/bin/python tests/data/make_jax_random_cases.py

JAX on CPU, with `jax_enable_x64` (64-bit seeds and float64 as JAX means them, not truncated) and
`jax_threefry_partitionable` (JAX's default since 0.5; checked below). Keys are stored as their two
uint32 words (`jax.random.key_data`), samples as bit patterns (unsigned ints of the dtype's width,
bools as 0/1), and big samples as the sha256 of their little-endian bytes plus their first values.
"""

import hashlib
import json
import pathlib

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp
import jax.random as jr
import numpy as np

UINT = {"float32": np.uint32, "float64": np.uint64, "float16": np.uint16, "bfloat16": np.uint16}
SEEDS = [0, 1, 42, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 2**40 + 7, 2**63 - 1, -1, -5, -(2**31), -(2**40), -(2**63)]
SHAPES = [(), (7,), (3, 5), (2, 3, 4)]


def words(x) -> np.ndarray:
    """Bit patterns of a sample, flattened row-major, little-endian."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    elif x.dtype != np.uint32:
        x = x.view(UINT[str(x.dtype)])
    return x.ravel().astype(x.dtype.newbyteorder("<"))


def draw(fn: str, k, shape, dtype: str, params: dict):
    dt = jnp.dtype(dtype)
    if fn == "bits":
        return jr.bits(k, shape, dtype=jnp.uint32)
    if fn == "uniform":
        return jr.uniform(k, shape, dt, params.get("minval", 0.0), params.get("maxval", 1.0))
    if fn == "normal":
        return jr.normal(k, shape, dt)
    if fn == "truncated_normal":
        return jr.truncated_normal(k, params["lower"], params["upper"], shape, dt)
    if fn == "bernoulli":
        return jr.bernoulli(k, jnp.asarray(params["p"], dt), shape)
    raise ValueError(fn)


def main() -> None:
    assert jax.config.jax_threefry_partitionable, "expected JAX's default, partitionable threefry"
    root = jr.key(20260101)
    sub = lambda i: jr.fold_in(root, i)  # a different key for every case
    kd = lambda k: np.asarray(jr.key_data(k)).tolist()

    keys = [{"seed": s, "key": kd(jr.key(s))} for s in SEEDS]
    splits = [{"key": kd(k), "num": num, "keys": kd(jr.split(k, tuple(num) if isinstance(num, list) else num))}
              for k in (jr.key(0), jr.key(42), sub(1)) for num in (1, 2, 3, 5, [2, 3])]
    folds = [{"key": kd(k), "data": d, "key_out": kd(jr.fold_in(k, d))}
             for k in (jr.key(0), jr.key(42), sub(2)) for d in (0, 1, 7, 2**31, 2**32 - 1)]

    plans = [("bits", "float32", {})]
    plans += [("uniform", "float32", p) for p in ({}, {"minval": -3.0, "maxval": 5.5}, {"minval": 0.25, "maxval": 0.5})]
    plans += [("uniform", d, p) for d in ("float16", "bfloat16") for p in ({}, {"minval": -1.1, "maxval": 3.3})]
    plans += [("uniform", "float64", {})]
    plans += [("normal", "float32", {})]
    plans += [("truncated_normal", "float32", {"lower": lo, "upper": hi})
              for lo, hi in ((-2.0, 2.0), (-2.0, 1.5), (0.5, 1.0), (-6.0, 7.0), (-np.inf, 0.5))]
    plans += [("bernoulli", d, {"p": p}) for d, p in (("float32", 0.5), ("float32", 0.1), ("float16", 0.3), ("bfloat16", 0.7))]
    samples = []
    for i, (fn, dtype, params) in enumerate(plans):
        for j, shape in enumerate(SHAPES):
            k = sub(1000 + 10 * i + j)
            samples.append({"fn": fn, "dtype": dtype, "params": params, "key": kd(k), "shape": list(shape),
                            "bits": words(draw(fn, k, shape, dtype, params)).tolist()})

    big = [("normal", "float32", {}, (1 << 20,)),
           ("normal", "float32", {}, (256, 129, 4)),
           ("uniform", "float32", {"minval": -3.0, "maxval": 5.5}, (1 << 18,)),
           ("uniform", "float16", {"minval": -1.1, "maxval": 3.3}, (1 << 18,)),
           ("uniform", "bfloat16", {"minval": -1.1, "maxval": 3.3}, (1 << 18,)),
           ("uniform", "float64", {}, (1 << 18,)),
           ("truncated_normal", "float32", {"lower": -2.0, "upper": 2.0}, (1 << 18,)),
           ("truncated_normal", "float32", {"lower": -6.0, "upper": 7.0}, (1 << 18,)),
           ("bernoulli", "float32", {"p": 0.3}, (1 << 18,))]
    digests = []
    for i, (fn, dtype, params, shape) in enumerate(big):
        k = sub(2000 + i)
        x = words(draw(fn, k, shape, dtype, params))
        digests.append({"fn": fn, "dtype": dtype, "params": params, "key": kd(k), "shape": list(shape),
                        "sha256": hashlib.sha256(x.tobytes()).hexdigest(), "head": x[:8].tolist()})

    out = {
        "source": f"generated with jax {jax.__version__} on CPU (jax_enable_x64, jax_threefry_partitionable) "
                  f"by tests/data/make_jax_random_cases.py",
        "keys": keys, "split": splits, "fold_in": folds, "samples": samples, "digests": digests,
    }
    path = pathlib.Path(__file__).with_name("jax_random.json")
    path.write_text(json.dumps(out, separators=(",", ":")))
    print(f"{len(keys)} keys, {len(splits)} splits, {len(folds)} fold_ins, {len(samples)} samples, "
          f"{len(digests)} digests -> {path} ({path.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
