"""nf.checkpoint: a tree saved from one layout loads bit-identical into another (4D -> FSDP x4 ->
TP x2 -> one device -> 4D); atomic saves, `keep`, asynchronous saves; bad checkpoints refused
before anything is read; and the same files written and read by 4 real gloo processes and by
simulation."""

from __future__ import annotations

import math
import pathlib
import pickle
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_worker import laid_out, make_tree, same, shardings_for
from helpers import torchrun
from torch.distributed.tensor import DTensor

import ndfunc as nf
from ndfunc.checkpoint import CheckpointError

FOUR_D = nf.ParallelConfig(dp_shard_size=2, cp_size=2, tp_size=2)
LAYOUTS = [("fsdp4", nf.ParallelConfig(dp_shard_size=4)), ("tp2", nf.ParallelConfig(tp_size=2)),
           ("hsdp", nf.ParallelConfig(dp_replicate_size=2, dp_shard_size=2))]


def saved_from_4d(path: pathlib.Path):
    tree = make_tree()
    with nf.simulate(FOUR_D.total_size):
        nf.checkpoint.save(path, laid_out(tree, shardings_for(tree, FOUR_D)))
    return tree


@pytest.mark.parametrize("name,config", [pytest.param(n, c, marks=[pytest.mark.slow] if n != "fsdp4" else [])
                                         for n, c in LAYOUTS], ids=[n for n, _ in LAYOUTS])
def test_saved_on_4d_loads_into_another_layout_and_back_bit_identical(tmp_path, name, config):
    tree = saved_from_4d(tmp_path / "4d")
    with nf.simulate(config.total_size):
        shardings = shardings_for(tree, config)
        got = nf.checkpoint.load(tmp_path / "4d", laid_out(tree, shardings))
        leaf = got["params"]["layers"][0]["attn"]["wq"]
        assert leaf.placements == shardings["params"]["layers"][0]["attn"]["wq"].placements
        assert same(nf.device_get(got), tree) and got["step"] == 7
        nf.checkpoint.save(tmp_path / name, got)
    assert same(nf.checkpoint.load(tmp_path / name, tree), tree)  # on one device, plain tensors
    with nf.simulate(FOUR_D.total_size):  # and back on 4D
        back = nf.checkpoint.load(tmp_path / name, laid_out(tree, shardings_for(tree, FOUR_D)))
        assert same(nf.device_get(back), tree)


def test_a_save_replaces_a_checkpoint_only_when_complete_and_what_a_dead_save_left_is_ignored(tmp_path):
    tree = saved_from_4d(tmp_path / "ck")
    # a save that died half way: its directory is hidden, and never taken for a checkpoint
    partial = tmp_path / ".step_9.partial"
    shutil.copytree(tmp_path / "ck", partial)
    (partial / ".metadata").unlink()
    manager = nf.checkpoint.Manager(tmp_path)
    assert manager.steps() == []  # 'ck' is not a step, the partial one is incomplete
    manager.save(9, tree)
    assert manager.steps() == [9] and not partial.exists()
    bigger = {**tree, "step": 8}
    nf.checkpoint.save(tmp_path / "ck", bigger)  # over an existing one: replaced whole
    assert nf.checkpoint.load(tmp_path / "ck", tree)["step"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "step_9"]


def test_the_manager_keeps_the_last_k_and_restores_the_latest_after_an_async_save(tmp_path):
    tree = make_tree()
    with nf.simulate(4):
        shardings = shardings_for(tree, nf.ParallelConfig(dp_shard_size=4))
        sharded = laid_out(tree, shardings)
        with nf.checkpoint.Manager(tmp_path / "run", keep=2) as manager:
            for step in range(1, 5):
                manager.save(step, {**sharded, "step": step}, blocking=step % 2 == 0)
            restored = manager.restore(laid_out(tree, shardings))
            assert manager.steps() == [3, 4] and restored["step"] == 4
            assert same(nf.device_get(restored)["params"], tree["params"])
            assert manager.restore(tree, step=3)["step"] == 3


def test_an_async_save_copies_the_values_before_the_step_overwrites_them(tmp_path):
    x = {"w": torch.arange(6.0)}
    with nf.checkpoint.Manager(tmp_path) as manager:
        manager.save(1, x, blocking=False)
        x["w"].add_(100.0)  # a donated buffer, written by the next step while the save runs
    assert torch.equal(nf.checkpoint.load(tmp_path / "step_1", x)["w"], torch.arange(6.0))


def test_async_save_returns_before_the_write_and_its_future_commits_it(tmp_path):
    tree = make_tree()
    with nf.simulate(4):
        sharded = laid_out(tree, shardings_for(tree, nf.ParallelConfig(dp_shard_size=4)))
        pending = nf.checkpoint.async_save(tmp_path / "ck", sharded)
        wq = sharded["params"]["layers"][0]["attn"]["wq"]
        wq.to_local().add_(1.0)  # the step goes on, in place, while the write runs
        assert pending.result() is None and (tmp_path / "ck" / ".metadata").is_file()
        got = nf.device_get(nf.checkpoint.load(tmp_path / "ck", sharded))
    assert same(got, tree)  # what was there when async_save returned


