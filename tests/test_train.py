"""The training entry point (README's main job), briefly: on the 4D layout in simulation, on one
device, with gradient accumulation, in real processes, and from a Hugging Face checkpoint."""

import json
import pathlib
import re
import shutil

import optree
import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import torchrun

import ndfunc as nf
from models import llama, train
from ndfunc.sharding import NamedSharding, P

SHORT = ["--seq-len", "32", "--warmup", "5"]
QUICK = [*SHORT, "--micro-batch", "4"]


@pytest.mark.slow
def test_train_on_the_4d_layout_in_simulation_lowers_the_loss(capsys):
    losses = train.main(["--steps", "20", "--log-every", "10", *QUICK])  # default: dp_shard 2 x cp 2 x tp 2
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 1.0
    out = capsys.readouterr().out
    assert "on 8 simulated rank(s); effective batch 8 = micro 4 x accumulation 1 x dp 2" in out
    assert "step    10/20" in out and "tokens/s" in out and "MiB/rank" in out
    assert re.search(r"loss 5\.\d+ -> \d\.\d+ \(mean of the last 10 steps\); effective batch 8 sequences \(256 tokens\); "
                     r"per rank per step: [\d.]+ MB sent in \d+ collectives", out), out


@pytest.mark.slow
def test_the_4d_run_and_the_one_device_run_agree_with_and_without_the_transform_flags():
    one = train.main(["--steps", "3", "--dp-shard", "1", "--cp", "1", "--tp", "1", "--micro-batch", "8", *SHORT])
    four_d = train.main(["--steps", "3", *QUICK])  # 4 per dp rank x 2 dp ranks: the same 8 sequences
    assert four_d == pytest.approx(one, rel=1e-5)
    # remat, the ring and FSDP's schedule change where and when, not what (four sequences a rank under
    # the ring: gathered over cp to be flattened to tokens, as it warns)
    with pytest.warns(nf.sharding.ShardingWarning, match="takes 4 sequences a rank, and where it flattens"):
        transformed = train.main(["--steps", "3", "--remat", "full", "--ring-attention", "--fsdp-schedule", *QUICK])
    assert transformed == pytest.approx(one, rel=1e-5)
    # so does sequence parallelism: the residual stream split over tp between the layers
    assert train.main(["--steps", "3", "--sequence-parallel", *QUICK]) == pytest.approx(one, rel=1e-5)


@pytest.mark.slow  # Inductor compiles two programs
def test_the_compile_flag_runs_the_one_process_job_compiled_with_the_same_losses(monkeypatch):
    # accumulated micro-batches, so both nf.accumulate's program and the update are compiled (the
    # one-program step compiled: tests/test_compile.py)
    from ndfunc._src import stages

    made = []
    compiled_program = stages.compiled_program
    monkeypatch.setattr(stages, "compiled_program", lambda gm, backend: made.append(backend) or compiled_program(gm, backend))
    one = ["--steps", "3", "--dp-shard", "1", "--cp", "1", "--tp", "1", *SHORT]  # this process: no simulated ranks
    plain = train.main([*one, "--micro-batch", "8"])
    assert made == []
    assert train.main([*one, "--micro-batch", "4", "--grad-accum", "2", "--compile"]) == pytest.approx(plain, rel=1e-4)
    assert made == ["inductor"] * 2


def accumulation_case(rows: int):
    """llama tiny, its parameters, a batch of `rows` sequences, its value_and_grad, and the
    loss and gradients of the whole batch at once."""
    cfg = llama.LlamaConfig.tiny()
    params = llama.init(cfg, nf.random.key(0))
    g = torch.Generator().manual_seed(0)
    big = {"tokens": torch.randint(0, cfg.vocab_size, (rows, 16), generator=g),
           "targets": torch.randint(0, cfg.vocab_size, (rows, 16), generator=g)}
    value_and_grad = nf.value_and_grad(lambda p, b: llama.loss(p, b, cfg))
    return cfg, params, big, value_and_grad, value_and_grad(params, big)


