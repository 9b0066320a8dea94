"""Hugging Face causal LMs as they are (transformers' own modules through `nf.nn.functional`), trained
by one jitted AdamW step on every strategy, against the eager model and `torch.optim.AdamW` on one
device. Specs come from the model's own TP plan (`nf.nn.partition_specs`)."""

import contextlib
import copy
import logging

import pytest
import torch
import transformers
from torch.distributed.tensor import Shard

import ndfunc as nf
from ndfunc._src import experts as experts_ops
from ndfunc.sharding import P

logging.getLogger("transformers").setLevel(logging.ERROR)
VOCAB, LR = 64, 1e-2
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)  # AdamW steps of lr 1e-2: a few fp32 ulps of the updates
# GPT-2 ships no TP plan; Megatron's, for its (in, out) Conv1D projections
GPT2_PLAN = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
             "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
# Gemma (its own head_dim, an embedding scale made from a Python number), Falcon (a layer that
# returns None beside its output) and Mixtral (experts picked by index: their gradients summed by
# index_put, whose CPU kernel adds in thread order) each met a bug the others did not
FAMILIES = ["llama", "gpt2", "qwen2", "mistral", "gemma", "falcon", "mixtral"]
# mesh axes, the batch's spec, transforms
STRATEGIES = {
    "dp": (dict(dp=2), P("dp"), ()),
    "fsdp": (dict(dp_shard=2), P("dp_shard"), ()),
    "fsdp_schedule": (dict(dp_shard=2), P("dp_shard"), ("fsdp",)),
    "tp": (dict(tp=2), P(), ()),
    "dp_tp": (dict(dp=2, tp=2), P("dp"), ()),
    "cp": (dict(cp=2), P(None, "cp"), ()),
    "cp_ring": (dict(cp=2), P(None, "cp"), ("ring",)),
}
QUICK = {("llama", "sdpa", "dp"), ("llama", "sdpa", "tp"), ("gpt2", "eager", "fsdp_schedule")}


def make_model(family: str, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    elif family == "falcon":
        config = transformers.FalconConfig(hidden_size=32, ffn_hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2,
                                           vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
        cls = transformers.FalconForCausalLM
    elif family.startswith("mixtral"):  # its experts as transformers' default calls them (grouped), or "mixtral:<impl>"
        config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=64,
                                            bos_token_id=0, eos_token_id=0, pad_token_id=0)
        config._attn_implementation = attn
        _, _, experts = family.partition(":")
        return transformers.AutoModelForCausalLM.from_config(config, **({"experts_implementation": experts} if experts else {}))
    elif family == "gemma":
        config = transformers.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                                          max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cls = transformers.GemmaForCausalLM
    else:
        config_cls, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
        config = config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                            eos_token_id=0, pad_token_id=0)
    config._attn_implementation = attn
    return cls(config)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))


_EAGER: dict = {}


def eager_run(family: str, attn: str, steps: int = 2):
    """Losses and parameters after `steps` steps of the eager model with torch.optim.AdamW."""
    if (family, attn, steps) not in _EAGER:
        _EAGER[family, attn, steps] = eager_run_of(make_model(family, attn), steps)
    return _EAGER[family, attn, steps]


def eager_run_of(model: torch.nn.Module, steps: int = 2, ids: torch.Tensor | None = None):
    """`eager_run` of this model (a copy trained on `ids`, else `tokens()`): losses, and parameters by name."""
    model, ids = copy.deepcopy(model), tokens() if ids is None else ids
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-5, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), {k: v.detach().clone() for k, v in model.named_parameters()}


def trained(apply, params, mesh, pspec, ids, buffers=None, bspec=None, lowered: list | None = None):
    """`eager_run_of`'s two AdamW steps, jitted on `mesh` (inside `nf.simulate`) with the batch split
    over dp_shard: losses, and parameters read back. `buffers` laid out by `bspec` are passed to the
    step (else `apply`'s are closed over); `lowered` gets the lowered step."""
    opt = nf.optim.adamw(LR, eps=1e-5, weight_decay=0.1)
    closed = buffers if bspec is None else None

    def step(params, state, *rest):
        *given, ids = rest
        held = given[0] if given else closed
        loss, grads = nf.value_and_grad(lambda p: apply(p, held, ids, labels=ids).loss)(params)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss

    state = opt.init(params)
    sspec = nf.optim.state_shardings(state, pspec)
    given, given_specs = ((), ()) if bspec is None else ((buffers,), (bspec,))
    f = nf.jit(step, mesh=mesh, in_shardings=(pspec, sspec, *given_specs, P("dp_shard")),
               out_shardings=(pspec, sspec, P()))
    if lowered is not None:
        lowered.append(f.lower(params, state, *given, ids))
    losses = []
    for _ in range(2):
        params, state, loss = f(params, state, *given, ids)
        losses.append(nf.device_get(loss))
    return torch.stack(losses), {k: nf.device_get(v) for k, v in params.items()}


