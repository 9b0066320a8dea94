"""The README's main job, run in-process: it checks its own sharded build against a
single-device build and exits non-zero if they differ."""

import pytest

from models import demo


@pytest.mark.parametrize("argv", [[], ["--ranks", "16", "--dp-replicate", "2", "--dp-shard", "2"], ["--ranks", "4", "--cp", "1"]])
def test_demo_runs_and_matches_single_device(argv, capsys):
    demo.main(argv)
    out = capsys.readouterr().out
    assert "gathered parameters equal the single-device build: True" in out
    assert "mesh {'dp_replicate'" in out


def test_block_values_are_mesh_independent():
    import torch

    full = demo.block_values(7, (6, 4), (slice(0, 6), slice(0, 4)))
    assert torch.equal(demo.block_values(7, (6, 4), (slice(2, 4), slice(1, 3))), full[2:4, 1:3])
    assert full.std() > 0.005 and abs(full.mean()) < 0.01
