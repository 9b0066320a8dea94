"""What a lowered step moves and holds per rank, against the closed-form figures of each strategy
(computed here from shapes and mesh sizes, not by the partitioner), on abstract meshes of the
sizes users plan for: nothing is simulated or allocated."""

import pytest
import torch

import ndfunc as nf
from ndfunc._src.partition.program import collectives
from ndfunc.sharding import AbstractMesh, NamedSharding, P

F32 = 4


def _sgd_step(w, x):
    grad = nf.grad(lambda w: (x @ w).square().mean())(w)
    return w - 0.1 * grad


@pytest.mark.parametrize("replicas,shards", [(2, 64), (4, 8), (8, 16)])
def test_hsdp_reduce_scatters_the_gradient_then_all_reduces_its_shard(replicas, shards):
    # HSDP (PyTorch's FSDP2 with a 2-D mesh, torchtitan's dp_replicate x dp_shard): the gradient is
    # reduce-scattered over dp_shard, and only each rank's shard is all-reduced over dp_replicate
    mesh = AbstractMesh({"dp_replicate": replicas, "dp_shard": shards})
    d, rows = 1024, 256 * replicas * shards  # a batch large enough that the weight moves, not the activations
    w = nf.ShapeDtypeStruct((d, d), torch.float32, sharding=NamedSharding(mesh, P("dp_shard")))
    x = nf.ShapeDtypeStruct((rows, d), torch.float32, sharding=NamedSharding(mesh, P(("dp_replicate", "dp_shard"))))
    lowered = nf.jit(_sgd_step, mesh=mesh, out_shardings=P("dp_shard")).lower(w, x)
    weight = d * d * F32
    ring = lambda n: (n - 1) / n  # noqa: E731  each rank's share of a ring all-gather or reduce-scatter
    moved = lowered.cost_analysis()["comm_bytes"]
    assert moved["all_gather"] == pytest.approx(ring(shards) * weight)  # the weight, gathered for the matmul
    assert moved["reduce_scatter"] == pytest.approx(ring(shards) * weight)  # its gradient, scattered
    assert moved["all_reduce"] == pytest.approx(2 * ring(replicas) * weight / shards)  # the shard, over replicas
    order = [(c.kind, c.axes) for _, c in collectives(lowered.program.local)]
    assert order.index(("reduce_scatter", ("dp_shard",))) < order.index(("all_reduce", ("dp_replicate",)))