def assert_as_eager(got, want) -> None:
    (losses, params), (want_losses, want_params) = got, want
    torch.testing.assert_close(losses, want_losses, **LOSS_TOL)
    for k, v in params.items():
        torch.testing.assert_close(v, want_params[k], **PARAM_TOL)


def jitted_run(family: str, attn: str, strategy: str, axes: dict | None = None, steps: int = 2):
    """The same steps by nf.jit on `strategy`, simulated (`axes`: on the real ranks of this process
    group, over these mesh axes instead): (losses, parameters, lowering count, the cost analysis where
    the ring runs, else None)."""
    simulated = axes is None
    default_axes, batch_spec, names = STRATEGIES[strategy]
    axes = default_axes if simulated else axes
    model, ids = make_model(family, attn), tokens()
    params, buffers, apply = nf.nn.functional(model)
    opt = nf.optim.adamw(LR, eps=1e-5, weight_decay=0.1)

    def step(params, state, ids):
        loss, grads = nf.value_and_grad(lambda p: apply(p, buffers, ids, labels=ids).loss)(params)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss

    with nf.simulate(int(torch.tensor(list(axes.values())).prod())) if simulated else contextlib.nullcontext():
        mesh = nf.make_mesh(**axes)
        pspec = nf.nn.partition_specs(model, mesh, tp="tp" if "tp" in axes else None,
                                      fsdp="dp_shard" if "dp_shard" in axes else None,
                                      plan=GPT2_PLAN if family == "gpt2" else None)
        state = opt.init(params)
        sspec = nf.optim.state_shardings(state, pspec)
        transforms = [nf.fsdp("dp_shard") if n == "fsdp" else nf.ring_attention("cp") for n in names]
        f = nf.jit(step, mesh=mesh, in_shardings=(pspec, sspec, batch_spec), out_shardings=(pspec, sspec, P()),
                   transforms=transforms, donate_argnums=(0, 1))
        cost = f.lower(params, state, ids).cost_analysis() if "ring" in names else None  # read for the ring only
        losses = []
        for _ in range(steps):
            params, state, loss = f(params, state, ids)
            losses.append(nf.device_get(loss))
        return torch.stack(losses), {k: nf.device_get(v) for k, v in params.items()}, f.trace_count, cost


def _attention(family: str, strategy: str) -> str:
    """Each family on each strategy once, the attention alternating between them, so every family
    and every strategy meets both implementations (the ring replaces SDPA: always SDPA there)."""
    if strategy == "cp_ring":
        return "sdpa"
    return ("sdpa", "eager")[(FAMILIES.index(family) + list(STRATEGIES).index(strategy)) % 2]


CASES = [pytest.param(*case, marks=() if case in QUICK else pytest.mark.slow) for case in sorted(
    {(family, _attention(family, strategy), strategy) for family in FAMILIES for strategy in STRATEGIES} | QUICK)]


@pytest.mark.parametrize("family,attn,strategy", CASES)
def test_a_hugging_face_model_trains_equal_to_eager_with_torch_adamw(family, attn, strategy):
    # two steps where the second could lower again (the quick cases), else one: simulated steps cost
    steps = 2 if (family, attn, strategy) in QUICK else 1
    want_losses, want_params = eager_run(family, attn, steps)
    # four sequences a rank: their tokens stay split over cp through each linear layer (`ndfunc::dot`),
    # but GPT-2's Conv1D flattens them itself (a view, then addmm), gathered over cp to tokens
    with pytest.warns(nf.sharding.ShardingWarning, match="sequences a rank") if (
            strategy == "cp_ring" and family == "gpt2") else contextlib.nullcontext():
        losses, params, lowerings, cost = jitted_run(family, attn, strategy, steps=steps)
    torch.testing.assert_close(losses, want_losses, **LOSS_TOL)
    assert params.keys() == want_params.keys()
    for k in want_params:
        torch.testing.assert_close(params[k], want_params[k], **PARAM_TOL, msg=lambda m: f"{k}: {m}")
    assert lowerings == 1  # the step's results fed back in are the signature it was lowered for
    if strategy == "cp_ring":  # the keys and values go round the ring, not gathered
        assert cost["collectives"]["ppermute"] == 2 * 2  # forward and backward, two layers


