"""Plans kept on disk (`NDFUNC_PLAN_CACHE_DIR`): a plan searched in one process is the plan another
process lowers without searching; an unreadable entry is searched again, with a warning."""

import re
import subprocess
import sys

import optree
import pytest

import ndfunc as nf
from models import llama, train
from ndfunc._src.partition.planning import plan_cache, solve
from ndfunc.sharding import NamedSharding
from tests.helpers import REPO, outside_torchrun_env

LOWER = "import sys; from tests.test_plan_cache import lower_here; sys.stdout.write(lower_here())"


def lower_here() -> str:
    """The tiny llama's train step lowered on an abstract dp_shard 2 x tp 2 mesh, as text."""
    config = nf.ParallelConfig(dp_shard_size=2, tp_size=2)
    cfg, opt = llama.LlamaConfig.tiny(), nf.optim.adamw(1e-3)
    mesh = config.build_abstract_mesh()
    specs = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), specs))
    step = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh)
    return step.lower(params, opt.init(params), train.abstract_batch(config, mesh, 2, 32)).as_text()


def _program(text: str) -> str:
    return re.sub(r"0x[0-9a-f]+", "ADDR", text.split("\n", 1)[1])  # less the header line


@pytest.mark.slow
def test_a_plan_searched_in_one_process_is_lowered_in_another_without_a_search(tmp_path, monkeypatch):
    cache = tmp_path / "plans"
    env = {**outside_torchrun_env(), plan_cache.ENV: str(cache)}
    searched = subprocess.run([sys.executable, "-c", LOWER], capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=300)
    assert searched.returncode == 0, searched.stderr[-3000:]
    entries = sorted(cache.glob("*.plan"))
    assert entries, "the searching process kept no plan"

    monkeypatch.setenv(plan_cache.ENV, str(cache))
    monkeypatch.setattr(solve, "_PLANS", type(solve._PLANS)())  # nothing remembered in this process

    def no_search(self):
        raise AssertionError("searched, where the kept plan should have been read")

    with monkeypatch.context() as m:
        m.setattr(solve.Problem, "solve", no_search)
        assert _program(lower_here()) == _program(searched.stdout)

    # an entry cut short (a disk filled mid-write by another tool) is searched again and rewritten
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[:100])
    monkeypatch.setattr(solve, "_PLANS", type(solve._PLANS)())
    with pytest.warns(RuntimeWarning, match=r"the plan cache entry .*\.plan cannot be read as a plan \(.*\); "
                                            r"planning again and rewriting it\."):
        assert _program(lower_here()) == _program(searched.stdout)
    with monkeypatch.context() as m:
        m.setattr(solve.Problem, "solve", no_search)
        monkeypatch.setattr(solve, "_PLANS", type(solve._PLANS)())
        assert _program(lower_here()) == _program(searched.stdout)


def test_a_plan_remembered_before_the_variable_was_set_is_kept_once_it_is(tmp_path, monkeypatch):
    # a notebook plans in simulation, then sets the variable for the worker processes it starts:
    # the plan this process holds is kept there, though it is not searched again
    monkeypatch.delenv(plan_cache.ENV, raising=False)
    monkeypatch.setattr(solve, "_PLANS", type(solve._PLANS)())
    want = _program(lower_here())
    monkeypatch.setenv(plan_cache.ENV, str(tmp_path))
    with monkeypatch.context() as m:
        m.setattr(solve.Problem, "solve", lambda self: pytest.fail("searched again"))
        assert _program(lower_here()) == want
    kept = sorted(tmp_path.glob("*.plan"))
    assert kept
    monkeypatch.setattr(solve, "_PLANS", type(solve._PLANS)())  # as another process: read back, not searched
    with monkeypatch.context() as m:
        m.setattr(solve.Problem, "solve", lambda self: pytest.fail("searched, where the kept plan should be read"))
        assert _program(lower_here()) == want
    assert sorted(tmp_path.glob("*.plan")) == kept


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickled, it writes a file
        return open, (str(self.path), "w")


def test_an_entry_that_would_run_code_when_unpickled_is_read_as_no_plan_and_runs_nothing(tmp_path, monkeypatch):
    # a directory a cluster shares may be written by anyone who can write there: an entry is JSON,
    # so one made to run code when read as a pickle is only an unreadable entry
    import pickle

    monkeypatch.setenv(plan_cache.ENV, str(tmp_path / "plans"))
    monkeypatch.setattr(solve, "_PLANS", type(solve._PLANS)())
    want = _program(lower_here())
    marker = tmp_path / "written_by_the_payload"
    entries = sorted((tmp_path / "plans").glob("*.plan"))
    for entry in entries:
        entry.write_bytes(pickle.dumps((entry.read_text(), _Payload(marker))))
    monkeypatch.setattr(solve, "_PLANS", type(solve._PLANS)())
    with pytest.warns(RuntimeWarning, match=r"the plan cache entry .*\.plan cannot be read as a plan "
                                            r"\(UnicodeDecodeError: .*\); planning again and rewriting it\."):
        assert _program(lower_here()) == want
    assert not marker.exists()
    assert sorted((tmp_path / "plans").glob("*.plan")) == entries  # rewritten as plans
    monkeypatch.setattr(solve, "_PLANS", type(solve._PLANS)())
    with monkeypatch.context() as m:
        m.setattr(solve.Problem, "solve", lambda self: pytest.fail("searched, where the rewritten plan should be read"))
        assert _program(lower_here()) == want


def test_without_the_variable_no_plan_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(plan_cache.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert plan_cache.directory() is None and plan_cache.entry(("a key",)) is None
    plan_cache.store(plan_cache.entry(("a key",)), ([], [], 0.0, []))
    assert plan_cache.load(plan_cache.entry(("a key",)), 0) is None
    assert list(tmp_path.iterdir()) == []


def test_ranks_writing_the_same_entry_at_once_leave_one_whole_plan(tmp_path, monkeypatch):
    # every rank of a job searches the same problem and writes its entry at about the same time,
    # while another may already be reading it: a reader sees no entry or a whole one, never a part
    import json
    import threading

    from torch.distributed.tensor import Partial, Replicate, Shard

    from ndfunc._src.partition.planning.strategies import Strategy

    monkeypatch.setenv(plan_cache.ENV, str(tmp_path))
    at = plan_cache.entry(("a key",))
    layout = (Shard(1), Replicate(), Partial("sum"))
    plan = ([None, Strategy((layout,), (layout, layout))] * 500, [(0, 0, layout)] * 1000, 1.5, list(range(1000)), None)
    start, done, seen = threading.Barrier(5), threading.Event(), []

    def write():
        start.wait()
        for _ in range(50):
            plan_cache.store(at, plan)

    def read():
        start.wait()
        while not done.is_set():
            try:
                seen.append(json.loads(at[0].read_text())["key"] == at[1])
            except FileNotFoundError:
                pass
            except Exception:  # noqa: BLE001 - a part of an entry
                seen.append(False)

    writers = [threading.Thread(target=write) for _ in range(4)]
    reader = threading.Thread(target=read)
    for t in [*writers, reader]:
        t.start()
    for w in writers:
        w.join()
    done.set()
    reader.join()
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} reads saw a part of the entry"
    assert [p.name for p in tmp_path.iterdir()] == [at[0].name]  # no temporary file left behind
    assert plan_cache.load(at, 1000) == plan
