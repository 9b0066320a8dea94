"""nf.plan, the analytic layout planner: its closed forms against hand-computed numbers, its search
against cases whose answer is clear, its command line, and torchtitan's published rows."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re
import sys

import pytest

from models.llama import LlamaConfig
from ndfunc import plan as nfplan
from ndfunc._src.planner.cli import main
from ndfunc._src.planner.cluster import GiB, device
from ndfunc._src.planner.search import layouts
from ndfunc.plan import (Cluster, Device, Efficiency, Layout, Link, Options, TransformerShape, estimate,
                         memory_per_rank, plan)

LLAMA_8B = TransformerShape.named("llama3-8b")
LLAMA_70B = TransformerShape.named("llama3-70b")
REL = 1e-12  # the closed forms are float sums of a few terms: equal to rounding


def test_every_public_name_is_documented():
    for name in nfplan.__all__:
        obj = getattr(nfplan, name)
        assert callable(obj) and obj.__doc__, name


@pytest.mark.parametrize("name, published", [("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9), ("llama3-405b", 405.9e9)])
def test_param_counts_match_metas_figures(name, published):
    # Meta's model cards round to three significant figures
    assert TransformerShape.named(name).num_params == pytest.approx(published, rel=1e-3)


def test_param_count_by_hand():
    # 8B: embedding and output 128256 x 4096 each; a layer 2*4096^2 + 2*4096*1024 + 3*4096*14336 + 2*4096
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert LLAMA_8B.num_params == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248
    tied = dataclasses.replace(LLAMA_8B, tie_embeddings=True)
    assert LLAMA_8B.num_params - tied.num_params == 128256 * 4096


def test_model_flops_follow_torchtitans_formula():
    # 6 * (params - embedding) + 12 * layers * heads * head_dim * seq
    s = 8192
    assert LLAMA_8B.model_flops_per_token(s) == 6 * (8_030_261_248 - 128256 * 4096) + 12 * 32 * 32 * 128 * s


def test_from_config_reads_the_repos_llama_config():
    cfg = LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336)
    assert dataclasses.replace(TransformerShape.from_config(cfg), name="llama3-8b") == LLAMA_8B
    with pytest.raises(TypeError, match=r"lacks \['vocab_size'"):
        TransformerShape.from_config(object())


def test_from_config_reads_a_hugging_face_config():
    # Meta's Llama 3.1 8B config.json as transformers reads it; a config without key/value heads of
    # its own (multi-head attention) has as many as query heads
    from transformers import LlamaConfig as HFLlamaConfig

    hf = HFLlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
    assert dataclasses.replace(TransformerShape.from_config(hf), name="llama3-8b") == LLAMA_8B
    mha = TransformerShape.from_config(HFLlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=None))
    assert mha.n_kv_heads == 4
    with pytest.raises(TypeError, match=r"lacks \['vocab_size', 'num_hidden_layers'"):
        TransformerShape.from_config(type("Half", (), {"hidden_size": 8})())


def test_from_config_counts_what_transformers_builds():
    # a config.json as parsed (a dict): no key/value heads of its own is multi-head attention, as
    # transformers reads it; a head_dim of its own (Qwen3's, Gemma's) sizes q, k, v and o: the
    # parameter count is transformers' own model's, built on the meta device
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    base = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4}
    assert TransformerShape.from_config(base).n_kv_heads == 4
    for extra in ({"num_key_value_heads": 2, "head_dim": 96}, {"num_key_value_heads": 1, "tie_word_embeddings": True}):
        with torch.device("meta"):
            model = LlamaForCausalLM(HFLlamaConfig(**base, **extra))
        shape = TransformerShape.from_config({**base, **extra})
        assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert TransformerShape.from_config({**base, "head_dim": 96}).q_dim == 384
    with pytest.raises(ValueError, match=r"^TransformerShape\.tie_embeddings must be True or False, got 'false'\.$"):
        TransformerShape.from_config({**base, "tie_word_embeddings": "false"})


# Published totals and active parameters (per token) of mixtures of experts, each from its config.json:
# Mistral's announcement of Mixtral 8x7B ("46.7B total parameters but only uses 12.9B parameters per
# token"), the model cards of Qwen3-30B-A3B ("30.5B in total and 3.3B activated") and
# Qwen1.5-MoE-A2.7B ("14.3B parameters in total and 2.7B activated"), and OLMoE-1B-7B's paper
# (Muennighoff et al. 2024: 6.9B total, 1.3B active).
PUBLISHED_MOE = {
    "mixtral-8x7b": ({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                      "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False}, 46.7e9, 12.9e9),
    "qwen3-30b-a3b": ({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                       "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                       "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                       "tie_word_embeddings": False}, 30.5e9, 3.3e9),
    "qwen1.5-moe-a2.7b": ({"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
                           "intermediate_size": 5632, "moe_intermediate_size": 1408,
                           "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                           "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
                           "tie_word_embeddings": False}, 14.3e9, 2.7e9),
    "olmoe-1b-7b": ({"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
                     "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
                     "num_experts": 64, "num_experts_per_tok": 8, "tie_word_embeddings": False}, 6.9e9, 1.3e9),
}


@pytest.mark.parametrize("name", PUBLISHED_MOE)
def test_a_mixture_of_experts_counts_its_published_total_and_active_parameters(name):
    config, total, active = PUBLISHED_MOE[name]
    shape = TransformerShape.from_config(config)
    # to the last digit published, a tenth of a billion (Qwen3's 3.35e9 is published as 3.3B: truncated)
    assert shape.num_params == pytest.approx(total, abs=0.1e9)
    assert shape.active_params == pytest.approx(active, abs=0.1e9)


def test_a_mixture_of_experts_by_hand():
    mixtral = TransformerShape.from_config(PUBLISHED_MOE["mixtral-8x7b"][0])
    d, f, attention = 4096, 14336, 2 * 4096 * 4096 + 2 * 4096 * 1024
    layer = attention + 8 * 3 * d * f + d * 8 + 2 * d  # attention, 8 experts, the router, two norms
    assert (mixtral.n_experts, mixtral.experts_per_token, mixtral.ffn_dim) == (8, 2, f)
    assert mixtral.num_params == 2 * 32000 * d + 32 * layer + d == 46_702_792_704
    assert mixtral.active_params == mixtral.num_params - 32 * 6 * 3 * d * f
    # torchtitan's convention for a mixture: 6 x the parameters a token reads, bar the embedding
    assert mixtral.model_flops_per_token(4096) == 6 * (mixtral.active_params - 32000 * d) + 12 * 32 * d * 4096
    # the experts' forward again inside their backward: 4 x 2 flops a weight, the rest 3; +1 recomputed,
    # but for the experts, whose backward remade theirs
    layers, experts, output, _ = mixtral.executed_flops_per_token(4096, "full")
    assert experts == 32 * 2 * 2 * 3 * d * f * 4
    assert layers == 32 * 2 * (attention + d * 8) * 4 and output == 2 * 32000 * d * 3
    # Qwen2-MoE's shared expert and its gate: 3 x dim x width + dim, taken by every token
    qwen = TransformerShape.from_config(PUBLISHED_MOE["qwen1.5-moe-a2.7b"][0])
    assert qwen.layer_mlp_params == 60 * 3 * 2048 * 1408 + 2048 * 60 + 3 * 2048 * 5632 + 2048
    assert qwen.active_params == qwen.num_params - 24 * 56 * 3 * 2048 * 1408


def test_a_mixture_of_experts_counts_what_transformers_builds():
    # each family built small on the meta device; what the shape leaves out is a few hundred weights
    # a layer, by hand: Qwen2-MoE's q, k, v biases, Qwen3-MoE's per-head q and k norms, OLMoE's q and k
    # norms over their whole width
    import torch
    import transformers

    base = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2}
    cases = [(transformers.MixtralConfig, {"num_local_experts": 4}, 0),
             (transformers.Qwen2MoeConfig, {"num_experts": 4, "moe_intermediate_size": 128,
                                            "shared_expert_intermediate_size": 384}, 2 * (256 + 2 * 128)),
             (transformers.Qwen3MoeConfig, {"num_experts": 4, "moe_intermediate_size": 128, "head_dim": 64},
              2 * (64 + 64)),
             (transformers.OlmoeConfig, {"num_experts": 4}, 2 * (256 + 128))]
    for config_class, extra, left_out in cases:
        config = config_class(**base, **extra)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        shape = TransformerShape.from_config(config)
        assert shape.n_experts == 4 and shape.num_params + left_out == sum(p.numel() for p in model.parameters()), \
            config_class.__name__
        # the same read from the config.json transformers writes
        assert TransformerShape.from_config(config.to_dict()) == shape


@pytest.mark.parametrize("extra, message", [
    ({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8},
     "the config describes DeepSeek's mixture of experts (n_routed_experts=256), whose latent attention and dense "
     "first layers are not a TransformerShape's. Plan this model from its own step instead: ndfunc.plan.plan_step."),
    ({"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4, "mlp_only_layers": [0, 1]},
     "the config describes a mixture of experts whose layers differ (decoder_sparse_step=None, mlp_only_layers=[0, "
     "1]: some take a dense MLP); a TransformerShape's layers are all alike. Plan this model from its own step "
     "instead: ndfunc.plan.plan_step."),
    ({"model_type": "gpt_oss", "num_local_experts": 32, "num_experts_per_tok": 4},
     "the config describes a gpt_oss mixture of experts (num_local_experts=32); the closed forms know mixtral, "
     "qwen2_moe, qwen3_moe, olmoe, whose layers are a TransformerShape's. Plan this model from its own step "
     "instead: ndfunc.plan.plan_step."),
    ({"num_local_experts": 8},
     "the config describes a mixture of experts (num_local_experts=8) without num_experts_per_tok, the experts "
     "each token takes. Plan this model from its own step instead: ndfunc.plan.plan_step."),
])
def test_a_mixture_of_experts_not_of_this_shape_says_what_to_use(extra, message):
    base = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4}
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        TransformerShape.from_config({**base, **extra})


def test_a_mixture_of_experts_shape_checks_its_fields():
    with pytest.raises(ValueError, match=r"^TransformerShape: experts_per_token must be 1 to n_experts \(8\), got 9\.$"):
        TransformerShape(1000, 256, 2, 4, 4, 512, n_experts=8, experts_per_token=9)
    with pytest.raises(ValueError, match=r"^TransformerShape: experts_per_token \(2\) and shared_ffn_dim \(0\) "
                                         r"describe a mixture of experts; give n_experts too\.$"):
        TransformerShape(1000, 256, 2, 4, 4, 512, experts_per_token=2)


def test_a_mixture_of_experts_is_priced_as_ndfunc_runs_it():
    # The experts run on each rank's own tokens, their weights whole over tp: FSDP alone shards them
    # (16 B a parameter), gathers a layer's every expert, and under TP their fp32 gradients (each
    # rank's FSDP shard) are all-reduced over tp; the rest is split by Megatron's plan
    mixtral = TransformerShape.from_config(PUBLISHED_MOE["mixtral-8x7b"][0])
    experts = 32 * mixtral.layer_mlp_params
    lay = Layout(dp_shard=4, tp=2)
    mem = memory_per_rank(mixtral, lay, Options("full"), 4096)
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(
        16 * ((mixtral.num_params - experts) / 8 + experts / 4), rel=REL)
    layer = (mixtral.layer_params - mixtral.layer_mlp_params) / 2 + mixtral.layer_mlp_params
    assert mem.gathered == pytest.approx(2 * layer * 2 + layer * 6, rel=REL)  # two units in bf16, one's gradient
    # the experts' activations: the router's probabilities and the chosen experts, beside attention's
    # (norms, q, k, v, attention output), and one layer's experts while they run
    d, k = 4096, 1024
    assert mixtral.activation_bytes_per_token("none") == 2 * (4 * d + 2 * d + 2 * k) + 4 * 8 + 12 * 2
    assert mixtral.moe_rebuilt_bytes_per_token() == 2 * 2 * (2 * d + 4 * 14336)
    none = memory_per_rank(mixtral, lay, Options("none"), 4096)
    assert none.activations == pytest.approx(4096 / 2 * (32 * mixtral.activation_bytes_per_token("none")
                                                         + mixtral.moe_rebuilt_bytes_per_token()), rel=REL)
    c = Cluster.of("h100", 8, gpus_per_node=2)  # tp on NVLink, FSDP over the fabric
    e = estimate(mixtral, lay, Options("full"), cluster=c, global_batch=4, seq_len=4096)
    size = 4096 * d * 2
    activations = (6 * 32 + 2) * 2 * size / 2  # Megatron's pairs, as a dense model's
    assert e.intra_bytes == pytest.approx(activations + 2 * experts / 4 * 4 / 2, rel=REL)
    dense = dataclasses.replace(mixtral, n_experts=0, experts_per_token=0)
    assert estimate(dense, lay, Options("full"), cluster=c, global_batch=4, seq_len=4096).intra_bytes == \
        pytest.approx(activations, rel=REL)


def test_python_m_ndfunc_plan_prints_no_warning():
    import subprocess

    done = subprocess.run([sys.executable, "-m", "ndfunc.plan", "--help"], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("usage: python -m ndfunc.plan") and done.stderr == ""


def test_where_nothing_fits_the_plan_says_what_would(capsys):
    # Llama 3 405B on 8 H100s: its parameters, gradients and Adam state need 16 B x 405.9e9 / 8 =
    # 756.0 GiB a rank before any activation; the advice is GPUs, not shorter sequences
    p = plan(TransformerShape.named("llama3-405b"), cluster=Cluster.of("h100", 8), global_batch=8, seq_len=8192)
    layout, _, memory = p.closest
    assert p.rows == () and memory.total == min(memory_per_rank(p.model, lay, opt, 8192).total
                                                for lay in layouts(p.model, p.cluster, 8, 8192)
                                                for opt in [Options("full", 1, 8 // lay.dp_size)])
    assert ("Parameters, gradients and optimizer state alone take 756.0 GiB a rank sharded 8 ways: add GPUs (about "
            "10x as many) or GPUs with more memory; a shorter sequence or smaller batch cannot help.") in p.advice()
    with pytest.raises(ValueError, match="no layout fits: .*: add GPUs"):
        p.best
    # Llama 3 8B at a million tokens a sequence: the state fits, the activations do not
    long = plan(LLAMA_8B, cluster=Cluster.of("h100", 8), global_batch=8, seq_len=2**20)
    assert long.rows == () and long.advice().endswith("Shorten sequences, lower the global batch per GPU, or add GPUs.")
    assert plan(LLAMA_8B, cluster=Cluster.of("h100", 8), global_batch=8, seq_len=2**20, remat="none").advice().endswith(
        "Shorten sequences, lower the global batch per GPU, allow full remat, or add GPUs.")
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "llama3-405b", "--gpus", "8", "--global-batch", "8", "--seq-len", "8192"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert "No layout fits in memory. The least any layout needs is 764.7 GiB per rank" in out


def test_cli_plans_a_hugging_face_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "_name_or_path": "my-llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}))
    main(["--model", str(tmp_path), "--gpus", "16", "--global-batch", "32", "--seq-len", "8192", "--top", "3"])
    assert "my-llama on 16 x H100-SXM-80GB" in capsys.readouterr().out
    (tmp_path / "qwen-like.json").write_text(json.dumps({  # a file of another name is named by it
        "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True}))
    main(["--model", str(tmp_path / "qwen-like.json"), "--gpus", "8", "--global-batch", "8", "--seq-len", "4096"])
    assert "qwen-like on 8 x H100-SXM-80GB" in capsys.readouterr().out
    (tmp_path / "mixtral.json").write_text(json.dumps(PUBLISHED_MOE["mixtral-8x7b"][0]))  # a mixture of experts
    main(["--model", str(tmp_path / "mixtral.json"), "--gpus", "64", "--global-batch", "256", "--seq-len", "4096"])
    assert "mixtral on 64 x H100-SXM-80GB" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "bad.json"), "--gpus", "8", "--global-batch", "8", "--seq-len", "128"])
    assert "cannot read a model shape from" in capsys.readouterr().err


def test_ring_costs_by_hand():
    link = Link(bandwidth=50e9, latency=10e-6)
    # 8 ranks, 1 GB: 7 hops of 10 us + 7/8 GB at 50 GB/s
    assert link.all_gather(8, 1e9) == pytest.approx(7 * 10e-6 + 0.875e9 / 50e9, rel=REL)
    assert link.reduce_scatter(8, 1e9) == link.all_gather(8, 1e9)
    assert link.all_reduce(8, 1e9) == pytest.approx(2 * link.all_gather(8, 1e9), rel=REL)
    assert link.all_reduce(1, 1e9) == 0.0  # a size-1 axis: the collective is the identity


def test_axes_pick_their_link_by_the_ranks_they_span():
    c = Cluster.of("h100", 64)
    lay = Layout(dp_replicate=2, dp_shard=4, cp=2, tp=4)
    assert [lay.stride(a) for a in ("dp_replicate", "dp_shard", "cp", "tp")] == [32, 8, 4, 1]
    assert not lay.crosses_nodes("tp", c) and not lay.crosses_nodes("cp", c)  # 4 and 2 x 4 ranks: one node
    assert lay.crosses_nodes("dp_shard", c) and lay.crosses_nodes("fsdp", c) and lay.crosses_nodes("dp_replicate", c)
    assert lay.link("tp", c) == c.intra and lay.link("fsdp", c) == c.inter


def test_fsdp_state_is_16_bytes_per_param_over_the_shards():
    lay = Layout(dp_shard=4, cp=2, tp=2)  # FSDP over dp_shard x cp, and TP: 16 shards
    mem = memory_per_rank(LLAMA_8B, lay, Options("full"), 8192)
    assert mem.params + mem.grads + mem.optimizer == pytest.approx(16 * LLAMA_8B.num_params / 16, rel=REL)
    replicated = memory_per_rank(LLAMA_8B, Layout(dp_replicate=16), Options("full"), 8192)
    assert replicated.params + replicated.grads + replicated.optimizer == 16 * LLAMA_8B.num_params
    assert replicated.gathered == 0  # no FSDP, nothing gathered


def test_activation_bytes_by_policy():
    d, k, f = 4096, 1024, 14336
    assert LLAMA_8B.activation_bytes_per_token("none") == 2 * (6 * d + 2 * k + 4 * f)
    assert LLAMA_8B.activation_bytes_per_token("selective") == 2 * (4 * d + 2 * k + 2 * f)
    assert LLAMA_8B.activation_bytes_per_token("full") == 2 * d
    # TP with sequence parallelism and CP divide them: tokens by cp, every tensor by tp
    one = memory_per_rank(LLAMA_8B, Layout(dp_shard=8), Options("selective"), 8192)
    split = memory_per_rank(LLAMA_8B, Layout(cp=2, tp=4), Options("selective"), 8192)
    assert split.activations == pytest.approx(one.activations / 8, rel=REL)
    with pytest.raises(ValueError, match="unknown remat policy 'save_all': expected one of none, selective, full"):
        LLAMA_8B.activation_bytes_per_token("save_all")


def test_tp_comm_per_layer_by_hand():
    c = Cluster.of("h100", 8)
    e = estimate(LLAMA_8B, Layout(tp=8), Options("selective", micro_batch=2), cluster=c, global_batch=2, seq_len=4096)
    # per layer 2 all-gather + reduce-scatter pairs forward and 2 backward, + 2 for embedding/output,
    # each over the full activation 2 x 4096 tokens x 4096 dim x 2 bytes
    size, pairs = 2 * 4096 * 4096 * 2, 4 * 32 + 2
    assert e.time.tp == pytest.approx(pairs * c.intra.all_reduce(8, size), rel=REL)
    assert e.intra_bytes == pytest.approx(pairs * 2 * size * 7 / 8, rel=REL) and e.inter_bytes == 0
    full = estimate(LLAMA_8B, Layout(tp=8), Options("full", micro_batch=2), cluster=c, global_batch=2, seq_len=4096)
    assert full.time.tp == pytest.approx((6 * 32 + 2) * c.intra.all_reduce(8, size), rel=REL)  # recompute


def test_fsdp_comm_hides_behind_compute_but_its_edges():
    c = Cluster.of("h100", 8)
    e = estimate(LLAMA_8B, Layout(dp_shard=8), Options("selective", 2), cluster=c, global_batch=16, seq_len=8192)
    edge = (LLAMA_8B.embedding_params + LLAMA_8B.layer_params)
    assert e.time.fsdp == pytest.approx(c.intra.all_gather(8, edge * 2) + c.intra.reduce_scatter(8, edge * 4), rel=REL)
    # bytes each rank sends: bf16 gathers forward and backward, fp32 reduce-scatter, 7/8 of each
    assert e.intra_bytes == pytest.approx((2 * 2 + 4) * LLAMA_8B.num_params * 7 / 8, rel=REL)
    waits = estimate(LLAMA_8B, Layout(dp_shard=8), Options("selective", 2, prefetch=False), cluster=c,
                     global_batch=16, seq_len=8192)
    assert waits.time.fsdp > e.time.fsdp and waits.memory.gathered < e.memory.gathered


def test_70b_on_8_h100s_fits_no_layout():
    p = plan(LLAMA_70B, cluster=Cluster.of("h100", 8), global_batch=8, seq_len=8192)
    assert p.rows == () and p.dropped == p.considered > 0
    replicated = memory_per_rank(LLAMA_70B, Layout(dp_replicate=8), Options("full"), 8192)
    assert replicated.total > 1000 * GiB  # 16 B x 70.6e9 on every rank
    with pytest.raises(ValueError, match="no layout fits"):
        p.best


def test_fsdp_beats_pure_dp_for_a_model_that_does_not_fit_replicated():
    p = plan(LLAMA_8B, cluster=Cluster.of("h100", 8), global_batch=16, seq_len=8192)
    assert p.best.layout.fsdp_size > 1
    assert all(e.layout != Layout(dp_replicate=8) for e in p.rows)  # 128 GB of state per rank: dropped


def test_tp_stays_in_a_node_and_a_slow_fabric_moves_traffic_onto_nvlink():
    slow = Cluster(16, 8, device("h100"), 450e9, 1e-6, 1e9, 10e-6)  # 1 GB/s between nodes
    assert all(lay.tp <= 8 for lay in layouts(LLAMA_8B, slow, 32, 4096))
    p = plan(LLAMA_8B, cluster=slow, global_batch=32, seq_len=4096)
    flat = estimate(LLAMA_8B, Layout(dp_shard=16), Options("selective", 2), cluster=slow, global_batch=32,
                    seq_len=4096)
    assert p.best.time.total < flat.time.total / 2  # FSDP over both nodes at 1 GB/s is far slower
    fast = plan(LLAMA_8B, cluster=Cluster.of("h100", 16), global_batch=32, seq_len=4096)
    assert p.best.inter_bytes < fast.best.inter_bytes


def test_rows_are_ranked_by_step_time_and_fit():
    p = plan(LLAMA_8B, cluster=Cluster.of("h100", 16), global_batch=64, seq_len=4096)
    times = [round(e.time.total, 9) for e in p.rows]  # equal to rounding: ranked by memory, then traffic
    assert times == sorted(times) and all(e.fits for e in p.rows)
    assert len({e.layout for e in p.shown(10)}) == len(p.shown(10))  # one line per layout
    assert "tok/s/GPU" in str(p) and p.table(3).row_count == 3


def test_under_cp_a_micro_batch_is_one_sequence_a_rank_and_the_rest_accumulates():
    # ndfunc keeps the sequence split over cp through the linears only so (`search`'s docstring);
    # without cp the largest micro-batch that fits is kept
    p = plan(LLAMA_8B, cluster=Cluster.of("h100", 16), global_batch=64, seq_len=4096)
    with_cp = [e for e in p.rows if e.layout.cp > 1]
    assert with_cp and all(e.options.micro_batch == 1 and e.options.grad_accum == 64 // e.layout.dp_size
                           for e in with_cp)
    assert any(e.options.micro_batch > 1 for e in p.rows if e.layout.cp == 1)


def test_a_1024_gpu_cluster_is_planned_over_every_layout_and_option():
    # (about 0.4 s on one slow core: the enumeration is closed forms, no lowering)
    p = plan(LLAMA_70B, cluster=Cluster.of("h100", 1024), global_batch=2048, seq_len=8192)
    found = layouts(LLAMA_70B, Cluster.of("h100", 1024), 2048, 8192)
    assert p.considered == sum(3 * (4 if lay.fsdp_size > 1 else 1) for lay in found)  # remat x FSDP flags
    assert len(p.rows) + p.dropped == p.considered and p.best.fits and p.best.layout.tp <= 8


def test_bad_inputs_say_what_to_do():
    with pytest.raises(TypeError, match=r"^plan: cluster must be a Cluster, got 'h100'; build one with Cluster\.of"):
        plan(LLAMA_8B, cluster="h100", global_batch=8, seq_len=128)
    with pytest.raises(ValueError, match=r"^plan: remat names the policies to try, one or more of none, selective, "
                                         r"full; got none\.$"):
        plan(LLAMA_8B, cluster=Cluster.of("h100", 8), global_batch=8, seq_len=128, remat=())
    only_full = plan(LLAMA_8B, cluster=Cluster.of("h100", 8), global_batch=8, seq_len=128, remat="full")
    assert {e.options.remat for e in only_full.rows} == {"full"}  # one policy by name, not its letters
    with pytest.raises(ValueError, match="unknown GPU 'v100': expected one of a100, h100, h200, b200"):
        Cluster.of("v100", 8)
    with pytest.raises(ValueError, match=r"CPUs have no vendor figures; measure them"):
        Cluster.of("cpu", 8)
    with pytest.raises(ValueError, match="use a multiple of 8 GPUs"):
        Cluster.of("h100", 12)
    with pytest.raises(ValueError, match=r"tp 16 must divide n_kv_heads 8"):
        estimate(LLAMA_8B, Layout(tp=16), Options(), cluster=Cluster.of("h100", 16), global_batch=1, seq_len=128)
    with pytest.raises(ValueError, match=r"micro_batch 1 x grad_accum 1 must equal the per-rank batch 2"):
        estimate(LLAMA_8B, Layout(dp_shard=8), Options(), cluster=Cluster.of("h100", 8), global_batch=16, seq_len=128)
    with pytest.raises(ValueError, match="A100-SXM-80GB has no fp8 tensor cores"):
        plan(LLAMA_8B, cluster=Cluster.of("a100", 8), global_batch=8, seq_len=128, float8=True)
    cpu = Device.cpu(memory_bytes=64 * GiB, peak_flops=1e12, memory_bandwidth=50e9)
    assert Cluster(2, 2, cpu, 10e9, 5e-6, 1e9, 50e-6).device.peak_fp8_flops is None
    with pytest.raises(ValueError, match="Efficiency.matmul must be in"):
        Efficiency(matmul=1.5)


def test_cli_prints_the_table(capsys):
    main(["--model", "llama3-8b", "--gpus", "16", "--gpu", "h100", "--global-batch", "32", "--seq-len", "4096",
          "--top", "3"])
    out = capsys.readouterr().out
    assert "llama3-8b on 16 x H100-SXM-80GB" in out
    for column in ("layout", "GiB/rank", "step s", "tok/s/GPU", "MFU", "NVLink GB", "fabric GB"):
        assert column in out


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "v100"], "--gpu 'v100' is not a built-in GPU; expected one of a100, h100, h200, b200"),
    (["--model", "gpt2"], "--model 'gpt2' is neither a built-in model (llama3-8b, llama3-70b, llama3-405b) nor a "
                          "file; pass one of those names or the path of a Hugging Face config.json."),
    (["--gpus", "12"], "--gpus 12 is not a whole number of nodes of --gpus-per-node 8; use a multiple of 8"),
    (["--gpu", "a100", "--float8", ""], "--float8: the A100-SXM-80GB has no fp8 tensor cores; drop --float8."),
    (["--efficiency", "0"], "--efficiency is a fraction of the device's peak, in (0, 1]; got 0.0."),
])
def test_cli_errors(capsys, argv, message):
    base = {"--gpus": "16", "--global-batch": "32", "--seq-len": "4096"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    with pytest.raises(SystemExit) as exit_:
        main([x for kv in base.items() for x in kv if x])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_torchtitans_published_rows_within_20_percent_and_in_order(monkeypatch):
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "plan_validation.py"
    spec = importlib.util.spec_from_file_location("plan_validation", path)
    validation = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "plan_validation", validation)  # its dataclasses look their module up
    spec.loader.exec_module(validation)
    predicted = [validation.predict(row).tokens_per_s_per_gpu for row in validation.ROWS]
    published = [row.published_tps for row in validation.ROWS]
    assert all(abs(p / q - 1) <= validation.GOAL for p, q in zip(predicted, published)), list(zip(predicted, published))
    assert validation.same_order(published, predicted)
