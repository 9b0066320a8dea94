"""The README's main job, run in-process: it checks its own sharded build against a
single-device build and exits non-zero if they differ."""

import pytest

from models import demo


@pytest.mark.slow
@pytest.mark.parametrize("argv", [[], ["--ranks", "16", "--dp-replicate", "2", "--dp-shard", "2"], ["--ranks", "4", "--cp", "1"]])
def test_demo_runs_and_matches_single_device(argv, capsys):
    demo.main(argv)
    out = capsys.readouterr().out
    assert "gathered parameters equal the single-device build: True" in out
    assert "mesh {'dp_replicate'" in out
