"""The main job's 4D step and a Hugging Face model's step under `nf.processes(8)` train what
`torchrun --nproc-per-node 8` trains, bit for bit, and what `nf.simulate(8)` trains within fp32
rounding: losses, and the parameters after the steps as gathered and saved (`--save-hf`)."""

import pathlib
import re

import pytest
import torch
import transformers
from helpers import torchrun
from processes_job import jobs
from safetensors.torch import load_file

import ndfunc as nf
from models import train

pytestmark = pytest.mark.gloo

# simulation runs each rank's ops with this process's threads; under torchrun and nf.processes each
# rank has one. At these sizes no op splits its work over threads, so the three agree exactly; on a
# bigger model a sum split over threads may differ in its last bits
SIMULATED_TOL = dict(rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_nf_processes_trains_what_torchrun_and_simulation_train(model, tmp_path, monkeypatch):
    # one plan cache for the three (as a cluster's ranks share one): simulation searches, and the 16
    # processes after it, lowering the same problems, read its plans back
    plans = tmp_path / "plans"
    monkeypatch.setenv("NDFUNC_PLAN_CACHE_DIR", str(plans))
    simulated = {name: train.main([*flags, "--simulate", "8", "--save-hf", str(tmp_path / "simulate" / name)])
                 for name, flags in jobs(model).items()}
    proc = torchrun(pathlib.Path(__file__).with_name("processes_job.py"), str(tmp_path / "torchrun"), model, nproc=8)
    with nf.processes(8, device="cpu"):  # both jobs on one set of workers, as a notebook's cells would run them
        real = {name: train.main([*flags, "--processes", "8", "--save-hf", str(tmp_path / "processes" / name)])
                for name, flags in jobs(model).items()}
    for name in jobs(model):
        logged = re.search(rf"^{name} losses \[(.*)\]$", proc.stdout, re.M).group(1)
        assert real[name] == [float(x) for x in logged.split(", ")], proc.stdout
        torch.testing.assert_close(torch.tensor(simulated[name]), torch.tensor(real[name]), **SIMULATED_TOL)
        by_torchrun = load_file(tmp_path / "torchrun" / name / "model.safetensors")
        by_processes = load_file(tmp_path / "processes" / name / "model.safetensors")
        by_simulation = load_file(tmp_path / "simulate" / name / "model.safetensors")
        assert by_processes.keys() == by_torchrun.keys() == by_simulation.keys()
        for key, want in by_torchrun.items():
            assert torch.equal(by_processes[key], want), f"{name}: {key} differs from torchrun's"
            torch.testing.assert_close(by_simulation[key], by_processes[key], **SIMULATED_TOL)
