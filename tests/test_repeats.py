"""A repeated layer planned once (`planning/repeats.py`): a deep step is planned with three of its
layers, lowers to the program its whole graph's search plans, and runs to the one-device result."""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
from test_fsdp import llama_case, llama_fsdp_step

import ndfunc as nf
from models import llama, train
from ndfunc._src.partition.planning import repeats, solve

FSDP_BF16 = lambda: [nf.fsdp("dp_shard"), nf.mixed_precision(torch.bfloat16, torch.float32)]  # noqa: E731
CASES = {  # mesh, remat, transforms, model, tokens a sequence
    "fsdp+tp, fsdp, bf16, remat": ((1, 2, 1, 2), "full", FSDP_BF16, llama.LlamaConfig.tiny, 32),
    "4d": ((1, 2, 2, 2), None, list, llama.LlamaConfig.tiny, 32),
    "cp": ((1, 1, 8, 1), None, list, llama.LlamaConfig.tiny, 32),
    # Llama 3 70B's layers on 1,024 ranks, as benchmarks/shape_only.py lowers them: where each
    # layer's gradients are cast to fp32 between its backward and AdamW's update
    "70b dims, 4d, fsdp, bf16, remat": ((2, 32, 4, 4), "full", FSDP_BF16, llama.LlamaConfig.llama3_70b, 8192),
}


def contractions(monkeypatch) -> list:
    """What `repeats.contracted` returns, call by call, from here on."""
    seen = []
    real = repeats.contracted

    def spy(*args):
        seen.append(real(*args))
        return seen[-1]
    monkeypatch.setattr(repeats, "contracted", spy)
    return seen


def lowered(name: str, n_layers: int = 8):
    sizes, remat, transforms, model, seq_len = CASES[name]
    cfg = dataclasses.replace(model(), n_layers=n_layers, remat=remat)
    solve._PLANS.clear()  # planned afresh, not remembered from the other lowering
    return train.lower_abstract(cfg, nf.ParallelConfig(*sizes), seq_len, transforms(), batch_per_rank=2,
                                opt=nf.optim.adamw(1e-3, weight_decay=0.1))


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if "70b" in name else name
                                  for name in CASES])
def test_a_deep_step_planned_with_three_of_its_layers_is_the_program_planned_whole(name, monkeypatch):
    monkeypatch.setenv("NDFUNC_REFINE_VARIABLES", "0")  # the searches' plans: refinement improves each apart
    seen = contractions(monkeypatch)
    planned_once = lowered(name)
    assert seen[-1] is not None and seen[-1].left_out > 0
    monkeypatch.setattr(repeats, "MIN_CALLS", 10**9)
    whole = lowered(name)
    assert seen[-1] is None
    assert planned_once.as_text() == whole.as_text()
    assert planned_once.memory_analysis() == whole.memory_analysis()


def test_the_program_planned_does_not_grow_with_depth_and_each_of_its_nodes_is_planned_for(monkeypatch):
    seen = contractions(monkeypatch)
    sizes = {}
    for n_layers in (8, 12):
        lowered("4d", n_layers)
        contraction = seen[-1]
        sizes[n_layers] = len(contraction.graph.nodes)
        # every node planned is some node's plan: none priced for a reader the program does not have
        taken = set(contraction.plan_of.values())
        assert [n for n in contraction.graph.nodes if n.op == "call_function" and n not in taken] == []
    assert sizes[8] == sizes[12]


def test_a_deep_step_planned_with_three_of_its_layers_runs_to_the_one_device_result(monkeypatch):
    seen = contractions(monkeypatch)
    cfg, params, batch, opt, _ = llama_case((4, 16), vocab_size=64, dim=32, n_layers=8, ffn_dim=64)
    expected = train.make_step(cfg, opt)(params, opt.init(params), batch)
    with nf.simulate(4):
        f, args = llama_fsdp_step(cfg, params, opt, 4, [], nf.ParallelConfig(dp_shard_size=2, tp_size=2))
        got = nf.device_get(f(*args, batch))
    assert seen[-1] is not None and seen[-1].left_out > 0
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_transformers_layers_found_alike_are_planned_with_three_of_them(monkeypatch):
    # transformers' LlamaForCausalLM called as it is (`models.train --hf-model`): its decoder
    # layers are found alike and copied (`repeated_layers`), then planned as the job's are
    import transformers

    from models import hf

    monkeypatch.setenv("NDFUNC_REFINE_VARIABLES", "0")  # the searches' plans: refinement improves each apart
    seen = contractions(monkeypatch)
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=8)
    hf_config = transformers.LlamaConfig(**hf.config_to_hf(cfg, torch.float32))

    def lowered_hf():
        solve._PLANS.clear()
        return train.lower_abstract_hf(hf_config, nf.ParallelConfig(1, 2, 1, 2), 32, batch_per_rank=2)

    planned_once = lowered_hf()
    assert seen[-1] is not None and seen[-1].left_out > 0
    monkeypatch.setattr(repeats, "MIN_CALLS", 10**9)
    whole = lowered_hf()
    assert planned_once.as_text() == whole.as_text()
    assert planned_once.memory_analysis() == whole.memory_analysis()