@pytest.mark.parametrize("family", FAMILIES)
def test_ring_attention_on_attention_written_as_matmuls_says_to_use_sdpa(family):
    with pytest.raises(ValueError, match=r"^nf\.ring_attention\('cp'\): step has no scaled-dot-product attention "
                       r"to run as a ring\. Attention written as matmuls and a softmax "
                       r"\(Hugging Face's attn_implementation='eager'\) is not one op: use "):
        jitted_run(family, "eager", "cp_ring")


def test_partition_specs_follow_the_models_own_tp_plan_and_fsdp_takes_a_free_dim():
    model = make_model("llama", "sdpa")
    with nf.simulate(4):
        mesh = nf.make_mesh(dp_shard=2, tp=2)
        specs = nf.nn.partition_specs(model, mesh, tp="tp", fsdp="dp_shard")
        tp_only = nf.nn.partition_specs(model, mesh, tp="tp")
    layer = "model.layers.0."
    assert tp_only[layer + "self_attn.q_proj.weight"] == P("tp", None)  # colwise: (out, in) split on out
    assert tp_only[layer + "self_attn.o_proj.weight"] == P(None, "tp")  # rowwise: on in
    assert tp_only[layer + "mlp.down_proj.weight"] == P(None, "tp")
    assert tp_only["model.embed_tokens.weight"] == P("tp", None)  # embedding_rowwise: the vocabulary split
    assert tp_only["lm_head.weight"] == P("tp", None)  # colwise_gather_output
    assert tp_only[layer + "input_layernorm.weight"] == P(None)  # not in the plan: whole
    assert specs[layer + "self_attn.q_proj.weight"] == P("tp", "dp_shard")  # FSDP on the dim TP leaves
    assert specs[layer + "input_layernorm.weight"] == P("dp_shard")
    with nf.simulate(2):  # the job's axes on a mesh that has only some of them: those it lacks split nothing
        fsdp_only = nf.nn.partition_specs(model, nf.make_mesh(dp_shard=2), tp="tp", fsdp=("dp_shard", "cp"))
    assert fsdp_only[layer + "self_attn.q_proj.weight"] == P("dp_shard", None)
    assert fsdp_only[layer + "input_layernorm.weight"] == P("dp_shard")
    with nf.simulate(2), pytest.raises(ValueError, match=r"partition_specs: mesh axis 'model' is neither one of this "
                                                          r"mesh's \['dp_shard'\] nor one of ParallelConfig's"):
        nf.nn.partition_specs(model, nf.make_mesh(dp_shard=2), tp="model")  # a typo is not "no TP"
    gpt2 = make_model("gpt2", "sdpa")
    with nf.simulate(2):
        conv = nf.nn.partition_specs(gpt2, nf.make_mesh(tp=2), tp="tp", plan=GPT2_PLAN)
    assert conv["transformer.h.0.attn.c_attn.weight"] == P(None, "tp")  # Conv1D is (in, out)
    assert conv["transformer.h.0.attn.c_attn.bias"] == P("tp")
    assert conv["transformer.h.0.attn.c_proj.weight"] == P("tp", None)
    assert conv["transformer.h.0.attn.c_proj.bias"] == P(None)


def test_fsdp_over_several_axes_splits_a_dim_all_their_ranks_divide():
    # torchtitan's FSDP over ('dp_shard', 'cp'): each parameter split over both axes, major to minor,
    # along the largest dim TP leaves whole that dp_shard x cp divides; one axis named in a tuple is
    # that axis
    model = make_model("llama", "sdpa")
    with nf.simulate(8):
        mesh = nf.make_mesh(dp_shard=2, cp=2, tp=2)
        both = nf.nn.partition_specs(model, mesh, tp="tp", fsdp=("dp_shard", "cp"))
        assert nf.nn.partition_specs(model, mesh, tp="tp", fsdp=("dp_shard",)) == \
            nf.nn.partition_specs(model, mesh, tp="tp", fsdp="dp_shard")
    with nf.simulate(6):  # 2 x 3 divides no dim of 32 or 64: every parameter whole over them
        uneven = nf.nn.partition_specs(model, nf.make_mesh(dp_shard=2, cp=3), fsdp=("dp_shard", "cp"))
    layer = "model.layers.0."
    assert both[layer + "self_attn.q_proj.weight"] == P("tp", ("dp_shard", "cp"))
    assert both[layer + "mlp.down_proj.weight"] == P(("dp_shard", "cp"), "tp")
    assert both[layer + "input_layernorm.weight"] == P(("dp_shard", "cp"))
    assert set(uneven.values()) == {P(None), P(None, None)}


