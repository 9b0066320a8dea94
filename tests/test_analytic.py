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


def test_hsdp_gathers_an_output_head_rather_than_reduce_its_logits():
    # a Llama 3 sized output head (4096 x 128256) under HSDP 2 x 4, 8192 tokens per rank: FSDP's
    # plan gathers the head over dp_shard (1.5 GB a rank), reduce-scatters its gradient and
    # all-reduces that shard over dp_replicate. Gathering the activations instead leaves the logits
    # a pending sum over dp_shard, 12 GB a rank to reduce-scatter: a search that priced a move of
    # the head's matmul by what its consumers then took (a pending sum) never tried it
    mesh = AbstractMesh({"dp_replicate": 2, "dp_shard": 4})
    batch, seq, d, vocab = 8, 8192, 4096, 128256

    def loss(w, x, targets):
        return torch.nn.functional.cross_entropy((x @ w).flatten(0, 1), targets.flatten())

    data = NamedSharding(mesh, P(("dp_replicate", "dp_shard")))
    w = nf.ShapeDtypeStruct((d, vocab), torch.float32, sharding=NamedSharding(mesh, P("dp_shard")))
    x = nf.ShapeDtypeStruct((batch, seq, d), torch.float32, sharding=data)
    targets = nf.ShapeDtypeStruct((batch, seq), torch.long, sharding=data)
    step = nf.jit(torch.func.grad_and_value(loss), mesh=mesh, out_shardings=(P("dp_shard"), P()))
    moved = step.lower(w, x, targets).cost_analysis()["comm_bytes"]
    head = d * vocab * F32
    assert moved["all_gather"] == pytest.approx(3 / 4 * head)
    assert moved["reduce_scatter"] == pytest.approx(3 / 4 * head)
    assert moved["all_reduce"] == pytest.approx(2 * 1 / 2 * head / 4, rel=1e-3)  # and two scalars
