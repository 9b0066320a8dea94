"""Your own data as tokens: documents read, tokenized once, kept as a memory-mapped token store.

`store(path, tokenizer_dir, cache_dir)` reads every document under `path` - a text file (one
document, tokenized in pieces: `_CHUNK`), a `.jsonl` file (a document per line, its `text_field`), a `.parquet` file (that column),
a dataset saved with `datasets.save_to_disk` (that column), or a directory of them (in sorted path
order) - tokenizes each with the tokenizer `transformers.AutoTokenizer` loads from `tokenizer_dir`,
and writes the ids, an end-of-sequence token after each document, to one file under `cache_dir`.
Its name is a digest of the inputs' bytes, the tokenizer's files and this format, so a later run
over the same data reads it back without tokenizing, and changed data or a changed tokenizer makes
a new one. It is written aside and renamed, so ranks writing it at once leave one whole file.

The store is a flat NumPy array on disk (uint16 where the vocabulary fits, else uint32), opened as
a copy-on-write memory map: a batch reads the pages its rows touch and nothing else, so resident
memory does not grow with the dataset. (Arrow, `datasets`' own format, would keep documents as rows
with offsets; a language model reads windows across them, for which a flat array is the direct
form, and reading it needs nothing but NumPy.) Nothing read here is a pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import tempfile
from collections.abc import Iterator

import numpy as np
import torch

FORMAT = "ndfunc tokens 1"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".text")
# a text file is tokenized in pieces of about this many characters, each cut after a newline between
# two other characters that are not spaces: there a byte-level BPE (GPT-2's, Llama 3's, Qwen's) makes
# the tokens it makes of the whole, and a fast tokenizer spreads the pieces over the cores
_CHUNK = 1 << 20
_CUT = re.compile(r"(?<=\S)\n(?=\S)")


def store(path: str | os.PathLike, tokenizer_dir: str | os.PathLike, cache_dir: str | os.PathLike,
          text_field: str = "text") -> tuple[torch.Tensor, int]:
    """(The tokens of every document under `path`, as a 1-d tensor over the memory-mapped store;
    the tokenizer's vocabulary size)."""
    files = _files(pathlib.Path(path))
    tokenizer = _tokenizer(tokenizer_dir)
    digest = hashlib.sha256(f"{FORMAT}\n{text_field}\n".encode())
    for file in files:
        digest.update(f"{file.name}\n".encode())
        digest.update(_file_digest(file))
    for file in sorted(pathlib.Path(tokenizer_dir).iterdir()):
        if file.is_file() and file.suffix in (".json", ".txt", ".model"):
            digest.update(f"{file.name}\n".encode())
            digest.update(_file_digest(file))
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    at = pathlib.Path(cache_dir) / f"{digest.hexdigest()[:40]}.{np.dtype(dtype).name}"
    if not at.exists():
        _write(at, _ids(files, tokenizer, text_field), dtype)
    if at.stat().st_size == 0:
        raise ValueError(f"{path} holds no text (no document with a {text_field!r} field, or only empty ones).")
    tokens = np.memmap(at, dtype=dtype, mode="c")  # copy-on-write: writable for torch, never written back
    return torch.from_numpy(tokens), vocab


def _files(path: pathlib.Path) -> list[pathlib.Path]:
    if not path.exists():
        raise FileNotFoundError(f"--data {path} does not exist; give a text, .jsonl or .parquet file, a dataset "
                                f"saved with datasets.save_to_disk, or a directory of them.")
    if path.is_file() or _is_saved_dataset(path):
        return [path]
    found = [p for p in sorted(path.rglob("*")) if p.is_file() and _kind(p) is not None
             and not any(_is_saved_dataset(parent) for parent in p.parents)]
    found += sorted(p for p in path.rglob("*") if p.is_dir() and _is_saved_dataset(p))
    if not found:
        raise FileNotFoundError(f"--data {path} holds no text ({', '.join(TEXT_SUFFIXES)}), .jsonl or .parquet "
                                f"file and no saved dataset.")
    return sorted(found)


def _is_saved_dataset(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def _kind(path: pathlib.Path) -> str | None:
    if _is_saved_dataset(path):
        return "dataset"
    if path.suffix == ".jsonl":
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    return "text" if path.suffix in TEXT_SUFFIXES else None


def _documents(file: pathlib.Path, text_field: str) -> Iterator[list[str]]:
    """Each document of `file` as the pieces it is tokenized in (one piece, but for a long text)."""
    kind = _kind(file)
    if kind == "text":
        text = file.read_text(encoding="utf-8")
        pieces, start = [], 0
        while start < len(text):
            cut = _CUT.search(text, start + _CHUNK)
            end = len(text) if cut is None else cut.end()
            pieces.append(text[start:end])
            start = end
        yield pieces
    elif kind == "jsonl":
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                        raise ValueError(f"{file}:{number} has no string field {text_field!r} (its keys: "
                                         f"{sorted(record) if isinstance(record, dict) else type(record).__name__}); "
                                         f"name the field with --text-field.")
                    yield [record[text_field]]
    else:
        for text in _column(file, kind, text_field):
            yield [text]


def _column(file: pathlib.Path, kind: str, text_field: str) -> Iterator[str]:
    if kind == "parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415 - only parquet needs it (datasets brings it)

        table = pq.read_table(file, columns=[text_field])
        rows = table.column(text_field).to_pylist()
    else:
        try:
            import datasets  # noqa: PLC0415 - only a saved dataset needs it
        except ImportError:
            raise ImportError(f"{file} is a dataset saved with `datasets`; reading it needs that library: pip "
                              f"install 'ndfunc[data]'.") from None
        saved = datasets.load_from_disk(str(file))
        if text_field not in saved.column_names:
            raise ValueError(f"{file} has no column {text_field!r} (its columns: {saved.column_names}); name it "
                             f"with --text-field.")
        rows = saved[text_field]
    for text in rows:
        if isinstance(text, str) and text:
            yield text


def _tokenizer(directory: str | os.PathLike):
    import transformers  # noqa: PLC0415 - only a tokenized corpus needs it

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {directory} has no end-of-sequence token, which separates documents "
                         f"in the store; give it one (its eos_token) and save it again.")
    return tokenizer


def _ids(files: list[pathlib.Path], tokenizer, text_field: str, batch: int = 1024) -> Iterator[list[int]]:
    """Each document's ids, then the end-of-sequence token, in file order (tokenized `batch`
    documents at a time: a fast tokenizer spreads a batch over the cores)."""
    eos = tokenizer.eos_token_id

    def encoded(documents: list[list[str]]) -> Iterator[list[int]]:
        flat = tokenizer([piece for pieces in documents for piece in pieces], add_special_tokens=False)["input_ids"]
        at = 0
        for pieces in documents:
            ids = [i for part in flat[at:at + len(pieces)] for i in part]
            at += len(pieces)
            if ids:
                yield [*ids, eos]

    pending: list[list[str]] = []
    for file in files:
        for pieces in _documents(file, text_field):
            pending.append(pieces)
            if len(pending) == batch:
                yield from encoded(pending)
                pending = []
    if pending:
        yield from encoded(pending)


def _write(at: pathlib.Path, documents: Iterator[list[int]], dtype) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=at.parent, suffix=".partial", delete=False) as f:
        for ids in documents:
            f.write(np.asarray(ids, dtype=dtype).tobytes())
    os.replace(f.name, at)


def _file_digest(path: pathlib.Path) -> bytes:
    if path.is_dir():  # a saved dataset: its files, by name
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{file.relative_to(path)}\n".encode())
            digest.update(_file_digest(file))
        return digest.digest()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.digest()