def test_under_axis_rules_the_hidden_states_between_layers_are_laid_out_as_the_rules_say():
    # the residual stream each decoder layer takes and gives: the batch split as the rules split
    # it, the sequence over cp, the width whole, as the project's llama lays it out (a plan that
    # keeps the weights where they lie and moves activations instead costs more once FSDP's
    # transforms apply); the results are the eager model's, and each layer's forward is its own
    # again after the step (a recomputed one, its nf.remat)
    model, ids = make_model("llama", "sdpa"), tokens()
    want = eager_run_of(model)  # (before a forward is set on a layer: a deep copy's would call the original's)
    layers = model.model.layers
    layers[1].forward = recomputed = nf.remat(layers[1].forward, "full")
    params, buffers, apply = nf.nn.functional(model)
    config = nf.ParallelConfig(dp_shard_size=2, cp_size=2, tp_size=2)
    residual = P(("dp_replicate", "dp_shard"), "cp", None)
    with nf.simulate(8):
        mesh = config.build_mesh()
        pspec = nf.nn.partition_specs(model, mesh, tp="tp", fsdp=("dp_shard", "cp"))
        lowered: list = []
        got = trained(nf.sharding.axis_rules(config.rules)(apply), params, mesh, pspec, ids, buffers, lowered=lowered)
        trained(apply, params, mesh, pspec, ids, buffers, lowered=lowered)  # no rules: left to the partitioner
    assert_as_eager(got, want)
    hidden = [[spec for node, spec in low.program.traced.constraints() if node.meta["val"].shape == (4, 16, 32)]
              for low in lowered]
    assert hidden == [[residual] * 8, []]  # each layer's input and output, and their gradients
    assert "forward" not in vars(layers[0]) and vars(layers[1])["forward"] is recomputed


def test_only_hidden_states_of_the_batchs_tokens_are_laid_out_by_the_rules():
    # a vision tower's layers beside the text's: its (images, patches, width) are not the batch's
    # (batch, sequence), which the call's first tensor gives, so they stay the partitioner's to lay out
    class Towers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.text = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
            self.vision = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

        def forward(self, words, patches):
            for layer in self.text:
                words = layer(words)
            for layer in self.vision:
                patches = layer(patches)
            return words.sum() + patches.sum()

    params, buffers, apply = nf.nn.functional(Towers())
    config = nf.ParallelConfig(dp_shard_size=2)
    words, patches = torch.randn(4, 6, 8), torch.randn(3, 5, 8)
    with nf.simulate(2):
        step = nf.jit(nf.sharding.axis_rules(config.rules)(lambda p, w, i: apply(p, buffers, w, i)),
                      mesh=config.build_mesh(), in_shardings=(P(), config.batch_spec, P()), out_shardings=P())
        lowered = step.lower(params, words, patches)
    shapes = [tuple(node.meta["val"].shape) for node, _ in lowered.program.traced.constraints()]
    assert shapes == [(4, 6, 8)] * 4  # each text layer's input and output


def test_traced_transformers_attention_reads_the_key_value_heads_grouped():
    # given a mask (positions, as the job passes them), transformers repeats the key/value heads once
    # per query head, as CUDA's fused kernels take no mask with grouped heads; traced, ndfunc's
    # attention reads them grouped, so a sequence split over cp gathers them once, not once per query
    # head. The gradients are the eager model's, whose attention repeats them
    model, ids = make_model("llama", "sdpa"), tokens()
    params, buffers, apply = nf.nn.functional(model)
    positions = torch.arange(ids.shape[1]).expand(ids.shape).contiguous()
    loss = lambda p, ids: apply(p, buffers, ids, position_ids=positions, labels=ids).loss  # noqa: E731
    want_loss, want_grads = torch.func.grad_and_value(loss)(params, ids)[::-1]
    with nf.simulate(2):
        jitted = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(cp=2), in_shardings=(P(), P(None, "cp")),
                        out_shardings=(P(), P()))
        lowered = jitted.lower(params, ids)
        got_loss, got_grads = nf.device_get(jitted(params, ids))
    attention = lowered.program.traced.graph.find_nodes(op="call_function", target=torch.ops.ndfunc.attention.default)
    assert [(n.args[0].meta["val"].shape[1], n.args[1].meta["val"].shape[1]) for n in attention] == [(4, 2)] * 2
    torch.testing.assert_close(got_loss, want_loss, **LOSS_TOL)
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], **PARAM_TOL, msg=lambda m, k=k: f"{k}: {m}")


