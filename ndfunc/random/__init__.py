"""Counter-based random numbers: JAX's threefry PRNG, bit for bit, one block at a time.

A key is an int64 tensor of shape (2,) holding two unsigned 32-bit words `[k0, k1]`, each in
[0, 2**32) (torch has no general uint32 arithmetic; int64 holds every uint32 and every sum of two).
The value at a global index of `shape` depends only on the key and that index: its bits are the
Threefry-2x32 hash of the flat row-major index under the key, as JAX computes them with
`jax_threefry_partitionable=True` (its default). So `normal(key, shape, index=block)` computes only
`normal(key, shape)[block]`, in chunks of `CHUNK` elements, and a sharded init gives the same full
tensor on any mesh while each rank computes just its own block.

Against JAX 0.10.2 (tests/test_random.py; data from tests/data/make_jax_random_cases.py):
- bit for bit: `key` (as with `jax_enable_x64`), `split`, `fold_in`, `bits`; `uniform` and
  `bernoulli` in float32, float16 and bfloat16, and in float64 on the default range [0, 1).
- float32 `normal` and `truncated_normal`: bit for bit with JAX on CPU. XLA expands erf_inv, log1p
  and erf into polynomials and its CPU code fuses their multiply-adds; both are reproduced here, a
  fused multiply-add as an exact float64 product, a float64 sum, then float32. That double rounding
  could differ in the last bit; it did not in 3e8 such operations (10**7 normals). JAX on GPU or TPU
  rounds the same formulas differently, so it can itself differ from JAX on CPU in the last bit.
- not bit for bit: float64 `uniform` off [0, 1) (JAX fuses `u * (maxval - minval) + minval`, which
  torch cannot do in float64), and `normal` / `truncated_normal` in other dtypes, which are the
  float32 values cast (JAX draws them at the dtype's own width).

Everything is torch ops on tensors (no `.item()`, no branching on tensor values, no numpy), so the
samplers can be traced: in a traced program each is one `ndfunc.random_block` node that computes
its block in chunks (see `_op.py`). `use_compile()` opts in to `torch.compile`'d kernels for big
values.

Example:
    >>> from ndfunc import random as nfr
    >>> key = nfr.key(0)
    >>> sharding = NamedSharding(AbstractMesh({'dp': 2, 'tp': 2}), P('dp', 'tp'))
    >>> blocks = [nfr.normal(key, (4, 6), index=i) for i in sharding.shard_indices((4, 6))]
    >>> blocks[3].shape, torch.equal(blocks[3], nfr.normal(key, (4, 6))[2:4, 3:6])
    (torch.Size([2, 3]), True)
"""

from ndfunc.random._blocks import Index as Index
from ndfunc.random._compile import use_compile as use_compile
from ndfunc.random._samplers import bernoulli as bernoulli
from ndfunc.random._samplers import bits as bits
from ndfunc.random._samplers import normal as normal
from ndfunc.random._samplers import truncated_normal as truncated_normal
from ndfunc.random._samplers import uniform as uniform
from ndfunc.random._threefry import fold_in as fold_in
from ndfunc.random._threefry import key as key
from ndfunc.random._threefry import split as split
from ndfunc.random._threefry import threefry2x32 as threefry2x32

# Settings, read from here at each call (by `_blocks.sample` and `_compile.compiled_chunks`), so
# that setting `ndfunc.random.CHUNK` or `COMPILE_CHUNK` takes effect.
CHUNK = 1 << 16  # elements hashed per step: threefry's ~140 temporaries stay in cache
COMPILE_CHUNK = 1 << 20  # elements per compiled call: one fused loop, so it can be larger

__all__ = [
    "CHUNK", "COMPILE_CHUNK", "bernoulli", "bits", "fold_in", "key", "normal", "split", "threefry2x32",
    "truncated_normal", "uniform", "use_compile",
]
