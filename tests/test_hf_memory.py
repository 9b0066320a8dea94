"""Peak memory of a sharded load_llama in 4 real gloo processes: each rank's memory grows by about
a quarter of the checkpoint, not by all of it. Run with -s to see the numbers."""

import json
import pathlib
import re

import pytest
import torch
from helpers import torchrun

import ndfunc as nf
from models import hf, llama

WORKER = pathlib.Path(__file__).with_name("hf_memory_worker.py")


@pytest.mark.gloo
def test_sharded_load_grows_each_rank_by_its_share(tmp_path):
    big = llama.LlamaConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1536)
    for name, cfg in (("big", big), ("warmup", llama.LlamaConfig.tiny())):
        params = nf.tree.tree_map_with_path(
            lambda p, shape: torch.full(shape, 0.01), llama.param_shapes(cfg))
        hf.save_llama(tmp_path / name, cfg, params)
    checkpoint = (tmp_path / "big" / "model.safetensors").stat().st_size
    del params
    proc = torchrun(WORKER, str(tmp_path / "big"), str(tmp_path / "warmup"))
    reports = [json.loads(m) for m in re.findall(r"\{\"rank\".*?\}", proc.stdout)]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3], proc.stdout
    for r in reports:
        # Each rank's blocks are a quarter of the checkpoint. Its peak resident memory (VmHWM: what
        # it allocates and any file pages it maps) may exceed that by one read band (4 MiB) and a
        # block being transposed, not by the rest of the file.
        assert r["local_bytes"] == pytest.approx(checkpoint / 4, rel=0.01)
        assert r["peak_growth"] < 0.4 * checkpoint, (r, checkpoint)
        assert r["anon_growth"] < 0.4 * checkpoint, (r, checkpoint)
    print(json.dumps({"checkpoint_bytes": checkpoint, "ranks": reports}))