def test_a_module_carrying_its_own_tp_plan_is_split_by_it_alone():
    # a wrapper's plan (a property here) is the plan, not merged with the wrapped model's; a wrapper
    # carrying none (PEFT's) is split by the plans of the models inside it, from where they sit
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make_model("llama", "sdpa")

        @property
        def tp_plan(self):
            return {"inner.model.layers.*.self_attn.q_proj": "rowwise"}

    wrapper = Wrapper()
    with nf.simulate(2):
        mesh = nf.make_mesh(tp=2)
        own = nf.nn.partition_specs(wrapper, mesh, tp="tp")
        del Wrapper.tp_plan
        inner = nf.nn.partition_specs(wrapper, mesh, tp="tp")
    layer = "inner.model.layers.0.self_attn."
    assert (own[layer + "q_proj.weight"], own[layer + "k_proj.weight"]) == (P(None, "tp"), P(None, None))
    assert (inner[layer + "q_proj.weight"], inner[layer + "k_proj.weight"]) == (P("tp", None), P("tp", None))


def test_functional_gives_the_modules_tensors_and_a_pure_apply():
    model = make_model("gpt2", "sdpa")
    params, buffers, apply = nf.nn.functional(model)
    assert list(params) == [k for k, _ in model.named_parameters()]  # tied lm_head once, as wte
    assert "lm_head.weight" not in params and not any(p.requires_grad for p in params.values())
    ids = tokens()
    torch.testing.assert_close(apply(params, buffers, ids).logits, model(ids).logits, rtol=0, atol=0)
    doubled = {k: v * 2 if k == "transformer.ln_f.weight" else v for k, v in params.items()}
    assert not torch.equal(apply(doubled, buffers, ids).logits, model(ids).logits)  # it reads the given tensors


def test_a_frozen_parameter_is_a_constant_of_the_step_laid_out_as_the_others_and_saved(tmp_path):
    # requires_grad_(False): a frozen vision tower, LoRA's base weights, Whisper's sinusoidal
    # positions; eager AdamW over model.parameters() leaves it as it is (no gradient: skipped)
    from models import hf

    model = make_model("llama", "sdpa")
    frozen = "model.embed_tokens.weight"
    model.get_input_embeddings().weight.requires_grad_(False)
    want = eager_run_of(model)
    params, buffers, apply = nf.nn.functional(model)
    assert frozen in buffers and frozen not in params and len(params) == len(list(model.parameters())) - 1
    with nf.simulate(4):
        mesh = nf.make_mesh(dp_shard=2, tp=2)
        pspec = nf.nn.partition_specs(model, mesh, tp="tp", fsdp="dp_shard")
        bspec = nf.nn.partition_specs(model, mesh, tp="tp", fsdp="dp_shard", of=buffers)
        assert set(pspec) == set(params) and set(bspec) == set(buffers)
        assert bspec[frozen] == P("tp", "dp_shard") and bspec["model.rotary_emb.inv_freq"] == P()  # a buffer: whole
        got = trained(apply, params, mesh, pspec, tokens(), buffers, bspec)
        params = got[1]
        hf.save_model(tmp_path, model, params)
    assert_as_eager(got, want)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)  # written, as it was
    assert torch.equal(loaded.lm_head.weight, params["lm_head.weight"])



def trained_moe_as_eager(model: torch.nn.Module):
    """`model` (a mixture of experts) trained on 2 ranks over dp_shard against eager, on 256 tokens
    (on fewer, running the experts' backward whole is the cheaper plan): the lowered step's plan."""
    ids = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    want = eager_run_of(model, ids=ids)
    params, buffers, apply = nf.nn.functional(model)
    lowered: list = []
    with nf.simulate(2):
        mesh = nf.make_mesh(dp_shard=2)
        got = trained(apply, params, mesh, nf.nn.partition_specs(model, mesh, fsdp="dp_shard"), ids, buffers,
                      lowered=lowered)
    assert_as_eager(got, want)
    return lowered[0].program.plan


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm", "eager"])
def test_a_mixture_of_experts_runs_each_ranks_own_tokens_through_the_experts_as_its_implementation_does(experts):
    # transformers' experts call, whichever implementation the config names, is one ndfunc::experts
    # split by the tokens: grouped ran every token on every rank (its offsets counted from all of
    # them), batched held a copy of an expert's weights per token, the loop raised DataDependentError
    model = make_model(f"mixtral:{experts}", "sdpa")
    assert model.config._experts_implementation == experts
    calls = [(n.target, s) for n, s in trained_moe_as_eager(model).strategy.items()
             if n.target in (experts_ops.experts_op, experts_ops.experts_backward_op)]
    assert sorted(str(op) for op, _ in calls) == ["ndfunc.experts.default"] * 2 + ["ndfunc.experts_backward.default"] * 2
    assert all(s.ins[0] == (Shard(0),) for _, s in calls)  # each rank's own tokens (hidden states, or their gradient)


