"""Run by tests/test_gloo.py under torchrun: 4 real processes over gloo.

Each rank checks its own block against JAX's conformance answer (or against the global tensor's
slice), then gathers and compares with the full tensor. Any failure raises, so torchrun exits
non-zero and the test fails with this rank's traceback.
"""

import json
import sys

import torch
from helpers import (
    arange,  # this folder is first on sys.path when torchrun runs the script
)

import ndfunc as nf
from ndfunc.sharding import NamedSharding, P


def main(cases_path: str) -> None:
    nf.init()
    nf.init()  # idempotent
    rank, world = nf.rank(), nf.world_size()
    assert world == 4 and not nf.is_simulated(), (rank, world)
    cases = [c for c in json.load(open(cases_path))["cases"] if "error" not in c]

    checked = 0
    # JAX's own 4-device cases: this rank's block is exactly JAX's.
    mesh = nf.make_mesh(x=4)
    for case in (c for c in cases if c["mesh"] == {"x": 4}):
        full = arange(case["shape"])
        x = nf.device_put(full, NamedSharding(mesh, P(*case["spec"])))
        expected = full[tuple(slice(a, b) for a, b in case["shards"][rank])]
        assert torch.equal(x.to_local(), expected), (rank, case)
        assert torch.equal(nf.device_get(x), full), (rank, case)
        checked += 1

    # Two axes on one dim, both orders (the second needs _StridedShard), and the four-axis mesh.
    config = nf.ParallelConfig(dp_shard_size=-1, tp_size=2)
    mesh = config.build_mesh()
    for spec in [P(("dp_shard", "tp")), P(("tp", "dp_shard")), P("tp", "dp_shard"), P(None, ("tp", "dp_shard")), P()]:
        full = arange((8, 12))
        sharding = NamedSharding(mesh, spec)
        x = nf.device_put(full, sharding)
        assert torch.equal(x.to_local(), full[sharding.shard_indices(full.shape)[rank]]), (rank, spec)
        assert torch.equal(nf.device_get(x), full), (rank, spec)
        checked += 1

    # A callback asked only for this rank's block.
    asked = []
    sharding = NamedSharding(mesh, P(("tp", "dp_shard")))
    x = nf.make_array_from_callback((8, 4), sharding, lambda index: asked.append(index) or arange((8, 4))[index])
    assert asked == [sharding.shard_indices((8, 4))[rank]], (rank, asked)
    assert torch.equal(nf.device_get(x), arange((8, 4)))
    check_shard_map(mesh)
    nf.shutdown()
    assert nf.world_size() == 1
    print(f"rank {rank}: {checked + 1} layouts checked", flush=True)


def check_shard_map(mesh) -> None:
    """nf.lax collectives over gloo: values and gradients against the whole-tensor math."""
    from ndfunc import lax

    gen = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(6, 8, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(16, 8, generator=gen)
    w1.requires_grad_(), w2.requires_grad_()
    expected = ((torch.tanh(x @ w1) @ w2) ** 2).sum()
    gw1, gw2 = torch.autograd.grad(expected, (w1, w2))

    def local_loss(x, w1, w2):  # Megatron MLP over tp, batch rows over dp_shard
        y = lax.psum(torch.tanh(x @ w1) @ w2, "tp")
        ring = lax.ppermute(y, "dp_shard", [(0, 1), (1, 0)])  # swap the two row blocks and back
        y = lax.ppermute(ring, "dp_shard", [(0, 1), (1, 0)])
        rows = lax.all_to_all(lax.all_gather(y, "dp_shard", dim=0, tiled=True), "tp", 0, 0, tiled=True)
        # tp rank t now holds row block t twice (one copy from each tp rank), on both dp ranks: 4 copies.
        return lax.psum((rows * rows).sum(), ("dp_shard", "tp")) / 4

    w1d = nf.device_put(w1.detach(), NamedSharding(mesh, P(None, "tp"))).requires_grad_()
    w2d = nf.device_put(w2.detach(), NamedSharding(mesh, P("tp"))).requires_grad_()
    step = nf.shard_map(local_loss, mesh, in_specs=(P("dp_shard"), P(None, "tp"), P("tp")), out_specs=P())
    loss = step(x, w1d, w2d)
    loss.backward()
    torch.testing.assert_close(nf.device_get(loss), expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nf.device_get(w1d.grad), gw1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nf.device_get(w2d.grad), gw2, rtol=1e-5, atol=1e-5)
    # the same inside nf.jit: the permutes are point to point there too (two forward, two backward)
    jitted = nf.jit(nf.value_and_grad(lambda w1, w2, x: step(x, w1, w2), argnums=(0, 1)), mesh=mesh,
                    in_shardings=(P(None, "tp"), P("tp"), P("dp_shard")))
    assert jitted.lower(w1.detach(), w2.detach(), x).cost_analysis()["collectives"]["ppermute"] == 4
    loss, (g1, g2) = jitted(w1.detach(), w2.detach(), x)
    torch.testing.assert_close(nf.device_get(loss), expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nf.device_get(g1), gw1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nf.device_get(g2), gw2, rtol=1e-5, atol=1e-5)
    # a reshard trading two axes' dims: each rank's block to one other rank, point to point
    swap = nf.jit(lambda z: z, mesh=mesh, in_shardings=P("dp_shard", "tp"), out_shardings=P("tp", "dp_shard"))
    z = torch.arange(16.0).reshape(4, 4)
    assert swap.lower(z).cost_analysis()["collectives"] == {"ppermute": 1}
    assert torch.equal(nf.device_get(swap(z)), z)
    print(f"rank {nf.rank()}: shard_map ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
