"""Vocabulary-parallel embedding and cross-entropy (Megatron's): a table split by rows and logits
split over the classes stay split; each rank looks up, and picks the targets in, its own slice,
and what moves is a pending sum or max per token, never the table or the logits. Held to the
single device, and to the closed form of tensor parallelism's traffic."""

import math

import optree
import pytest
import torch

import ndfunc as nf
from ndfunc._src.partition.program import collectives
from ndfunc.sharding import AbstractMesh, NamedSharding, P

V, D, N = 64, 16, 24  # vocabulary, embedding width, tokens
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32; only the order of the sums over the classes differs


def _tokens(g, ignore=None):
    tokens = torch.randint(0, V, (N,), generator=g)
    if ignore is not None:
        tokens[::3] = ignore
    return tokens


@pytest.mark.parametrize("padding_idx", [None, 5])
def test_a_lookup_in_a_table_split_by_rows_equals_the_whole_tables(padding_idx):
    g = torch.Generator().manual_seed(0)
    table, w = torch.randn(V, D, generator=g), torch.randn(D, generator=g)
    tokens = _tokens(g)
    tokens[:4] = 5  # the padding row is looked up (and gets no gradient)

    def loss(table, tokens):
        return torch.tanh(torch.nn.functional.embedding(tokens, table, padding_idx=padding_idx) @ w).sum()

    step = torch.func.grad_and_value(loss)
    expected = step(table, tokens)
    with nf.simulate(4):
        jitted = nf.jit(step, mesh=nf.make_mesh(tp=4), in_shardings=(P("tp"), P()), out_shardings=(P("tp"), P()))
        lowered = jitted.lower(table, tokens)
        got = nf.device_get(jitted(table, tokens))
    torch.testing.assert_close(got, expected, **TOL)
    moved = [(c.kind, c.sent) for _, c in collectives(lowered.program.local)]
    # the lookup's pending sum (or what it becomes), once; the table and its gradient never move
    assert len(moved) == 1 and moved[0][0] == "all_reduce" and math.prod(moved[0][1]) <= N * D, moved


@pytest.mark.parametrize("ignore_index", [-100, 0])  # 0: a class that is also a vocabulary entry
def test_a_cross_entropy_over_logits_split_by_class_equals_the_whole_logits(ignore_index):
    g = torch.Generator().manual_seed(1)
    x, head = torch.randn(N, D, generator=g), torch.randn(D, V, generator=g)
    targets = _tokens(g, ignore=ignore_index)

    def loss(head, x, targets):
        return torch.nn.functional.cross_entropy(x @ head, targets, ignore_index=ignore_index)

    step = torch.func.grad_and_value(loss)
    expected = step(head, x, targets)
    with nf.simulate(4):
        jitted = nf.jit(step, mesh=nf.make_mesh(tp=4), in_shardings=(P(None, "tp"), P(), P()),
                        out_shardings=(P(None, "tp"), P()))
        lowered = jitted.lower(head, x, targets)
        got = nf.device_get(jitted(head, x, targets))
    torch.testing.assert_close(got, expected, **TOL)
    moved = [(c.kind, c.sent) for _, c in collectives(lowered.program.local)]
    # per token a max and a sum of exponentials, and the picked scores' sum: no logits, no head
    assert moved and all(kind == "all_reduce" and math.prod(sent) <= N for kind, sent in moved), moved


@pytest.mark.slow  # two Llama-3-shaped steps lowered
def test_tensor_parallel_llama_moves_megatrons_activations_and_nothing_else():
    # Megatron-LM's tensor parallelism (Shoeybi et al. 2019, sec. 3): per layer two all-reduces of
    # the (B, S, D) activations forward and two backward, one for the vocabulary-parallel embedding's
    # lookup and one for the output projection's input gradient; the logits and the vocabulary-sized
    # weights stay split. Llama 3 8B's and 70B's shapes (two layers: the count is per layer)
    from models import llama, train

    for base in (llama.LlamaConfig.llama3_8b, llama.LlamaConfig.llama3_70b):
        cfg, tp, seq = base(n_layers=2), 8, 1024
        config = nf.ParallelConfig(tp_size=tp)
        mesh = config.build_abstract_mesh()
        specs = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), specs))
        opt = nf.optim.adamw(3e-4)
        lowered = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh).lower(
            params, opt.init(params), train.abstract_batch(config, mesh, 1, seq))
        activation = 1 * seq * cfg.dim * 4
        expected = (4 * cfg.n_layers + 2) * 2 * (tp - 1) / tp * activation
        moved = lowered.cost_analysis()["comm_bytes"]
        assert moved["total"] == pytest.approx(expected, rel=0.05), (cfg.dim, moved)
        # each an all-reduce, or the reduce-scatter and all-gather that make one with the tokens
        # split between them (Megatron's sequence parallelism, Korthikanti et al. 2022): the same bytes
        pairs = moved.get("reduce_scatter", 0.0)
        assert moved.get("all_gather", 0.0) == pytest.approx(pairs, rel=1e-3)  # (and a few scalars)
        assert moved["all_reduce"] + 2 * pairs == pytest.approx(moved["total"], rel=1e-3)
        # and the memory: no rank holds a whole (S, V) logits tensor
        logits = seq * cfg.vocab_size * 4
        assert lowered.memory_analysis().temp_size_in_bytes < logits


@pytest.mark.slow  # Llama-3-shaped steps lowered
@pytest.mark.parametrize("shape", ["llama3_8b", "llama3_70b"])
def test_the_cross_entropy_gradient_stays_split_over_the_vocabulary(shape):
    # Megatron's cross-entropy backward: each rank writes the gradient of its slice of the
    # vocabulary (-1/N at a target in its slice, 0 elsewhere). Made whole on every rank and then
    # sliced, the target mask and the gradient are (tokens x vocabulary) each: 4 GiB a rank at
    # 8,192 tokens and Llama 3's 128,256 entries, more than the rest of the loss
    from models import llama, train

    # (FSDP over 128 ranks by 8-way TP, bf16, every layer recomputed: docs/planning.md's 70B plan)
    cfg, seq = getattr(llama.LlamaConfig, shape)(n_layers=4, remat="full"), 8192
    config = nf.ParallelConfig(dp_shard_size=128, tp_size=8)
    transforms = [nf.fsdp("dp_shard"), nf.mixed_precision(torch.bfloat16, torch.float32)]
    lowered = train.lower_abstract(cfg, config, seq, transforms)
    whole = [(n.name, tuple(n.meta["val"].shape)) for n in lowered.program.local.graph.nodes
             if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() >= seq * cfg.vocab_size]
    assert not whole, whole


def test_an_abstract_mesh_places_an_embedding_table_by_rows():
    mesh = AbstractMesh({"tp": 8})
    table = nf.ShapeDtypeStruct((128256, 4096), torch.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    tokens = nf.ShapeDtypeStruct((4, 8192), torch.long)
    lowered = nf.jit(lambda t, i: torch.nn.functional.embedding(i, t), mesh=mesh, out_shardings=P()).lower(table, tokens)
    (only,) = collectives(lowered.program.local)
    assert only[1].kind == "all_reduce" and only[1].sent == (4, 8192, 4096)