def test_bad_checkpoints_are_refused_naming_the_file_and_nothing_is_loaded(tmp_path):
    tree = saved_from_4d(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path / 'nowhere'} does not exist; a checkpoint is "
                                                        "a directory written by nf.checkpoint.save")):
        nf.checkpoint.load(tmp_path / "nowhere", tree)
    (tmp_path / "foreign").mkdir()
    with pytest.raises(CheckpointError, match=r"foreign has no \.metadata \(an incomplete or foreign directory\)"):
        nf.checkpoint.load(tmp_path / "foreign", tree)
    shutil.copytree(tmp_path / "ck", tmp_path / "damaged")
    (tmp_path / "damaged" / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match=r"damaged/\.metadata cannot be read \(.*\); the checkpoint is damaged"):
        nf.checkpoint.load(tmp_path / "damaged", tree)
    with pytest.raises(CheckpointError, match=r"has no 'extra' \(it holds \d+ entries"):
        nf.checkpoint.load(tmp_path / "ck", {**tree, "extra": torch.zeros(1)})
    wrong = {**tree, "params": {**tree["params"], "embed": torch.zeros(3, 3)}}
    with pytest.raises(CheckpointError, match=re.escape("'params.embed' was saved as float32[256, 64], but `like` "
                                                        "has float32[3, 3]")):
        nf.checkpoint.load(tmp_path / "ck", wrong)
    with pytest.raises(TypeError, match="leaf 'opt' is a object"):
        nf.checkpoint.save(tmp_path / "x", {"opt": object()})


class _Payload:
    """What a tampered index holds: unpickled, it calls `call(*args)`."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.mark.parametrize("call", [open, pathlib.Path.touch], ids=["open", "a method of an admitted class"])
def test_an_index_that_would_run_code_is_refused_and_nothing_runs(tmp_path, call):
    # DCP's index is a pickle: one made to call something when read is refused before the call,
    # as torch.load(weights_only=True) refuses a tensor file that would
    tree = saved_from_4d(tmp_path / "ck")
    marker = tmp_path / "written_by_the_payload"
    metadata = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata()
    metadata.planner_data = _Payload(call, *((str(marker), "w") if call is open else (marker,)))
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    name = "io.open" if call is open else "pathlib.Path.touch"
    with pytest.raises(CheckpointError, match=re.escape(
            f"ck/.metadata names {name}, which no checkpoint's index holds (DCP's is made of its metadata types, "
            "sizes, dtypes and paths); reading it would run code, so it is refused and nothing was read. Load a "
            "checkpoint written by nf.checkpoint.save or torch.distributed.checkpoint.save.")):
        nf.checkpoint.load(tmp_path / "ck", tree)
    assert not marker.exists()
    # the index as DCP wrote it loads, through the same reader
    metadata.planner_data = None
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(metadata))
    assert same(nf.checkpoint.load(tmp_path / "ck", tree), tree)


def _chunks(path: pathlib.Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Each tensor's chunks in DCP's index: (offset, size) of each block written."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks) for k, v in saved.items()
            if hasattr(v, "chunks")}


def test_simulation_writes_each_distinct_block_as_a_chunk_and_gathers_nothing(tmp_path):
    tree = saved_from_4d(tmp_path / "ck")
    chunks = _chunks(tmp_path / "ck")
    # wq (64, 64), laid out on dp_shard 2 x cp 2 x tp 2 as the model's rules say
    with nf.simulate(FOUR_D.total_size):
        wq = laid_out(tree, shardings_for(tree, FOUR_D))["params"]["layers"][0]["attn"]["wq"]
        distinct = {tuple(s.start for s in i) for i in nf.sharding_of(wq).shard_indices(wq.shape)}
        block = tuple(wq.to_local().shape)
    assert len(distinct) == math.prod(wq.shape) // math.prod(block) > 1  # the blocks tile the leaf once
    assert chunks["params.layers.0.attn.wq"] == sorted((o, block) for o in distinct)
    assert chunks["params.embed"] != [((0, 0), (256, 64))]  # not one whole chunk
    with nf.simulate(FOUR_D.total_size), pytest.MonkeyPatch.context() as patch:
        patch.setattr(DTensor, "full_tensor", lambda self, **kw: pytest.fail("a leaf was gathered"))
        nf.checkpoint.save(tmp_path / "again", laid_out(tree, shardings_for(tree, FOUR_D)))
    assert _chunks(tmp_path / "again") == chunks


@pytest.mark.gloo
def test_four_gloo_processes_save_their_blocks_and_simulation_reads_the_same_files(tmp_path):
    proc = torchrun(pathlib.Path(__file__).with_name("checkpoint_worker.py"), str(tmp_path))
    assert sorted(re.findall(r"rank (\d+): checkpoint ok", proc.stdout)) == ["0", "1", "2", "3"], proc.stdout
    files = sorted(p.name for p in (tmp_path / "blocking").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]  # each its own
    tree = make_tree()
    with nf.simulate(FOUR_D.total_size):
        got = nf.checkpoint.load(tmp_path / "blocking", laid_out(tree, shardings_for(tree, FOUR_D)))
        assert same(nf.device_get(got), tree)
    saved_by_ranks = nf.ParallelConfig(dp_shard_size=2, tp_size=2)
    with nf.simulate(saved_by_ranks.total_size):
        nf.checkpoint.save(tmp_path / "simulated", laid_out(tree, shardings_for(tree, saved_by_ranks)))
    assert _chunks(tmp_path / "simulated") == _chunks(tmp_path / "blocking")  # the blocks real ranks wrote
    assert same(nf.checkpoint.load(tmp_path / "run" / "step_3", tree), tree)
