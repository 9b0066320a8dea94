"""Block reads from safetensors files, against the tensors that were saved (written by the
safetensors library itself)."""

import itertools
import re

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


def test_the_writer_writes_what_the_safetensors_library_reads(tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "w.safetensors"
    fetched = []

    def fetch(name):
        fetched.append(name)  # each tensor fetched once, in turn
        return TENSORS[name]

    entries = [(k, tuple(v.shape), v.dtype, lambda k=k: fetch(k)) for k, v in TENSORS.items()]
    safetensors_io.write(path, entries, metadata={"format": "pt"})
    assert fetched == list(TENSORS)
    back = load_file(str(path))
    assert sorted(back) == sorted(TENSORS) and all(torch.equal(back[k], v) for k, v in TENSORS.items())


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:5], "is 5 bytes, shorter than a safetensors header's length (8 bytes)"),
    (lambda b: (10**12).to_bytes(8, "little") + b[8:], "says its header is 1000000000000 bytes, but the file has"),
    (lambda b: b[:8] + b"}" + b[9:], "has a damaged header (not JSON:"),
    (lambda b: b[:8] + b"\xff\xfe" + b[10:], "has a damaged header (not JSON:"),
    (lambda b: len(b"[1]      ").to_bytes(8, "little") + b"[1]      ", "has a header that is a JSON list"),
    (lambda b: b.replace(b'[0,16]', b'[0,99]', 1), "is not a dtype, a shape and data offsets"),
])
def test_a_damaged_file_is_refused_saying_what_is_wrong(tmp_path, damage, message):
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(4.0)}, str(good))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(ValueError, match=re.escape(message)):
        safetensors_io.SafetensorsFile(bad)