# other mixtures of experts, tiny: shared experts (Qwen3-MoE's), grouped routing and latent attention
# (DeepSeek-V3's), biased and clamped experts with attention sinks (gpt-oss's)
MOE_FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(moe_intermediate_size=32, num_experts=4, decoder_sparse_step=1,
                                                    mlp_only_layers=[], head_dim=8), "sdpa"),
    "deepseek_v3": (transformers.DeepseekV3Config, dict(moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                                        first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=16,
                                                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                        v_head_dim=8, num_key_value_heads=4), "sdpa"),
    "gpt_oss": (transformers.GptOssConfig, dict(num_local_experts=4, head_dim=8, sliding_window=16,
                                                layer_types=["sliding_attention", "full_attention"]), "eager"),
}


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_other_mixtures_of_experts_train_as_eager_with_each_ranks_own_tokens(family):
    cls, extra, attn = MOE_FAMILIES[family]
    config = cls(**{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "num_experts_per_tok": 2, "vocab_size": VOCAB,
                    "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, **extra})
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(n.target is experts_ops.experts_op for n in trained_moe_as_eager(model).strategy) == 2


class ExpertsConfig:
    _experts_implementation = "eager"


def decorated_experts() -> type:
    """A mixture of experts' experts as transformers decorates them (`use_experts_implementation`),
    their own loop the 'eager' implementation; `limit` clamps the up projection, per layer (as
    transformers' Step3p7 and BailingHybrid experts hold `config.swiglu_limits[layer_idx]`)."""
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False, is_transposed=True)
    class Experts(torch.nn.Module):
        def __init__(self, config, limit: float = 1e9):
            super().__init__()
            self.up_proj = torch.nn.Parameter(torch.randn(4, 8, 16) / 2)
            self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 8) / 4)
            self.limit = limit

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for k in range(top_k_index.shape[1]):
                up = torch.einsum("td,tdf->tf", hidden_states, self.up_proj[top_k_index[:, k]]).clamp(max=self.limit)
                out = out + top_k_weights[:, k, None] * torch.einsum("tf,tfd->td", up, self.down_proj[top_k_index[:, k]])
            return out

    return Experts


def experts_as_eager(module: torch.nn.Module) -> None:
    """`module(h, index, weights)`'s loss and gradients under nf.jit on 2 ranks split by the tokens,
    against torch.func's on one device."""
    torch.manual_seed(1)
    h, index, weights = torch.randn(16, 8), torch.randint(0, 4, (16, 2)), torch.rand(16, 2)
    params = {k: v.detach() for k, v in module.named_parameters()}
    loss = lambda p, h, index, weights: torch.func.functional_call(module, p, (h, index, weights)).square().sum()  # noqa: E731
    want_grads, want = torch.func.grad_and_value(loss)(params, h, index, weights)
    with nf.simulate(2):
        f = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp_shard=2),
                   in_shardings=(P(), P("dp_shard"), P("dp_shard"), P("dp_shard")), out_shardings=(P(), P()))
        got, grads = nf.device_get(f(params, h, index, weights))
    torch.testing.assert_close(got, want, **LOSS_TOL)
    torch.testing.assert_close(grads, want_grads, **PARAM_TOL)


def test_an_experts_subclass_forward_around_the_decorated_one_runs_once():
    # transformers' Ergo: its experts subclass the decorated class and scale what super().forward
    # gives; the op runs the implementation the interface picked, not the subclass's forward again
    class Scaled(decorated_experts()):
        def __init__(self, config):
            super().__init__(config)
            self.scale = torch.nn.Parameter(torch.full((8,), 3.0))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights) * self.scale

    torch.manual_seed(0)
    experts_as_eager(Scaled(ExpertsConfig()))