def test_accumulated_micro_batches_equal_one_big_batch():
    _, params, big, value_and_grad, expected = accumulation_case(8)
    with nf.simulate(2):  # a batch sharded over dp, each rank cutting its own block in two
        mesh = nf.make_mesh(dp=2)
        batch = nf.device_put(big, NamedSharding(mesh, P("dp")))
        accumulated = nf.accumulate(value_and_grad, 2)
        got = nf.device_get(accumulated(params, batch))
        accumulated.lower(params, batch)  # the micro-batch program, already traced: no second trace
    assert accumulated.trace_count == 1  # one program for both micro-batches
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):  # fp32 sums in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accumulation_takes_a_sharded_frozen_base_after_the_batch_as_it_is():
    # a frozen embedding (nf.nn.functional's buffers, laid out by partition_specs(of=buffers)) is
    # neither cut into micro-batches nor differentiated
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    model[0].weight.requires_grad_(False)
    params, buffers, apply = nf.nn.functional(model)
    ids = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(1))

    def loss(p, b, bufs):
        return F.cross_entropy(apply(p, bufs, b).flatten(0, 1), b.flatten())

    expected = nf.value_and_grad(loss)(params, ids, buffers)
    with nf.simulate(2):
        mesh = nf.make_mesh(dp_shard=2)
        specs = nf.nn.partition_specs(model, mesh, fsdp="dp_shard", of=buffers)
        assert specs == {"0.weight": P("dp_shard", None)}
        frozen = nf.device_put(buffers, {k: NamedSharding(mesh, s) for k, s in specs.items()})
        accumulated = nf.accumulate(nf.value_and_grad(loss), 2)
        got = nf.device_get(accumulated(params, nf.device_put(ids, NamedSharding(mesh, P("dp_shard"))), frozen))
    assert set(got[1]) == {"1.weight", "1.bias"}
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):  # fp32 sums in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_accumulating_fsdp_gradients_reduces_them_per_micro_batch_or_once_at_the_end():
    # two sequences a rank per micro-batch: a rank's tokens outweigh a weight, so FSDP's plan (the
    # weights gathered, their gradients reduce-scattered) is the partitioner's, not moving the tokens
    cfg, params, big, value_and_grad, expected = accumulation_case(32)
    config = nf.ParallelConfig(dp_shard_size=4)
    costs = {}
    with nf.simulate(4):
        mesh = config.build_mesh()
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        sharded = nf.device_put(params, optree.tree_map(lambda s: NamedSharding(mesh, s), pspec,
                                                        is_leaf=lambda s: isinstance(s, P)))
        batch = nf.device_put(big, NamedSharding(mesh, config.batch_spec))
        for reduce in ("each", "end"):
            accumulated = nf.accumulate(value_and_grad, 4, reduce=reduce)
            loss, grads = accumulated(sharded, batch)
            costs[reduce] = accumulated.lower(sharded, batch).cost_analysis()
            # the mean comes back laid out as the parameters
            assert [g.placements for g in optree.tree_leaves(grads)] == [
                p.placements for p in optree.tree_leaves(sharded)]
            got = nf.device_get((loss, grads))
            for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):  # fp32 sums in another order
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # per micro-batch: 'each' reduces gradients; 'end' keeps each rank's part of the sums (whole
    # parameters: more memory) and moves no gradient at all
    each, end = costs["each"], costs["end"]
    assert each["comm_bytes"].get("reduce_scatter", 0) > 0 and "reduce_scatter" not in end["comm_bytes"]
    assert end["comm_bytes"]["total"] < each["comm_bytes"]["total"]
    assert end["peak_memory_bytes"] > each["peak_memory_bytes"]


def test_accumulating_until_the_end_a_gradient_the_plan_makes_whole_on_every_rank():
    """A tied embedding under FSDP: its gradient from the token gather comes out whole on every
    rank (`index_put`), but the running sums of `reduce='end'` stay pending over dp_shard. The
    gradient joins them as its part on the first rank (zero on the other), exactly."""
    def loss(p, b):
        h = torch.tanh(p["wte"][b["tokens"]] @ p["w"])
        return F.cross_entropy((h @ p["wte"].T).flatten(0, 1), b["targets"].flatten())

    g = torch.Generator().manual_seed(0)
    params = {"wte": torch.randn(32, 16, generator=g), "w": torch.randn(16, 16, generator=g) / 4}
    big = {"tokens": torch.randint(0, 32, (8, 6), generator=g), "targets": torch.randint(0, 32, (8, 6), generator=g)}
    grads, value = torch.func.grad_and_value(loss)(params, big)
    with nf.simulate(2):
        mesh = nf.make_mesh(dp_shard=2)
        sharded = nf.device_put(params, NamedSharding(mesh, P("dp_shard")))
        batch = nf.device_put(big, NamedSharding(mesh, P("dp_shard")))
        accumulated = nf.accumulate(nf.value_and_grad(loss), 2, reduce="end")
        got = nf.device_get(accumulated(sharded, batch))
        moved = accumulated.lower(sharded, batch).cost_analysis()["comm_bytes"]
    torch.testing.assert_close(got, (value, grads), rtol=1e-5, atol=1e-6)  # fp32 sums in another order
    assert "reduce_scatter" not in moved and moved["all_reduce"] == 8  # no gradient moves, only the loss


