"""The reference Llama: structure, mesh-independent init, training signal, traceability.
(Numerical parity with Hugging Face transformers is in test_hf.py.)"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import ndfunc as nf
from models import data, llama
from ndfunc import random
from ndfunc.sharding import NamedSharding, logical_to_mesh

CFG = llama.LlamaConfig.tiny()
LOGICAL = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp"}


def test_param_axes_name_every_dim():
    params = llama.init(CFG, random.key(0))
    axes = dict(nf.tree.tree_flatten_with_path(llama.param_axes(CFG), is_leaf=lambda x: isinstance(x, tuple))[0])
    leaves = nf.tree.tree_flatten_with_path(params)[0]
    assert sorted(axes) == sorted(path for path, _ in leaves)
    for path, x in leaves:
        assert len(axes[path]) == x.ndim and set(axes[path]) <= LOGICAL, path


def test_presets():
    assert 90e6 < llama.LlamaConfig.small().num_params() < 110e6
    assert CFG.num_params() == sum(x.numel() for _, x in nf.tree.tree_flatten_with_path(llama.init(CFG, random.key(0)))[0])
    with pytest.raises(ValueError, match="n_heads 6 must be a multiple of n_kv_heads 4"):
        llama.LlamaConfig(vocab_size=8, dim=48, n_layers=1, n_heads=6, n_kv_heads=4, ffn_dim=8)


SPECS = [
    dict(dp_shard_size=-1),
    dict(dp_shard_size=-1, tp_size=2),
    dict(dp_replicate_size=2, dp_shard_size=-1),
    dict(cp_size=2, dp_shard_size=-1),
]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_sharded_init_is_bit_identical_on_any_mesh(ranks):
    key = random.key(7)
    reference = dict(nf.tree.tree_flatten_with_path(llama.init(CFG, key))[0])
    for sizes in SPECS:
        config = nf.ParallelConfig(**sizes)
        try:
            config = config.resolve(ranks)
        except ValueError:
            continue  # this layout needs more ranks than the world has
        with nf.simulate(ranks):
            mesh = config.build_mesh()
            specs = dict(nf.tree.tree_flatten_with_path(logical_to_mesh(llama.param_axes(CFG), config.rules))[0])
            for path, full in reference.items():
                sharding = NamedSharding(mesh, specs[path])
                x = nf.make_array_from_callback(
                    full.shape, sharding, lambda index: llama.init_param(CFG, key, path, tuple(full.shape), index))
                assert torch.equal(nf.device_get(x), full), (ranks, sizes, path)


def test_rope_depends_only_on_relative_position():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)

    def score(pq, pk):
        cq, sq = llama.rope_tables(torch.tensor([[pq]]), 16, 10000.0)
        ck, sk = llama.rope_tables(torch.tensor([[pk]]), 16, 10000.0)
        return (llama.apply_rope(q, cq, sq) * llama.apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(3, 1), score(103, 101), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_loss_ignores_padding_targets():
    params = llama.init(CFG, random.key(0))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(-1, dims=1)
    masked = targets.clone()
    masked[:, 8:] = llama.IGNORE_INDEX
    logits = llama.apply(params, tokens, CFG).double()
    # The definition, written out: mean over the kept targets of -log softmax(logits)[target].
    picked = logits[:, :8].log_softmax(-1).gather(-1, targets[:, :8, None])
    expected = -picked.mean().float()
    torch.testing.assert_close(llama.loss(params, {"tokens": tokens, "targets": masked}, CFG), expected)


def test_positions_place_tokens_so_a_permuted_sequence_gives_permuted_logits():
    params = llama.init(CFG, random.key(1))
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    expected = llama.apply(params, tokens, CFG)[:, perm]
    got = llama.apply(params, tokens[:, perm], CFG, perm.expand(2, 12))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_init_follows_the_key_device():
    params = llama.init(CFG, random.key(0).to("meta"))
    assert {x.device.type for _, x in nf.tree.tree_flatten_with_path(params)[0]} == {"meta"}


@pytest.mark.slow
def test_training_lowers_the_loss_on_the_corpus():
    sequences = data.Sequences(data.stdlib_corpus(1 << 20), seq_len=64, seed=0)
    params = llama.init(CFG, random.key(0))
    opt = nf.optim.adamw(3e-3, weight_decay=0.0)
    state = opt.init(params)
    step_grad = nf.value_and_grad(llama.loss)
    losses = []
    for batch in data.batches(sequences, batch_size=16, steps=50):
        loss, grads = step_grad(params, batch, CFG)
        updates, state = opt.update(grads, state, params)
        params = nf.optim.apply_updates(params, updates)
        losses.append(float(loss))
    # Byte-level text starts at ln(256) = 5.55 nats; 50 steps of a tiny model reach well below 4.
    assert losses[0] == pytest.approx(5.55, abs=0.1)
    assert sum(losses[-5:]) / 5 < 4.0, losses


def test_train_step_traces_to_one_graph_with_one_attention_node():
    params = llama.init(CFG, random.key(0))
    opt = nf.optim.adamw(1e-3)
    batch = next(data.batches(data.Sequences(data.stdlib_corpus(1 << 16), 32), 2))

    def step(params, state, batch):
        loss, grads = nf.value_and_grad(llama.loss)(params, batch, CFG)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss

    graph = make_fx(step, tracing_mode="fake")(params, opt.init(params), batch).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    attention = [t for t in targets if "scaled_dot_product" in t and "backward" not in t]
    assert len(attention) == CFG.n_layers, attention
    assert not [t for t in targets if "_local_scalar_dense" in t or t.startswith("aten.item")]
