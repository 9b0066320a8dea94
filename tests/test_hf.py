"""models/hf.py against Hugging Face transformers' LlamaForCausalLM: same weights, same logits."""

import pytest
import torch
import transformers

import ndfunc as nf
from models import hf, llama
from ndfunc.sharding import NamedSharding, logical_to_mesh

# fp32 logits of two implementations of the same math; the issue asks for 1e-5.
ATOL = RTOL = 1e-5


def hf_model(tie: bool, seed: int = 0):
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, attention_bias=False, mlp_bias=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norm scales start at 1; make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def tokens(vocab: int, seed: int = 1):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["one-file", "sharded-index"])
def test_logits_match_transformers(tmp_path, tie, max_shard_size):
    model = hf_model(tie)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        assert (tmp_path / "model.safetensors.index.json").exists()
    cfg, params = hf.load_llama(tmp_path)
    assert cfg.tie_embeddings == tie and cfg.n_kv_heads == 2 and ("lm_head" in params) == (not tie)
    assert cfg.rope_theta == 500000.0  # not the default: a loader that dropped it would fail below
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        expected = model(x).logits
    torch.testing.assert_close(llama.apply(params, x, cfg), expected, atol=ATOL, rtol=RTOL)


def test_positions_shift_rope_like_transformers(tmp_path):
    model = hf_model(False)
    model.save_pretrained(tmp_path)
    cfg, params = hf.load_llama(tmp_path)
    x = tokens(cfg.vocab_size)
    positions = torch.arange(5, 5 + x.shape[1]).expand(x.shape)
    with torch.no_grad():
        expected = model(x, position_ids=positions).logits
    torch.testing.assert_close(llama.apply(params, x, cfg, positions), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_save_llama_loads_in_transformers(tmp_path, tie):
    cfg = llama.LlamaConfig(vocab_size=96, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=80, tie_embeddings=tie)
    gen = torch.Generator().manual_seed(3)
    params = nf.tree.tree_map_with_path(
        lambda p, shape: torch.randn(shape, generator=gen) * 0.1, llama.param_shapes(cfg))
    hf.save_llama(tmp_path, cfg, params)
    assert_transformers_computes_what_ndfunc_does(tmp_path, cfg, params)
    cfg2, params2 = hf.load_llama(tmp_path)
    assert cfg2 == cfg
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(nf.tree.tree_flatten_with_path(params)[0],
                                                           nf.tree.tree_flatten_with_path(params2)[0]))


@pytest.mark.parametrize("sizes", [dict(dp_shard_size=4), dict(dp_shard_size=2, tp_size=2), dict(cp_size=2, tp_size=2)])
def test_sharded_load_reads_each_rank_its_block(tmp_path, sizes):
    model = hf_model(False)
    model.save_pretrained(tmp_path)
    cfg, whole = hf.load_llama(tmp_path)
    config = nf.ParallelConfig(**sizes)
    with nf.simulate(4):
        mesh = config.build_mesh()
        specs = logical_to_mesh(llama.param_axes(cfg), config.rules)
        shardings = nf.tree.tree_map_with_path(lambda p, s: NamedSharding(mesh, s), specs)
        _, sharded = hf.load_llama(tmp_path, shardings)
        spec_of = dict(nf.tree.tree_flatten_with_path(specs)[0])
        for (path, x), (_, full) in zip(nf.tree.tree_flatten_with_path(sharded)[0], nf.tree.tree_flatten_with_path(whole)[0]):
            sharding = nf.sharding_of(x)
            assert sharding.is_equivalent_to(NamedSharding(mesh, spec_of[path]), full.ndim), path
            blocks = x.to_local()._local_tensors
            for rank, index in enumerate(sharding.shard_indices(full.shape)):
                assert torch.equal(blocks[rank], full[index]), (path, rank)


BASE = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 80, "rms_norm_eps": 1e-5}


@pytest.mark.parametrize("extra, message", [
    ({"head_dim": 16}, r"config.json has head_dim 16 but hidden_size 64 / num_attention_heads 8 = 8"),
    ({"attention_bias": True}, r"config.json has attention_bias = True; ndfunc's Llama computes only attention_bias = False"),
    ({"mlp_bias": True}, r"has mlp_bias = True"),
    ({"hidden_act": "gelu"}, r"has hidden_act = 'gelu'; ndfunc's Llama computes only hidden_act = 'silu'"),
    ({"model_type": "mistral"}, r"has model_type = 'mistral'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"has rope type = 'linear'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, r"has rope type = 'llama3'"),
    ({"partial_rotary_factor": 0.5}, r"has partial_rotary_factor = 0.5"),
])
def test_unsupported_configs_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        hf.config_from_hf({**BASE, **extra})


def test_config_defaults_follow_transformers():
    cfg = hf.config_from_hf({k: v for k, v in BASE.items() if k != "rms_norm_eps"})
    assert cfg.norm_eps == transformers.LlamaConfig().rms_norm_eps


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path):
    import json

    hf_model(False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 40
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(80, 64\) in model.safetensors, "
                                         r"but config.json describes \(40, 64\)"):
        hf.load_llama(tmp_path)


@pytest.mark.parametrize("sizes", [dict(dp_shard_size=4), dict(dp_shard_size=2, cp_size=2, tp_size=2)],
                         ids=["fsdp4", "4d"])
def test_save_llama_from_sharded_parameters_loads_in_transformers(tmp_path, sizes):
    cfg = llama.LlamaConfig(vocab_size=96, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=80)
    gen = torch.Generator().manual_seed(5)
    params = nf.tree.tree_map_with_path(lambda p, shape: torch.randn(shape, generator=gen) * 0.1,
                                        llama.param_shapes(cfg))
    config = nf.ParallelConfig(**sizes)
    with nf.simulate(config.total_size):
        mesh = config.build_mesh()
        specs = logical_to_mesh(llama.param_axes(cfg), config.rules)
        sharded = nf.device_put(params, nf.tree.tree_map_with_path(lambda p, s: NamedSharding(mesh, s), specs))
        hf.save_llama(tmp_path, cfg, sharded)
    assert_transformers_computes_what_ndfunc_does(tmp_path, cfg, params)


def assert_transformers_computes_what_ndfunc_does(path, cfg, params):
    """transformers' Llama loaded from `path` gives the logits ndfunc's gives with `params`."""
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        expected = model(x).logits
    torch.testing.assert_close(llama.apply(params, x, cfg), expected, atol=ATOL, rtol=RTOL)