def test_accumulate_says_when_the_batch_does_not_split():
    with pytest.raises(ValueError, match=r"^nf.accumulate: a batch of 6 rows does not split into 4 micro-batches; "
                                         r"use a batch size that divides by 4\.$"):
        nf.accumulate(lambda p, b: (b.sum(), p), 4)(torch.ones(2), torch.ones(6, 2))


@pytest.mark.slow
def test_accumulation_in_the_main_job_matches_the_same_effective_batch_without_it():
    flags = ["--steps", "2", "--dp-shard", "2", "--cp", "1", "--tp", "1", *SHORT]
    accumulated = train.main([*flags, "--micro-batch", "2", "--grad-accum", "2"])
    reduced_at_end = train.main([*flags, "--micro-batch", "2", "--grad-accum", "2", "--reduce-grads", "end"])
    whole = train.main([*flags, "--micro-batch", "4"])
    # the same 8 sequences per step, met in another order within the step
    assert accumulated == pytest.approx(whole, rel=1e-4)
    assert reduced_at_end == pytest.approx(whole, rel=1e-4)


@pytest.mark.gloo
def test_train_under_torchrun_matches_the_simulated_run(tmp_path, monkeypatch):
    flags = ["--steps", "3", "--dp-shard", "2", "--cp", "1", "--tp", "2", *QUICK]
    # the simulated run keeps its plans on disk and the ranks read them (the same problems, so
    # the same entries: two, init's and the step's), as a restarted job's ranks would
    monkeypatch.setenv("NDFUNC_PLAN_CACHE_DIR", str(tmp_path / "plans"))
    simulated = train.main(flags)
    proc = torchrun(pathlib.Path(train.__file__), *flags)
    assert len(list((tmp_path / "plans").iterdir())) == 2
    real = [float(x) for x in re.findall(r"loss (\d\.\d+)  ", proc.stdout)]
    assert real == pytest.approx(simulated[-1:], rel=1e-4), proc.stdout


@pytest.mark.gloo
@pytest.mark.parametrize("extra", [[], ["--mixed-precision", "bf16", "--fsdp-schedule"]], ids=["fp32", "bf16_fsdp"])
def test_a_mixture_of_experts_under_torchrun_matches_the_simulated_run(tmp_path, monkeypatch, extra):
    # transformers' Mixtral as it is (its experts' grouped matmuls): each rank runs its own tokens
    # through the experts (`ndfunc::experts`), made by transformers' implementation on the rank;
    # and in bf16 under nf.fsdp's schedule, whose weights gathered over tp, then dp_shard, are
    # prefetched as one unit and whose gradients summed over both stay fp32 between the two
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "model")
    flags = ["--hf-model", str(tmp_path / "model"), "--steps", "2", "--dp-shard", "2", "--cp", "1", "--tp", "2",
             "--log-every", "1", *QUICK, *extra]
    monkeypatch.setenv("NDFUNC_PLAN_CACHE_DIR", str(tmp_path / "plans"))  # as above: the ranks read its plans
    simulated = train.main(flags)
    proc = torchrun(pathlib.Path(train.__file__), *flags)
    real = [float(x) for x in re.findall(r"loss (\d\.\d+)  ", proc.stdout)]
    assert real == pytest.approx(simulated, rel=1e-4), proc.stdout


@pytest.mark.slow
def test_train_from_a_hugging_face_checkpoint(tmp_path):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    losses = train.main(["--hf-checkpoint", str(tmp_path), "--steps", "20", "--log-every", "10", *QUICK])
    assert sum(losses[-5:]) / 5 < losses[0]


@pytest.mark.slow
def test_mixed_precision_with_accumulation_trains_as_fp32_does_within_bf16_rounding():
    flags = ["--steps", "2", "--dp-shard", "2", "--cp", "1", "--tp", "1", "--grad-accum", "2", *QUICK]
    fp32 = train.main(flags)
    bf16 = train.main([*flags, "--mixed-precision", "bf16"])
    assert bf16 == pytest.approx(fp32, rel=1e-2) and bf16 != fp32  # bf16 rounding, a few times 2**-8