def test_experts_layers_that_share_a_config_but_not_an_attribute_each_run_with_their_own():
    # one config, a limit per layer: each layer's op runs that layer's module (one name per module),
    # where the name of the class and config ran every layer with the last one's limit
    experts = decorated_experts()

    class Layers(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.layers = torch.nn.ModuleList(experts(config, limit) for limit in (0.1, 100.0))

        def forward(self, h, index, weights):
            for layer in self.layers:
                h = h + layer(h, index, weights)
            return h

    torch.manual_seed(0)
    experts_as_eager(Layers(ExpertsConfig()))


def test_the_experts_op_leaves_the_models_own_parameters_in_place_while_it_runs(monkeypatch):
    # the op swaps its blocks into a copy of the module's tables: the model, perhaps evaluated
    # eagerly in another thread meanwhile, reads its own weights throughout
    model = make_model("mixtral", "sdpa")
    experts = model.model.layers[0].mlp.experts
    own, seen = experts.gate_up_proj, []
    run = experts_ops._Implemented.forward

    def spied(self, *args):
        seen.append(experts.gate_up_proj is own and self.experts.gate_up_proj is not own)
        return run(self, *args)

    monkeypatch.setattr(experts_ops._Implemented, "forward", spied)
    params, buffers, apply = nf.nn.functional(model)
    with nf.simulate(2):
        f = nf.jit(nf.value_and_grad(lambda p, ids: apply(p, buffers, ids, labels=ids).loss),
                   mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")), out_shardings=(P(), P()))
        nf.device_get(f(params, tokens()))
    assert seen and all(seen)


def test_frozen_experts_get_no_gradient_made_and_the_rest_trains_as_eager():
    # a MoE's router or adapters fine-tuned, its experts frozen: the op's backward makes the hidden
    # states' and routing weights' gradients only
    model = make_model("mixtral", "sdpa")
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    made = [[tuple(v.shape) for v in n.meta["val"]] for n in trained_moe_as_eager(model).strategy
            if n.target is experts_ops.experts_backward_op]
    assert made == [[(256, 32), (256, 2)]] * 2  # no (experts, ...) gradient


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's own call
def test_a_peft_lora_model_is_split_by_the_wrapped_models_plan_and_trains_as_eager():
    # PEFT wraps the model (names under base_model.model.) and each adapted Linear (its weight
    # under .base_layer, the adapters under .lora_A.default / .lora_B.default): the Llama's own
    # plan still names them, and the adapters follow their layer's split
    import peft

    model = peft.get_peft_model(make_model("llama", "sdpa"), peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0, init_lora_weights=False))
    want = eager_run_of(model)
    params, buffers, apply = nf.nn.functional(model)
    with nf.simulate(4):
        mesh = nf.make_mesh(dp_shard=2, tp=2)
        pspec = nf.nn.partition_specs(model, mesh, tp="tp")
        bspec = nf.nn.partition_specs(model, mesh, tp="tp", of=buffers)
        layer = "base_model.model.model.layers.0."
        assert bspec[layer + "self_attn.q_proj.base_layer.weight"] == P("tp", None)  # colwise, wrapped
        assert bspec[layer + "self_attn.o_proj.base_layer.weight"] == P(None, "tp")  # rowwise, wrapped
        assert bspec[layer + "self_attn.k_proj.weight"] == P("tp", None)  # not adapted
        assert bspec["base_model.model.model.embed_tokens.weight"] == P("tp", None)
        assert pspec[layer + "self_attn.q_proj.lora_A.default.weight"] == P(None, None)
        assert pspec[layer + "self_attn.q_proj.lora_B.default.weight"] == P("tp", None)  # its outputs
        assert pspec[layer + "self_attn.o_proj.lora_A.default.weight"] == P(None, "tp")  # its inputs
        assert pspec[layer + "self_attn.o_proj.lora_B.default.weight"] == P(None, None)
        got = trained(apply, params, mesh, pspec, tokens(), buffers, bspec)
    assert_as_eager(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_train_job_trains_a_hugging_face_model_from_its_directory(family, tmp_path):
    from models import data, train

    model = make_model(family, "sdpa")
    model.resize_token_embeddings(data.VOCAB_SIZE)  # the byte corpus
    model.save_pretrained(tmp_path)
    # 4D for one (8 ranks cost), with one sequence a rank per micro-batch as context parallelism runs
    layout = ["--cp", "2", "--ring-attention", "--micro-batch", "1", "--grad-accum", "2"] if family == "llama" else [
        "--cp", "1", "--micro-batch", "2"]
    losses = train.main(["--hf-model", str(tmp_path), "--steps", "2", "--seq-len", "16", "--dp-shard", "2",
                         "--tp", "2", *layout, "--log-every", "2"])
    # the first step's loss is the eager model's on the first batch (2 x dp_shard sequences)
    first = next(data.batches(data.Sequences(data.stdlib_corpus(), 16, seed=0), 4, steps=1))
    logits = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")(
        first["tokens"]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), first["targets"].flatten())
    torch.testing.assert_close(torch.tensor(losses[0]), want.detach(), **LOSS_TOL)
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_train_job_writes_the_hugging_face_model_it_trained_as_transformers_loads_it(family, tmp_path):
    # GPT-2: tied embeddings (one tensor saved, tied again on loading) and Conv1D projections
    from models import data, train

    model = make_model(family, "sdpa")
    model.resize_token_embeddings(data.VOCAB_SIZE)
    model.save_pretrained(tmp_path / "start")
    train.main(["--hf-model", str(tmp_path / "start"), "--steps", "2", "--seq-len", "16", "--dp-shard", "2",
                "--tp", "2", "--micro-batch", "2", "--log-every", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                "--save-hf", str(tmp_path / "end")])
    params, _, _ = nf.nn.functional(model)
    trained = nf.checkpoint.load(tmp_path / "ck" / "step_2", {"params": params})["params"]  # DCP's copy
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "end")
    assert type(loaded) is type(model) and loaded.config.vocab_size == data.VOCAB_SIZE
    assert {name for name, _ in loaded.named_parameters()} == set(trained)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained[name]), name
        assert p.dtype == torch.float32
    assert not torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) == (family == "gpt2")


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "llama" else pytest.mark.slow) for f in FAMILIES])
def test_remat_recomputes_a_hugging_face_models_decoder_layers(family):
    # the job's --remat on a --hf-model: each decoder layer (what the model's _no_split_modules
    # names) under nf.remat; the gradients are the eager model's, and forward keeps a layer's input
    from models import train

    model, ids = make_model(family, "sdpa"), tokens()
    kept, results = [], []
    for remat in (False, True):
        if remat:
            assert train.remat_hf_layers(model, "full") == 2
        params, buffers, apply = nf.nn.functional(model)
        loss = lambda p, ids: apply(p, buffers, ids, labels=ids).loss  # noqa: E731
        with nf.simulate(2):
            jitted = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                            out_shardings=(P(), P()))
            kept.append(jitted.lower(params, ids).memory_analysis().breakdown.activations)
            results.append(nf.device_get(jitted(params, ids)))
    want_loss, want_grads = eager_run(family, "sdpa", 1)[0][0], torch.func.grad(loss)(params, ids)
    for got_loss, got_grads in results:
        torch.testing.assert_close(got_loss, want_loss, **LOSS_TOL)
        for k in want_grads:
            torch.testing.assert_close(got_grads[k], want_grads[k], **PARAM_TOL, msg=lambda m, k=k: f"{k}: {m}")
    assert kept[1] < kept[0] / 4


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_hugging_face_models_own_gradient_checkpointing_is_recomputed_as_nf_remat(reentrant):
    # model.activation_checkpointing_enable() (gradient_checkpointing_enable before transformers 5.x):
    # each decoder layer through torch.utils.checkpoint,
    # which torch.func cannot differentiate; inside nf.value_and_grad it is nf.remat
    model, ids = make_model("llama", "sdpa"), tokens()
    params, buffers, apply = nf.nn.functional(model)
    loss = lambda p, ids: apply(p, buffers, ids, labels=ids).loss  # noqa: E731
    want_loss, want_grads = torch.func.grad_and_value(loss)(params, ids)[::-1]
    kept = []
    for checkpointed in (False, True):
        if checkpointed:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable({"use_reentrant": reentrant})
        with nf.simulate(2):
            jitted = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                            out_shardings=(P(), P()))
            kept.append(jitted.lower(params, ids).memory_analysis().breakdown.activations)
            got_loss, got_grads = nf.device_get(jitted(params, ids))
        torch.testing.assert_close(got_loss, want_loss, **LOSS_TOL)
        for k in want_grads:
            torch.testing.assert_close(got_grads[k], want_grads[k], **PARAM_TOL, msg=lambda m, k=k: f"{k}: {m}")
    assert kept[1] < kept[0] / 4
