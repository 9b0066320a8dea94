"""What a lowered step moves and holds per rank, against the closed-form figures of each strategy
(computed here from shapes and mesh sizes, not by the partitioner), on abstract meshes of the
sizes users plan for: nothing is simulated or allocated."""

import optree
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


def _llama_step(base, sizes, seq=8192):
    """Llama 3's step (two of its layers: every figure below is per layer, or the embedding's) over
    stand-ins on an abstract mesh of `sizes` (dp_replicate, dp_shard, cp, tp), the train job's
    layouts, results laid out as the arguments were."""
    from models import llama, train

    cfg, config = base(n_layers=2), nf.ParallelConfig(*sizes)
    mesh = config.build_abstract_mesh()
    specs = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), specs))
    opt = nf.optim.adamw(3e-4)
    state = opt.init(params)
    laid_out = lambda tree: optree.tree_map(lambda x: x.sharding, tree)  # noqa: E731
    step = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh,
                  out_shardings=(laid_out(params), laid_out(state), P()))
    lowered = step.lower(params, state, train.abstract_batch(config, mesh, config.dp_world_size, seq))
    moved: dict = {}
    for _, c in collectives(lowered.program.local):
        moved[(c.kind, c.axes)] = moved.get((c.kind, c.axes), 0) + c.moved
    return cfg, lowered, moved


SHAPES = ["llama3_8b", "llama3_70b"]


@pytest.mark.slow  # a Llama-3-shaped step lowered per case: seconds each
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("shards,tp", [(8, 1), (4, 2)], ids=["fsdp8", "fsdp4_tp2"])
def test_fsdp_and_fsdp_tp_move_the_closed_forms(shape, shards, tp):
    # FSDP (Zhao et al. 2023; ZeRO-3): each weight gathered for the step and its gradient
    # reduce-scattered, (n-1)/n of its bytes each; under TP the weights FSDP moves are 1/tp of them,
    # and TP adds Megatron's 4 all-reduces per layer and 2 more (embedding, output head) of the
    # (B, S, D) activations. The embedding table is looked up where it lies (each rank its slice of
    # the width, the tokens exchanged: an all-to-all of activations), so it is not gathered.
    from models import llama

    cfg, lowered, moved = _llama_step(getattr(llama.LlamaConfig, shape), (1, shards, 1, tp))
    params = cfg.num_params()
    table = cfg.vocab_size * cfg.dim
    weights = (params - table) * F32 / tp
    ring = (shards - 1) / shards
    assert moved[("all_gather", ("dp_shard",))] == pytest.approx(ring * weights, rel=0.05)
    assert moved[("reduce_scatter", ("dp_shard",))] == pytest.approx(ring * weights, rel=0.05)
    if tp > 1:
        activations = 8192 * cfg.dim * F32
        expected = (4 * cfg.n_layers + 2) * 2 * (tp - 1) / tp * activations
        assert moved[("all_reduce", ("tp",))] == pytest.approx(expected, rel=0.05)
    # held per rank: weights and Adam's two moments, 12 bytes a parameter over all the ranks
    memory = lowered.memory_analysis()
    assert memory.argument_size_in_bytes == pytest.approx(3 * F32 * params / (shards * tp), rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_ring_attention_passes_the_key_value_heads_around_the_ring(shape):
    # context parallelism with ring attention (Liu et al. 2023): forward, cp - 1 hops of each rank's
    # keys and values; backward, cp - 1 hops of them with their gradients, and one more that brings
    # the gradients home. Of the G key/value heads (grouped-query attention reads them as they
    # are), not the H query heads' copies; the weights are FSDP-sharded over cp, as torchtitan does
    from models import llama

    cp, seq = 4, 8192
    cfg = getattr(llama.LlamaConfig, shape)(n_layers=2)
    config = nf.ParallelConfig(cp_size=cp)
    mesh = config.build_abstract_mesh()
    specs = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    from models import train

    params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), specs))
    opt = nf.optim.adamw(3e-4)
    step = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh, transforms=[nf.ring_attention("cp")])
    lowered = step.lower(params, opt.init(params), train.abstract_batch(config, mesh, 1, seq * cp))
    kv = 2 * seq * cfg.n_kv_heads * cfg.head_dim * F32  # a rank's keys and values, one layer
    moved = lowered.cost_analysis()["comm_bytes"]
    assert moved["ppermute"] == pytest.approx(cfg.n_layers * kv * (3 * (cp - 1) + 1), rel=0.05)
