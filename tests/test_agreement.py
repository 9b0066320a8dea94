"""Ranks agree on what they run, or say why not, in bounded time: 4 real gloo processes."""

import pathlib
import re

import pytest
from helpers import torchrun

WORKER = pathlib.Path(__file__).with_name("agreement_worker.py")


@pytest.mark.gloo
def test_ranks_that_would_run_different_programs_are_refused_on_every_rank_naming_who_and_what():
    proc = torchrun(WORKER, "disagree")
    # the four processes share one pipe, so their lines can interleave: match, don't split
    refused = re.findall(r"rank (\d+): refused after ([\d.]+) s", proc.stdout)
    assert sorted(r for r, _ in refused) == ["0", "1", "2", "3"], proc.stdout
    assert all(float(s) < 30 for _, s in refused), refused
    said = ("the ranks are about to run different programs: rank 2's program; rank 3's argument layouts differ(s) "
            "from rank 0's")
    assert proc.stdout.count(said) == 4, proc.stdout
    assert proc.stdout.count("start every rank with the same command line and configuration") == 4


@pytest.mark.gloo
def test_a_rank_that_stops_is_an_error_on_the_others_within_the_timeout(tmp_path):
    proc = torchrun(WORKER, "stopped", str(tmp_path))
    failed = re.findall(r"rank (\d+): failed after ([\d.]+) s", proc.stdout)
    assert sorted(r for r, _ in failed) == ["0", "2", "3"], proc.stdout
    assert all(float(s) < 10 for _, s in failed), failed  # timeout 4 s


def test_the_fingerprint_sees_constants_and_layouts_but_not_where_objects_live():
    import torch

    import ndfunc as nf
    from ndfunc._src import agreement
    from ndfunc.sharding import P

    def fields(lr, spec, act):
        def step(w, x, act):
            return (act(x @ w).sum() * lr).reshape(1)

        with nf.simulate(2):
            mesh = nf.make_mesh(dp=2)
            lowered = nf.jit(step, mesh=mesh, in_shardings=(P(), spec, None), static_argnums=(2,)).lower(
                torch.ones(3, 2), torch.ones(8, 3), act)
            return agreement.fingerprint(lowered.program, lowered.key[1])

    base = fields(0.1, P("dp"), lambda y: y * 2)
    same = fields(0.1, P("dp"), lambda y: y * 2)  # another function object, at another address
    other_lr = fields(0.2, P("dp"), lambda y: y * 2)
    other_layout = fields(0.1, P(None), lambda y: y * 2)
    assert base == same
    assert [k for k in base if base[k] != other_lr[k]] == ["program"]
    assert [k for k in base if base[k] != other_layout[k]] == ["argument layouts"]
