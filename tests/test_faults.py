"""Faults in real processes: a rank killed mid-run takes the others down within seconds, and the
run resumes from its last complete checkpoint onto the losses of a run that never stopped; a rank
killed while the ranks save leaves the previous checkpoint loadable."""

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
from ndfunc.sharding import NamedSharding, P

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


TRAIN = str(pathlib.Path(train.__file__))


def _torchrun(script: str, *args: str) -> subprocess.Popen:
    """4 gloo ranks of `script args`, running."""
    env = outside_torchrun_env()
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                             script, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.gloo
def test_a_rank_killed_mid_run_stops_the_others_and_the_run_resumes_onto_the_same_losses(tmp_path, monkeypatch):
    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    run = [*FLAGS, "--steps", "8", "--save-every", "2", "--checkpoint-dir", str(ck), "--metrics", str(metrics)]
    # the uninterrupted run, in simulation (which equals real ranks), keeps its plans on disk;
    # the ranks read them back (the same problems), and so does the resumed run
    monkeypatch.setenv("NDFUNC_PLAN_CACHE_DIR", str(tmp_path / "plans"))  # the ranks inherit it
    reference = train.main([*FLAGS, "--steps", "8"])
    proc = _torchrun(TRAIN, *run)
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
    assert sorted(p.suffix for p in (tmp_path / "plans").iterdir()) == [".plan"] * 2  # init's and the step's
    resumed = _torchrun(TRAIN, *run, "--resume")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and f"resumed from {ck / f'step_{last}'}" in out, out[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    after = {r["step"]: r["loss"] for r in lines[-(8 - last):]}
    assert sorted(after) == list(range(last + 1, 9))
    assert [after[s] for s in range(last + 1, 9)] == pytest.approx(reference[last:], rel=1e-5)


SAVER = """
import sys, torch, ndfunc as nf
from ndfunc.sharding import NamedSharding, P
nf.init()
mesh = nf.make_mesh(dp_shard=4)
manager = nf.checkpoint.Manager(sys.argv[1])
small = nf.device_put({"w": torch.arange(16.0)}, {"w": NamedSharding(mesh, P("dp_shard"))})
manager.save(1, {**small, "step": 1})
# 768 MiB a rank, each rank's block its own value: a write of seconds
big = nf.make_array_from_callback((4 * 3, 2**26), NamedSharding(mesh, P("dp_shard")),
                                  lambda index: torch.full((3, 2**26), float(index[0].start)))
manager.save(2, {"w": big, "step": 2})
print("saved step 2", flush=True)
"""


@pytest.mark.gloo
def test_a_rank_killed_while_the_ranks_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    (tmp_path / "saver.py").write_text(SAVER)
    ck = tmp_path / "ck"
    proc = _torchrun(str(tmp_path / "saver.py"), str(ck))
    victim_file = ck / ".step_2.partial" / "__2_0.distcp"
    deadline = time.monotonic() + 240
    while not victim_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling for rank 2's own data file: the kill must land while it writes
    assert victim_file.exists(), proc.communicate()[0][-3000:]
    victims = _workers(proc.pid, "2")
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "saved step 2" not in out, out[-3000:]
    assert not (ck / ".step_2.partial" / ".metadata").exists() and not (ck / "step_2").exists()
    manager = nf.checkpoint.Manager(ck)
    assert manager.steps() == [1]
    got = manager.restore({"w": torch.zeros(16), "step": 0})  # on one device: the blocks of 4 ranks
    assert torch.equal(got["w"], torch.arange(16.0)) and got["step"] == 1
    with nf.simulate(4):  # the next save of the run clears what the dead one left
        mesh = nf.make_mesh(dp_shard=4)
        manager.save(2, nf.device_put({"w": torch.ones(16), "step": 2}, {"w": NamedSharding(mesh, P("dp_shard")),
                                                                         "step": None}))
    assert manager.steps() == [1, 2] and not (ck / ".step_2.partial").exists()
