"""`nf.processes`: a notebook's life with real worker processes (Monarch, gloo): handles, dispatch,
cells run again, interrupts, errors on a rank, a worker that dies, and every worker ended on exit.

Every value is checked against the same code run here on one device."""

import _thread
import os
import sys
import threading
import time

import psutil
import pytest
import torch

import ndfunc as nf
from ndfunc.sharding import NamedSharding, P

pytestmark = pytest.mark.gloo

FULL = torch.arange(24.0).reshape(6, 4)


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def running(pids) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="class")
def workers():
    with nf.processes(2) as w:
        yield w


def slow_block(index):
    # a block that takes a rank 0.3 s to make: the ranks' work a queue, an interrupt or a dead
    # worker is told against
    time.sleep(0.3)
    return FULL[index]


def printing_block(index):
    print(f"block {index[0].start} from rank {nf.rank()}")
    return FULL[index]


def failing_block(index):
    if nf.rank() == 1:
        raise ValueError(f"no block at {index[0].start}")
    return FULL[index]


class TestOneBlockOfTwoWorkers:
    """Tests sharing one block of two workers, as a notebook's cells share one."""

    def test_arrays_are_handles_and_their_values_those_of_one_device(self, workers):
        mesh = nf.make_mesh(dp=2)
        x = nf.device_put(FULL, NamedSharding(mesh, P("dp")))
        assert (tuple(x.shape), x.dtype, x.sharding.spec) == ((6, 4), torch.float32, P("dp"))
        assert repr(x).startswith("Array(shape=(6, 4), dtype=torch.float32, sharding=NamedSharding(")
        assert torch.equal(nf.device_get(x), FULL)
        # each rank holds its own block only
        blocks = workers.each(lambda a: a.to_local().clone(), x)
        assert torch.equal(blocks[0], FULL[:3]) and torch.equal(blocks[1], FULL[3:])
        # torch functions and tensor methods run on the ranks, as on DTensors
        y = torch.exp(x * 0.1).sum(0)
        assert torch.allclose(nf.device_get(y), torch.exp(FULL * 0.1).sum(0))
        assert float(x.sum()) == float(FULL.sum())


    def test_a_step_runs_as_on_one_device_and_a_rerun_cell_reuses_the_workers_and_the_plan(self, workers):
        mesh = nf.make_mesh(dp=2)
        pids = list(workers.pids)
        before = descendants()

        def cell():  # what a notebook cell holds: its step made anew each time it runs
            def loss_fn(w, x):
                return torch.tanh(x @ w).pow(2).mean()

            step = nf.jit(nf.value_and_grad(loss_fn), mesh=mesh, in_shardings=(P(), P("dp")))
            return step(torch.ones(4, 3) * 0.1, nf.device_put(FULL, NamedSharding(mesh, P("dp"))))

        from ndfunc._src.partition.planning import solve

        loss, grad = cell()
        plans = workers.each(lambda: len(solve._PLANS))
        want_loss, want_grad = nf.value_and_grad(lambda w, x: torch.tanh(x @ w).pow(2).mean())(torch.ones(4, 3) * 0.1, FULL)
        torch.testing.assert_close(nf.device_get(loss), want_loss)
        torch.testing.assert_close(nf.device_get(grad), want_grad)
        loss2, _ = cell()
        assert float(loss2) == float(loss)
        assert workers.pids == pids and descendants() == before  # no new process
        assert workers.each(lambda: len(solve._PLANS)) == plans  # the plan found again, not searched


    def test_lower_and_compile_on_the_ranks_show_and_run_the_program(self, workers):
        mesh = nf.make_mesh(dp=2)
        x = nf.device_put(FULL, NamedSharding(mesh, P("dp")))
        step = nf.jit(lambda w, a: (a @ w).relu().sum(), mesh=mesh, in_shardings=(P(), P("dp")))
        low = step.lower(torch.ones(4, 3), x)
        # each rank's half of the rows, then one all-reduce of the partial sums over dp
        assert low.cost_analysis()["collectives"] == {"all_reduce": 1}
        assert low.cost_analysis()["flops"] == 2 * 3 * 4 * 3
        assert "all_reduce" in low.as_text() and "float32[3, 4]" in low.as_text()
        assert low.memory_analysis().argument_size_in_bytes == (3 * 4 + 4 * 3) * 4
        assert "<table" in low._repr_html_()
        compiled = low.compile()
        assert compiled.cost_analysis()["collectives"] == {"all_to_all": 1}  # as gloo runs it fastest
        assert float(compiled(torch.ones(4, 3), x)) == float((FULL @ torch.ones(4, 3)).relu().sum())

    def test_checkpoints_save_and_load_on_the_ranks(self, workers, tmp_path):
        mesh = nf.make_mesh(dp=2)
        x = nf.device_put(FULL, NamedSharding(mesh, P("dp")))
        nf.checkpoint.save(tmp_path / "one", {"x": x, "step": 3})
        back = nf.checkpoint.load(tmp_path / "one", {"x": nf.device_put(torch.zeros(6, 4), NamedSharding(mesh, P())),
                                                      "step": 0})
        assert back["step"] == 3 and back["x"].sharding.spec == P()
        assert torch.equal(nf.device_get(back["x"]), FULL)
        with nf.checkpoint.Manager(tmp_path / "run", keep=1) as manager:
            manager.save(5, {"x": x})
            manager.wait()
            assert manager.latest_step() == 5
        assert torch.equal(nf.checkpoint.load(tmp_path / "run" / "step_5", {"x": FULL.clone()})["x"], FULL)

    def test_calls_return_at_once_and_a_fetch_waits_for_them(self, workers):
        mesh = nf.make_mesh(dp=2)
        sharding = NamedSharding(mesh, P("dp"))
        nf.make_array_from_callback(FULL.shape, sharding, slow_block)  # a first call waits: it says what it makes
        start = time.perf_counter()
        made = [nf.make_array_from_callback(FULL.shape, sharding, slow_block) for _ in range(4)]
        issued = time.perf_counter() - start
        assert issued < 0.6  # four calls of 0.3 s each: issued, not run
        assert torch.equal(nf.device_get(made[-1]), FULL)
        assert time.perf_counter() - start >= 4 * 0.3


    def test_an_interrupt_drops_the_queued_calls_and_leaves_the_workers_usable(self, workers):
        mesh = nf.make_mesh(dp=2)
        sharding = NamedSharding(mesh, P("dp"))
        nf.make_array_from_callback(FULL.shape, sharding, slow_block)
        made = [nf.make_array_from_callback(FULL.shape, sharding, slow_block) for _ in range(30)]  # 9 s queued
        threading.Timer(1.0, _thread.interrupt_main).start()
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            nf.device_get(made[-1])
        # back at once, and the queue behind the running call gone (it would take 8 s more)
        assert time.perf_counter() - start < 4.5
        start = time.perf_counter()
        assert torch.equal(nf.device_get(nf.device_put(FULL, sharding)), FULL)
        assert time.perf_counter() - start < 4.5
        with pytest.raises(RuntimeError, match=r"a value this call reads \(\(\d+, 0\)\) is not on rank 0: it was "
                                               r"interrupted before it ran. Make it again"):
            nf.device_get(made[-1])

    def test_an_interrupt_keeps_the_steps_that_consume_the_state(self, workers):
        # a training step donates its parameters: its results are their only copy, so it runs
        mesh = nf.make_mesh(dp=2)
        sharding = NamedSharding(mesh, P("dp"))
        step = nf.jit(lambda w: w + 1, mesh=mesh, in_shardings=P("dp"), out_shardings=P("dp"), donate_argnums=0)
        w = step(nf.device_put(FULL, sharding))
        nf.make_array_from_callback(FULL.shape, sharding, slow_block)
        for _ in range(6):
            nf.make_array_from_callback(FULL.shape, sharding, slow_block)  # no step reads it: dropped
            w = step(w)
        threading.Timer(0.5, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            nf.device_get(w)
        assert torch.equal(nf.device_get(w), FULL + 7)

    def test_with_mesh_and_axis_rules_hold_on_the_ranks_too(self, workers):
        mesh = nf.make_mesh(dp=2)
        with mesh, nf.sharding.axis_rules([("batch", "dp")]):
            x = nf.device_put(FULL, P("dp"))  # a bare P: the mesh entered here
            step = nf.jit(lambda a: nf.with_logical_constraint(a * 2, ("batch", None)))
            y = step(x)
        assert y.sharding.spec == P("dp")
        assert torch.equal(nf.device_get(y), FULL * 2)

    def test_an_exception_on_a_rank_is_raised_here_naming_the_rank_and_the_line(self, workers):
        mesh = nf.make_mesh(dp=2)
        with pytest.raises(ValueError, match="no block at 3") as caught:
            nf.make_array_from_callback(FULL.shape, NamedSharding(mesh, P("dp")), failing_block)
        (note,) = caught.value.__notes__
        assert note.startswith("raised on rank 1 of nf.processes(2, device='cpu'), at ")
        assert note.endswith(f"in failing_block: raise ValueError(f\"no block at {{index[0].start}}\")")
        assert "test_processes.py" in note
        assert float(nf.device_put(FULL, NamedSharding(mesh, P())).sum()) == float(FULL.sum())  # still usable


    def test_rank_zeros_output_is_shown_and_the_others_on_request(self, workers, capsys):
        mesh = nf.make_mesh(dp=2)
        sharding = NamedSharding(mesh, P("dp"))
        nf.device_get(nf.make_array_from_callback(FULL.shape, sharding, printing_block))
        out = capsys.readouterr().out
        assert "block 0 from rank 0\n" in out and "rank 1" not in out
        workers.show_output("all")
        try:
            nf.device_get(nf.make_array_from_callback(FULL.shape, sharding, printing_block))
        finally:
            workers.show_output(0)
        out = capsys.readouterr().out
        assert "[rank 0] block 0 from rank 0\n" in out and "[rank 1] block 3 from rank 1\n" in out


    def test_a_donated_array_is_refused(self, workers):
        mesh = nf.make_mesh(dp=2)
        step = nf.jit(lambda x: x * 2, mesh=mesh, in_shardings=P("dp"), out_shardings=P("dp"), donate_argnums=0)
        x = nf.device_put(FULL, NamedSharding(mesh, P("dp")))
        y = step(x)
        with pytest.raises(ValueError, match=r"this Array was donated to a step \(donate_argnums\): its buffers now hold the step.s results"):
            step(x)
        assert torch.equal(nf.device_get(y), FULL * 2)


    def test_simulate_inside_and_a_mesh_of_more_ranks_than_workers_are_refused(self, workers):
        with pytest.raises(RuntimeError, match=r"simulate\(2\) was started inside nf.processes\(2, device='cpu'\)"):
            nf.simulate(2).start()
        with pytest.raises(nf.sharding.ShardingError, match="mesh dp=4 has 4 ranks but the world has 2") as caught:
            nf.make_mesh(dp=4)
        assert caught.value.__notes__[0].startswith("raised on rank 0 of nf.processes(2")


def test_leaving_the_block_ends_every_worker_and_its_arrays():
    before = descendants()
    with nf.processes(2) as w:
        pids = w.pids
        assert set(pids) <= descendants() - before
        mesh = nf.make_mesh(dp=2)
        x = nf.device_put(FULL, NamedSharding(mesh, P("dp")))
    _, left = psutil.wait_procs(running(pids), timeout=10)
    assert not [p for p in left if alive(p.pid)]
    assert {p for p in descendants() - before if alive(p)} == set()
    with pytest.raises(RuntimeError, match=r"nf.processes\(2, device='cpu'\) is not running .* its arrays are gone"):
        nf.device_get(x)
    assert "gone" in repr(x)


def test_a_worker_that_dies_is_an_error_within_seconds_and_processes_start_again():
    with nf.processes(2) as w:
        mesh = nf.make_mesh(dp=2)
        sharding = NamedSharding(mesh, P("dp"))
        nf.make_array_from_callback(FULL.shape, sharding, slow_block)
        queued = [nf.make_array_from_callback(FULL.shape, sharding, slow_block) for _ in range(30)]
        victim = w.pids[1]
        threading.Timer(0.5, os.kill, (victim, 9)).start()
        start = time.perf_counter()
        with pytest.raises(nf.WorkerDiedError, match=rf"the process of rank 1 \(pid {victim}\) has ended"):
            nf.device_get(queued[-1])
        assert time.perf_counter() - start < 5  # not the collectives' timeout, nor the 9 s queued
        survivor = w.pids if w._session else None
    assert survivor is None
    with nf.processes(2):  # the same interpreter starts afresh
        mesh = nf.make_mesh(dp=2)
        assert torch.equal(nf.device_get(nf.device_put(FULL, NamedSharding(mesh, P("dp")))), FULL)


def test_bad_input_is_refused_with_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match=r"nf.processes\(\) starts one rank per visible GPU, and this machine has "
                                         r"none; say how many CPU ranks: nf.processes\(4\)"):
        nf.processes()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"nf.processes\(4\) asks for 4 GPU ranks but 2 GPU\(s\) are visible"):
        nf.processes(4, device="cuda")
    monkeypatch.undo()
    with nf.simulate(2):
        with pytest.raises(RuntimeError, match="drives worker processes from a process with no world of its own"):
            nf.processes(2).start()
    import ndfunc._src.processes

    monkeypatch.delattr(ndfunc._src.processes, "launch", raising=False)
    monkeypatch.setitem(sys.modules, "ndfunc._src.processes.launch", None)
    monkeypatch.setitem(sys.modules, "monarch.actor", None)
    with pytest.raises(ImportError, match=r"install it with: pip install 'ndfunc\[notebook\]'"):
        nf.processes(2).start()


def test_two_hosts_played_by_processes_here_make_one_world():
    # monarch.job.ProcessJob: each host a process of this machine serving Monarch, as a cluster's are
    from monarch.job import ProcessJob

    job = ProcessJob({"hosts": 2})
    try:
        hosts = job.state(cached_path=None).hosts
        with nf.processes(2, hosts=hosts, device="cpu") as w:
            assert w.world_size == nf.world_size() == 4
            places = w.each(lambda: (nf.rank(), os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"]))
            assert places == [(0, "0", "0"), (1, "0", "1"), (2, "1", "0"), (3, "1", "1")]
            mesh = nf.make_mesh(dp_replicate=2, dp_shard=2)
            x = nf.device_put(FULL, NamedSharding(mesh, P("dp_shard")))
            step = nf.jit(lambda a: (a * a).sum(0), mesh=mesh)
            torch.testing.assert_close(nf.device_get(step(x)), (FULL * FULL).sum(0))
    finally:
        job.kill()