def _saved(path: pathlib.Path):
    """A train-job checkpoint, read whole (plain tensors) into the structure the job writes."""
    cfg = llama.LlamaConfig.tiny()
    params = llama.init(cfg, nf.random.key(0))
    opt = nf.optim.chain(nf.optim.clip_by_global_norm(1.0), nf.optim.adamw(1e-3))
    like = {"params": params, "opt": opt.init(params), "step": 0, "sequences": 0, "key": nf.random.key(0)}
    return nf.checkpoint.load(path, like)


@pytest.mark.slow
def test_a_run_resumed_from_its_checkpoint_equals_the_run_that_never_stopped(tmp_path):
    flags = ["--dp-shard", "2", "--cp", "1", "--tp", "1", "--micro-batch", "2", "--log-every", "100", *SHORT]
    whole = train.main(["--steps", "4", "--save-every", "2", "--checkpoint-dir", str(tmp_path / "run"), *flags])
    (tmp_path / "run" / "step_4").rename(tmp_path / "uninterrupted")  # as if it had died after step 3
    rest = train.main(["--steps", "4", "--save-every", "1", "--checkpoint-dir", str(tmp_path / "run"), "--resume",
                       *flags])
    assert rest == whole[2:]  # bit for bit
    a, b = _saved(tmp_path / "uninterrupted"), _saved(tmp_path / "run" / "step_4")
    assert a["step"] == b["step"] == 4 and a["sequences"] == b["sequences"] == 4 * 4
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    kept = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert kept == ["data.json", "step_2", "step_3", "step_4"]  # --keep 3, and what data the run read


@pytest.mark.slow
def test_a_run_saved_on_4d_resumes_on_fsdp_with_its_data_position(tmp_path, capsys):
    # the same effective batch of 8: 4 sequences x dp 2 on 4D, 2 x dp 4 on FSDP x4
    four_d = ["--micro-batch", "4", *SHORT, "--log-every", "100"]
    fsdp = ["--dp-shard", "4", "--cp", "1", "--tp", "1", "--micro-batch", "2", *SHORT, "--log-every", "100"]
    whole = train.main(["--steps", "4", "--save-every", "2", "--checkpoint-dir", str(tmp_path), *four_d])
    shutil.rmtree(tmp_path / "step_4")  # as if it had died after step 3
    rest = train.main(["--steps", "4", "--checkpoint-dir", str(tmp_path), "--resume", *fsdp])
    assert f"resumed from {tmp_path / 'step_2'}: step 2, 16 sequences seen" in capsys.readouterr().out
    assert rest == pytest.approx(whole[2:], rel=1e-5)  # fp32 sums in another order, two steps on


def test_resume_without_a_checkpoint_directory_is_refused_when_parsed(capsys):
    with pytest.raises(SystemExit):
        train.parse(["--resume"])
    assert "--resume needs --checkpoint-dir (where the run was saved)" in capsys.readouterr().err


@pytest.mark.slow
def test_the_job_writes_a_hugging_face_checkpoint_of_what_it_trained(tmp_path):
    flags = ["--dp-shard", "2", "--cp", "1", "--tp", "1", "--micro-batch", "2", "--steps", "2", *SHORT]
    train.main([*flags, "--checkpoint-dir", str(tmp_path / "ck"), "--save-hf", str(tmp_path / "hf")])
    params = _saved(tmp_path / "ck" / "step_2")["params"]
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x).logits
    torch.testing.assert_close(llama.apply(params, x, llama.LlamaConfig.tiny()), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_metrics_file_has_a_line_per_step_and_the_eval_loss_of_the_held_out_bytes(tmp_path):
    from models import data

    flags = ["--dp-shard", "2", "--cp", "1", "--tp", "1", "--micro-batch", "2", "--steps", "4", "--eval-every", "2",
             "--eval-steps", "2", *SHORT]
    train.main([*flags, "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ck")])
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert lines[0]["tokens_per_s"] is None and all(r["tokens_per_s"] > 0 for r in lines[1:])  # after compiling
    assert all(r["measured_peak_mib"] > r["estimated_peak_mib"] > 0 and r["flops_per_rank"] > 0 for r in lines)
    assert [("eval_loss" in r) for r in lines] == [False, True, False, True]
    # the last eval: the held-out batches under the final parameters, computed here on one device
    params = _saved(tmp_path / "ck" / "step_4")["params"]
    held = data.Sequences(data.held_out(), 32, seed=0)
    cfg = llama.LlamaConfig.tiny()
    expected = sum(float(llama.loss(params, dict(b, positions=torch.arange(32).expand(4, 32)), cfg))
                   for b in data.batches(held, 4, steps=2)) / 2
    assert lines[3]["eval_loss"] == pytest.approx(expected, rel=1e-5)
