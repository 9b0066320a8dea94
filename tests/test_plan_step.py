"""nf.plan from a step: a lowered program replayed on a cluster (`program_time`) against times
worked out here by hand from the cluster's figures, its links chosen by the nodes a group spans,
and `plan_step`'s ranking against the closed forms' (`estimate`, a model written independently)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import ndfunc as nf
from ndfunc.plan import Cluster, Efficiency, Layout, Options, TransformerShape, estimate, plan_step, program_time
from ndfunc.sharding import AbstractMesh, NamedSharding, P

REL = 1e-12
H100 = Cluster.of("h100", 8)


def _stand_in(mesh, shape, spec, dtype=torch.bfloat16):
    return nf.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def test_a_gather_waited_for_at_once_adds_its_time_to_the_ops_after_it():
    # each rank gathers a 4096 x 4096 bf16 weight from 8 blocks over NVLink (7 ring steps of 1 us,
    # 7/8 of 32 MiB at 450 GB/s), then doubles it in place (32 MiB read and written at 3.35 TB/s)
    mesh = AbstractMesh({"dp_shard": 8})
    w = _stand_in(mesh, (4096, 4096), P("dp_shard"))
    t = program_time(nf.jit(lambda w: w * 2, mesh=mesh, out_shardings=P()).lower(w), H100)
    whole = 4096 * 4096 * 2
    gather = 7 * 1e-6 + whole * 7 / 8 / 450e9
    double = 2 * whole / 3350e9
    assert t.total == pytest.approx(gather + double, rel=REL)
    assert t.compute == pytest.approx(double, rel=REL) and t.exposed == pytest.approx(gather, rel=REL)
    assert t.sent == {"intra": whole * 7 / 8, "inter": 0.0} and t.links["intra"] == pytest.approx(gather, rel=REL)


@pytest.mark.parametrize("dtype, peak", [(torch.bfloat16, 989e12), (torch.float32, 67e12)])
def test_a_matmul_takes_its_flops_at_the_peak_for_its_dtype(dtype, peak):
    # one GPU, one 8192^3 matmul: 2 x 8192^3 flops at the dtype's datasheet peak (fp32 without
    # tensor cores) times the matmul efficiency; its bytes would take far less
    mesh = AbstractMesh({"dp_shard": 1})
    x = _stand_in(mesh, (8192, 8192), P(), dtype)
    t = program_time(nf.jit(lambda x: x @ x, mesh=mesh).lower(x), Cluster.of("h100", 1), Efficiency(matmul=0.5))
    assert t.flops == 2 * 8192**3
    assert t.total == pytest.approx(2 * 8192**3 / (peak * 0.5), rel=REL)


def test_a_group_that_spans_nodes_runs_on_the_fabric():
    # 16 GPUs, 8 a node, dp_shard 2 x tp 8: tp's 8 ranks are a node, dp_shard's 2 are 8 apart
    cluster = Cluster.of("h100", 16)
    mesh = AbstractMesh({"dp_shard": 2, "tp": 8})
    a, b = _stand_in(mesh, (1024, 1024), P("dp_shard")), _stand_in(mesh, (1024, 1024), P("tp"))
    lowered = nf.jit(lambda a, b: (a * 2, b * 2), mesh=mesh, out_shardings=(P(), P())).lower(a, b)
    t = program_time(lowered, cluster)
    whole = 1024 * 1024 * 2
    assert t.sent == pytest.approx({"inter": whole / 2, "intra": whole * 7 / 8}, rel=REL)
    assert t.links["inter"] == pytest.approx(10e-6 + whole / 2 / 50e9, rel=REL)
    assert t.links["intra"] == pytest.approx(7 * 1e-6 + whole * 7 / 8 / 450e9, rel=REL)


def test_prefetched_gathers_hide_behind_compute():
    # nf.fsdp gathers the next layer while this one computes: the compute stream waits for less
    # than the link is busy
    from models import llama, train

    cfg = llama.LlamaConfig.llama3_8b(n_layers=2)
    config = nf.ParallelConfig(dp_shard_size=8)
    lowered = train.lower_abstract(cfg, config, 4096, [nf.fsdp("dp_shard"), nf.mixed_precision(torch.bfloat16)])
    t = program_time(lowered, H100)
    assert 0 < t.exposed < t.links["intra"]
    assert max(t.compute, t.links["intra"]) <= t.total <= t.compute + t.links["intra"]


def test_a_step_of_several_programs_adds_them_up():
    mesh = AbstractMesh({"dp_shard": 8})
    w = _stand_in(mesh, (4096, 4096), P("dp_shard"))
    lowered = nf.jit(lambda w: w * 2, mesh=mesh, out_shardings=P()).lower(w)
    one = program_time(lowered, H100)
    planned = plan_step(lambda layout: [(lowered, 3), (lowered, 1)], [Layout(dp_shard=8)], cluster=H100,
                        tokens_per_step=100)
    (row,) = planned.rows
    assert row.time.total == pytest.approx(4 * one.total, rel=REL) and row.time.flops == 4 * one.flops
    assert row.tokens_per_s_per_gpu == pytest.approx(100 / row.time.total / 8, rel=REL)


def test_plan_step_keeps_what_does_not_fit_or_lower_apart():
    mesh = AbstractMesh({"dp_shard": 8})
    small = dataclasses.replace(H100, device=dataclasses.replace(H100.device, memory_bytes=3.5 * 2**30))

    def lower(layout):
        if layout.tp > 1:
            raise ValueError("no tp here")
        w = _stand_in(mesh, (16384, 16384), P("dp_shard"))  # 512 MiB gathered, over the 0.5 GiB left
        return nf.jit(lambda w: w * 2, mesh=mesh, out_shardings=P()).lower(w)
    planned = plan_step(lower, [Layout(dp_shard=8), Layout(dp_shard=4, tp=2)], cluster=small, tokens_per_step=1)
    assert planned.rows == () and [e.layout for e in planned.too_big] == [Layout(dp_shard=8)]
    assert planned.failed == ((Layout(dp_shard=4, tp=2), "ValueError: no tp here"),)
    assert str(planned).endswith("\nnot lowered: dp_shard 4 x tp 2: ValueError: no tp here")
    (row,) = planned.cells()
    assert row[:3] == ("-", "dp_shard 8", "3.6 > mem")  # 3 GiB of allowance, 512 MiB gathered, 64 MiB a block
    with pytest.raises(ValueError, match=r"^no layout fits: the step on 8 x H100-SXM-80GB"):
        planned.best


def test_bad_inputs_say_what_to_do():
    mesh = AbstractMesh({"dp_shard": 8})
    lowered = nf.jit(lambda w: w * 2, mesh=mesh).lower(_stand_in(mesh, (64, 64), P("dp_shard")))
    with pytest.raises(ValueError, match=r"^program_time: the program's mesh \{'dp_shard': 8\} has 8 ranks; the "
                                         r"cluster has 16 GPUs\. Lower the step on a mesh of the cluster's size\.$"):
        program_time(lowered, Cluster.of("h100", 16))
    with pytest.raises(ValueError, match=r"^plan_step: tokens_per_step must be an int >= 1, got 0\.$"):
        plan_step(lambda layout: lowered, [Layout(dp_shard=8)], cluster=H100, tokens_per_step=0)
    with pytest.raises(ValueError, match=r"^plan_step: Layout\(dp_shard=4\) uses 4 GPUs; the cluster has 8\.$"):
        plan_step(lambda layout: lowered, [Layout(dp_shard=4)], cluster=H100, tokens_per_step=1)
    # what `lower(layout)` returns: a Lowered, or (Lowered, times) pairs; anything else says so
    expected = ("expected the step lowered over stand-ins on layout.mesh (a Lowered: nf.jit(step, "
                "mesh=layout.mesh).lower(*stand_ins)), or a list of (Lowered, times) pairs")
    jitted = nf.jit(lambda w: w * 2, mesh=mesh)
    for made, said in [(jitted, "returned the jitted step itself; "), (None, "returned a NoneType; "),
                       ([lowered], "returned a list of ['Lowered']; ")]:
        said += expected
        with pytest.raises(TypeError, match="^plan_step: lower\\(layout\\) " + re.escape(said)):
            plan_step(lambda layout, made=made: made, [Layout(dp_shard=8)], cluster=H100, tokens_per_step=1)
    with pytest.raises(ValueError, match=r"^plan_step: a program runs a whole number of times a step, >= 1; "
                                         r"lower\(layout\) gave 0\.$"):
        plan_step(lambda layout: [(lowered, 0)], [Layout(dp_shard=8)], cluster=H100, tokens_per_step=1)
    with pytest.raises(TypeError, match=r"^program_time: expected a step lowered over stand-ins \(a Lowered: nf\.jit"
                                        r"\(step, mesh=\.\.\.\)\.lower\(\*stand_ins\)\) or its Program, got a str\.$"):
        program_time("lowered", H100)
    for call in (lambda: program_time(lowered, "h100"),
                 lambda: plan_step(lambda layout: lowered, [Layout(dp_shard=8)], cluster="h100", tokens_per_step=1)):
        with pytest.raises(TypeError, match=r"cluster must be a Cluster, got 'h100'; build one with Cluster\.of\("
                                            r"gpu, num_gpus\) \(gpu one of a100, h100, h200, b200\)"):
            call()


@pytest.mark.slow  # five Llama-3-8B-shaped steps lowered: seconds each
def test_the_replayed_programs_rank_layouts_as_the_closed_forms_do():
    # two layers of Llama 3 8B on 16 H100s (two nodes), 16 sequences of 4096 tokens a step: the
    # closed forms (`estimate`) and the replayed programs are two models of the same runs, written
    # apart; they agree on the order of layouts 10% or more apart, though not on the times (the
    # replay prices every op: under TP the norms and casts of activations the closed forms fold
    # into one efficiency, so dp_shard 8 x tp 2 and 2 x 8, a few % apart, may swap)
    from models import llama, train

    cfg = llama.LlamaConfig.llama3_8b(n_layers=2)
    cluster, seq, batch = Cluster.of("h100", 16), 4096, 16
    layouts = [Layout(dp_shard=16), Layout(dp_shard=2, tp=8), Layout(dp_replicate=2, dp_shard=8),
               Layout(dp_replicate=16)]

    def lower(layout):
        config = nf.ParallelConfig(*layout.axis_sizes)
        transforms = [nf.fsdp("dp_shard")] if layout.dp_shard > 1 else []
        return train.lower_abstract(cfg, config, seq, [*transforms, nf.mixed_precision(torch.bfloat16, torch.float32)],
                                    batch // layout.dp_size, positions=False)
    replayed = [e.layout for e in plan_step(lower, layouts, cluster=cluster, tokens_per_step=batch * seq).rows]
    shape = TransformerShape.from_config(cfg)
    closed = sorted(layouts, key=lambda lay: estimate(shape, lay, Options("none", micro_batch=batch // lay.dp_size),
                                                      cluster=cluster, global_batch=batch, seq_len=seq).time.total)
    assert replayed == closed


@pytest.mark.slow  # transformers' Llama traced and lowered
def test_a_hugging_face_model_as_it_is_is_planned_from_its_step():
    # transformers' LlamaForCausalLM (made on the meta device: stand-ins only), the train job's step
    # for it; under FSDP each rank runs a whole model on its sequence: 6 flops per parameter and
    # token in its matmuls, and torch's formula for attention, forward and backward (3.5 x 4BHL^2K)
    import transformers
    from models import hf, llama, train

    cfg, seq = llama.LlamaConfig.tiny(), 128

    def lower(layout):
        return train.lower_abstract_hf(transformers.LlamaConfig(**hf.config_to_hf(cfg, torch.float32)),
                                       nf.ParallelConfig(*layout.axis_sizes), seq, opt=nf.optim.adamw(1e-3))

    planned = plan_step(lower, [Layout(dp_shard=8), Layout(dp_shard=4, tp=2)], cluster=H100, tokens_per_step=8 * seq)
    assert len(planned.rows) == 2 and not planned.failed
    (fsdp,) = [e for e in planned.rows if e.layout == Layout(dp_shard=8)]
    shape = TransformerShape.from_config(cfg)
    matmuls = 6 * seq * (shape.n_layers * shape.layer_linear_params + shape.output_params)
    attention = 7 * 2 * shape.n_heads * seq * seq * shape.head_dim * shape.n_layers
    assert fsdp.time.flops == matmuls + attention


@pytest.mark.parametrize("family", ["gemma2", "gpt2", "mixtral"])
def test_a_hugging_face_model_is_planned_as_the_job_builds_it(family):
    # as `models.train.load_hf_model` builds the job's model: Gemma 2 has no SDPA attention (its
    # own, eager), GPT-2's config keeps dropout on (out of training mode: none drawn), Mixtral's
    # experts as transformers picks them (one ndfunc::experts per call); each rank holds its
    # parameters' blocks, what transformers builds divided over the mesh
    import transformers
    from models import train

    small = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=256, max_position_embeddings=128)
    made = {"gemma2": lambda: transformers.Gemma2Config(hidden_size=64, intermediate_size=128, head_dim=16,
                                                         num_key_value_heads=2, **small),
            "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128),
            "mixtral": lambda: transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_key_value_heads=2,
                                                          num_local_experts=4, num_experts_per_tok=2, **small)}
    hf_config = made[family]()
    lowered = train.lower_abstract_hf(hf_config, nf.ParallelConfig(dp_shard_size=4), 64, opt=nf.optim.adamw(1e-3))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, **train.hf_implementations(hf_config))
    whole = sum(p.numel() * p.element_size() for p in dict(model.named_parameters()).values())
    assert lowered.memory_analysis().breakdown.arguments["0"] == whole / 4  # every dim FSDP splits divides by 4


@pytest.mark.slow  # two Llama-3-8B-shaped steps lowered
def test_a_zigzag_ring_runs_2n_plus_1_of_its_4n_quarter_blocks():
    # the same ring over 4 cp ranks, with and without zigzag's skipping: attention-bound at 8,192
    # tokens a rank, its time falls to 9/16 (tests/test_ring.py counts the quarters from the mask)
    from models import llama, train

    from ndfunc._src.partition.planning.flops import is_attention
    from ndfunc._src.replay.timeline import KERNELS, op_seconds

    cfg, cp = llama.LlamaConfig.llama3_8b(n_layers=2), 4
    seconds = []
    for balance in ("zigzag", None):
        lowered = train.lower_abstract(cfg, nf.ParallelConfig(cp_size=cp), 8192 * cp,
                                       [nf.ring_attention("cp", load_balance=balance), nf.mixed_precision(torch.bfloat16)])
        lowered.program.ensure_meta()
        rings = [n for n in lowered.program.local.graph.nodes if n.op == "call_function" and is_attention(n.target)]
        seconds.append(sum(op_seconds(n, H100.device, KERNELS)[0] for n in rings))
    assert seconds[0] / seconds[1] == pytest.approx((2 * cp + 1) / (4 * cp), rel=1e-12)
