"""Faults in real processes: a rank killed mid-run takes the others down within seconds, and the
run resumes from its last complete checkpoint onto the losses of a run that never stopped; a
process killed while it saves leaves the previous checkpoint loadable."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import REPO, outside_torchrun_env

import ndfunc as nf
from models import train

FLAGS = ["--dp-shard", "2", "--cp", "1", "--tp", "2", "--seq-len", "32", "--warmup", "2", "--micro-batch", "2",
         "--log-every", "100"]


def _workers(parent: int, rank: str) -> list[int]:
    """The pids of torchrun's worker processes (descendants of `parent`) of LOCAL_RANK `rank`."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if f"LOCAL_RANK={rank}".encode() in env and ppid != 1 and _descends(ppid, parent):
            found.append(int(entry.name))
    return found


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            status = (pathlib.Path("/proc") / str(pid) / "status").read_text()
        except OSError:
            return False
        pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    return False


def _torchrun(*args: str) -> subprocess.Popen:
    env = outside_torchrun_env()
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                             str(pathlib.Path(train.__file__)), *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.gloo
def test_a_rank_killed_mid_run_stops_the_others_and_the_run_resumes_onto_the_same_losses(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    run = [*FLAGS, "--steps", "8", "--save-every", "2", "--checkpoint-dir", str(ck), "--metrics", str(metrics)]
    proc = _torchrun(*run)
    deadline = time.monotonic() + 240
    while not (ck / "step_4").is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # polling for the run's own file: the kill must land after step 4 is saved
    assert (ck / "step_4").is_dir(), proc.communicate()[0][-3000:]
    victims = _workers(proc.pid, "2")
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    killed = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 10, out[-3000:]  # every rank gone, not hung
    assert proc.returncode != 0
    last = nf.checkpoint.Manager(ck).latest_step()
    assert last is not None and last >= 4
    resumed = _torchrun(*run, "--resume")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and f"resumed from {ck / f'step_{last}'}" in out, out[-3000:]
    # the uninterrupted run, in simulation (which equals real ranks)
    reference = train.main([*FLAGS, "--steps", "8"])
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    after = {r["step"]: r["loss"] for r in lines[-(8 - last):]}
    assert sorted(after) == list(range(last + 1, 9))
    assert [after[s] for s in range(last + 1, 9)] == pytest.approx(reference[last:], rel=1e-5)


SAVER = """
import sys, torch, ndfunc as nf
big = {"w": torch.randn(6, 2**26, generator=torch.Generator().manual_seed(0))}  # 1.5 GiB: a write of seconds
nf.checkpoint.save(sys.argv[1], big)
"""


@pytest.mark.gloo
def test_a_process_killed_while_it_saves_leaves_the_previous_checkpoint_loadable(tmp_path):
    before = {"w": torch.arange(10.0), "step": 1}
    nf.checkpoint.save(tmp_path / "ck", before)
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path / "ck")], env=outside_torchrun_env())
    partial = tmp_path / ".ck.partial"
    deadline = time.monotonic() + 120
    while not (partial.is_dir() and any(partial.iterdir())) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling: the kill must land once the save has begun writing, before it ends
    proc.kill()
    proc.wait()
    assert partial.is_dir() and not (partial / ".metadata").exists()  # killed mid-write
    got = nf.checkpoint.load(tmp_path / "ck", before)
    assert torch.equal(got["w"], before["w"]) and got["step"] == 1
    nf.checkpoint.save(tmp_path / "ck", {"w": torch.ones(10), "step": 2})  # the next save clears what was left
    assert not partial.exists() and nf.checkpoint.load(tmp_path / "ck", before)["step"] == 2
