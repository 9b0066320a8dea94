"""Block reads from safetensors files, against the tensors that were saved (written by the
safetensors library itself)."""

import itertools

import pytest
import torch
from safetensors.torch import save_file

from models import safetensors_io

TENSORS = {
    "matrix": torch.randn(7, 5, 3, generator=torch.Generator().manual_seed(0)),
    "ints": torch.arange(10, dtype=torch.int64),
    "bf16": torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    "scalar": torch.tensor(3.0),
    "empty": torch.zeros(0, 3),
}


@pytest.fixture(scope="module")
def file(tmp_path_factory):
    path = tmp_path_factory.mktemp("st") / "m.safetensors"
    save_file(TENSORS, str(path))
    return safetensors_io.SafetensorsFile(path)


@pytest.mark.parametrize("band_bytes", [16, 1 << 20], ids=["a-row-a-band", "one-band"])
def test_every_block_equals_the_slice(file, band_bytes, monkeypatch):
    monkeypatch.setattr(safetensors_io, "BAND_BYTES", band_bytes)
    for name, t in TENSORS.items():
        assert file.shape(name) == tuple(t.shape) and file.dtype(name) == t.dtype
        if t.ndim == 0:
            assert torch.equal(file.read(name), t)
            continue
        for index in itertools.product(*[[slice(0, n), slice(1, max(1, n - 1)), slice(n // 2, n)] for n in t.shape]):
            assert torch.equal(file.read(name, index), t[index]), (name, index)
        assert torch.equal(file.read(name), t)


def test_errors(file):
    with pytest.raises(KeyError, match="has no tensor 'nope'"):
        file.read("nope")
    with pytest.raises(ValueError, match=r"has 3 entries but ints has rank 1"):
        file.read("ints", (slice(0, 1),) * 3)
    with pytest.raises(ValueError, match="has a step; blocks are contiguous slices"):
        file.read("ints", (slice(0, 10, 2),))
