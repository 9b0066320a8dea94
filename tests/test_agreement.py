"""Ranks agree on what they run, or say why not, in bounded time: 4 real gloo processes."""

import pathlib
import re

import pytest
from helpers import torchrun

WORKER = pathlib.Path(__file__).with_name("agreement_worker.py")


@pytest.mark.gloo
def test_ranks_that_would_run_different_programs_are_refused_on_every_rank_naming_who_and_what():
    proc = torchrun(WORKER, "disagree")
    refused = re.findall(r"rank (\d+): refused after ([\d.]+) s: (.*)", proc.stdout)
    assert sorted(r for r, _, _ in refused) == ["0", "1", "2", "3"], proc.stdout
    for _, seconds, message in refused:
        assert float(seconds) < 30
        assert "the ranks are about to run different programs: rank 2's program; rank 3's argument layouts" in message
        assert "start every rank with the same command line and configuration" in message


@pytest.mark.gloo
def test_a_rank_that_stops_is_an_error_on_the_others_within_the_timeout():
    proc = torchrun(WORKER, "stopped")
    failed = re.findall(r"rank (\d+): failed after ([\d.]+) s", proc.stdout)
    assert sorted(r for r, _ in failed) == ["0", "2", "3"], proc.stdout
    assert all(float(s) < 10 for _, s in failed), failed  # timeout 4 s
