"""Your own data as tokens: documents read, tokenized once, kept as a memory-mapped token store.

`store(path, tokenizer_dir, cache_dir)` reads every document under `path` - a text file (one
document, tokenized in pieces: `_CHUNK`), a `.jsonl` file (a document per line, its `text_field`),
a `.parquet` file (that column), a dataset saved with `datasets.save_to_disk` (that column), or a
directory of them (in sorted path order) - tokenizes each with the tokenizer
`transformers.AutoTokenizer` loads from `tokenizer_dir`, and writes the ids, an end-of-sequence
token after each document, to a file under `cache_dir`, and where each document starts to another.
With `chat=True` a record is a conversation (`text_field`: a list of `{"role", "content"}`
messages) rendered by the tokenizer's chat template, and a third file flags the tokens trained on:
the assistant's turns (`conversation`). The names are a digest of the inputs' bytes, the
tokenizer's files and this format, so a later run over the same data reads them back without
tokenizing, and changed data or a changed tokenizer makes new ones. Each is written aside and
renamed, the tokens last, so ranks writing them at once leave whole files.

The store is a flat NumPy array on disk (uint16 where the vocabulary fits, else uint32), opened as
a copy-on-write memory map: a batch reads the pages its rows touch and nothing else, so resident
memory does not grow with the dataset. (Arrow, `datasets`' own format, would keep documents as rows
with offsets; a language model reads windows across them, for which a flat array is the direct
form, and reading it needs nothing but NumPy.) Nothing read here is a pickle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import tempfile
from collections.abc import Iterator

import numpy as np
import torch

FORMAT = "ndfunc tokens 2"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".text")
# a text file is tokenized in pieces of about this many characters, each cut after a newline between
# two other characters that are not spaces: there a byte-level BPE (GPT-2's, Llama 3's, Qwen's) makes
# the tokens it makes of the whole, and a fast tokenizer spreads the pieces over the cores
_CHUNK = 1 << 20
_CUT = re.compile(r"(?<=\S)\n(?=\S)")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A token store opened: `tokens` (1-d, over the memory map), `starts` (each document's first
    token, int64), `trained` (chat data: 1 where a token is the assistant's, else None) and the
    tokenizer's vocabulary size."""

    tokens: torch.Tensor
    starts: torch.Tensor
    trained: torch.Tensor | None
    vocab_size: int


def store(path: str | os.PathLike, tokenizer_dir: str | os.PathLike, cache_dir: str | os.PathLike,
          text_field: str = "text", chat: bool = False) -> Corpus:
    """Every document under `path`, tokenized (once: later calls read the store back)."""
    files = _files(pathlib.Path(path))
    tokenizer = _tokenizer(tokenizer_dir, chat)
    digest = hashlib.sha256(f"{FORMAT}\n{text_field}\n{chat}\n".encode())
    for file in files:
        digest.update(f"{file.name}\n".encode())
        digest.update(_file_digest(file))
    for file in sorted(pathlib.Path(tokenizer_dir).iterdir()):
        if file.is_file() and file.suffix in (".json", ".txt", ".model", ".jinja"):
            digest.update(f"{file.name}\n".encode())
            digest.update(_file_digest(file))
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    at = pathlib.Path(cache_dir) / f"{digest.hexdigest()[:40]}.{np.dtype(dtype).name}"
    if not at.exists():
        _write(at, _ids(files, tokenizer, text_field, chat), dtype, chat)
    if at.stat().st_size == 0:
        raise ValueError(f"{path} holds no text (no document with a {text_field!r} field, or only empty ones).")
    open_map = lambda file, dtype: torch.from_numpy(np.memmap(file, dtype=dtype, mode="c"))  # noqa: E731
    # copy-on-write: writable for torch, never written back
    return Corpus(open_map(at, dtype), open_map(at.with_suffix(".starts"), np.int64),
                  open_map(at.with_suffix(".trained"), np.uint8) if chat else None, vocab)


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


def _documents(file: pathlib.Path, text_field: str, chat: bool) -> Iterator:
    """Each document of `file`: the pieces a text is tokenized in (one piece, but for a long text),
    or with `chat` a conversation's messages."""
    kind = _kind(file)
    if kind == "text":
        if chat:
            raise ValueError(f"{file} is plain text; chat data is .jsonl, .parquet or a saved dataset whose "
                             f"{text_field!r} field holds each conversation's messages.")
        text = file.read_text(encoding="utf-8")
        pieces, start = [], 0
        while start < len(text):
            cut = _CUT.search(text, start + _CHUNK)
            end = len(text) if cut is None else cut.end()
            pieces.append(text[start:end])
            start = end
        yield pieces
        return
    for where, value in _records(file, kind, text_field):
        if chat:
            yield _messages(value, where)
        elif isinstance(value, str):
            if value:
                yield [value]
        elif value is not None:  # (a missing value, parquet's null: no document)
            raise ValueError(f"{where}: {text_field!r} is {type(value).__name__}, expected a string"
                             + ("; for conversations pass --chat." if isinstance(value, list) else "."))


def _records(file: pathlib.Path, kind: str, text_field: str) -> Iterator[tuple[str, object]]:
    """(where, the record's `text_field`) for each record of a .jsonl, .parquet or saved dataset."""
    if kind == "jsonl":
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or text_field not in record:
                        raise ValueError(f"{file}:{number} has no field {text_field!r} (its keys: "
                                         f"{sorted(record) if isinstance(record, dict) else type(record).__name__}); "
                                         f"name the field with --text-field.")
                    yield f"{file}:{number}", record[text_field]
    else:
        for number, value in enumerate(_column(file, kind, text_field)):
            yield f"{file} row {number}", value


def _messages(value, where: str) -> list[dict]:
    """A conversation's messages, checked: a list of {"role": str, "content": str}."""
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise ValueError(f"{where}: a conversation is a non-empty list of {{'role': ..., 'content': ...}} messages "
                         f"with string values, got {json.dumps(value, default=repr)[:120]}.")
    return value


def _column(file: pathlib.Path, kind: str, text_field: str) -> list:
    if kind == "parquet":
        import pyarrow.parquet as pq  # noqa: PLC0415 - only parquet needs it (datasets brings it)

        names = pq.read_schema(file).names
        if text_field not in names:
            raise ValueError(f"{file} has no column {text_field!r} (its columns: {names}); name it with --text-field.")
        return pq.read_table(file, columns=[text_field]).column(text_field).to_pylist()
    try:
        import datasets  # noqa: PLC0415 - only a saved dataset needs it
    except ImportError:
        raise ImportError(f"{file} is a dataset saved with `datasets`; reading it needs that library: pip "
                          f"install 'ndfunc[data]'.") from None
    saved = datasets.load_from_disk(str(file))
    if text_field not in saved.column_names:
        raise ValueError(f"{file} has no column {text_field!r} (its columns: {saved.column_names}); name it "
                         f"with --text-field.")
    return saved[text_field]


def _tokenizer(directory: str | os.PathLike, chat: bool):
    import transformers  # noqa: PLC0415 - only a tokenized corpus needs it

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {directory} has no end-of-sequence token, which separates documents "
                         f"in the store; give it one (its eos_token) and save it again.")
    if chat and not tokenizer.chat_template:
        raise ValueError(f"the tokenizer in {directory} has no chat template to render conversations with; use "
                         f"the tokenizer of a chat model (its tokenizer_config.json or chat_template.jinja holds "
                         f"one), or set tokenizer.chat_template and save it again.")
    return tokenizer


def conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, trained) of one conversation rendered by the tokenizer's chat template, 1 in `trained`
    for each token of an assistant's reply (what follows the template's generation prompt, up to and
    with its end of turn), 0 for the rest. The ids are the whole rendering tokenized at once, as
    `apply_chat_template(tokenize=True)` gives them; a token is trained where it starts inside a
    reply's text. The replies' places come from the template's rendering of each prefix of the
    conversation, each of which must extend the one before (a template that rewrites earlier turns,
    as some drop past reasoning, is refused)."""
    def render(upto: int, prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=prompt)

    replies, done = [], ""  # (start, end) of each reply in the rendering
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = render(i, prompt=True)
            if not prompt.startswith(done):
                raise ValueError(f"the chat template's generation prompt after the first {i} messages does not "
                                 f"extend its rendering of them, so which tokens are the assistant's cannot be told; "
                                 f"use a template that only appends (most do).")
            done = prompt
        text = render(i + 1)
        if not text.startswith(done):
            prompt = " and the generation prompt" if message["role"] == "assistant" else ""
            raise ValueError(f"the chat template renders the first {i + 1} messages as text that does not extend "
                             f"its rendering of the first {i}{prompt}, so which tokens are the assistant's cannot "
                             f"be told (a template that renders a past turn unlike the last one does this, as "
                             f"Qwen3's drops past reasoning); use a template that only appends (most do).")
        if message["role"] == "assistant":
            replies.append((len(done), len(text)))
        done = text
    encoded = tokenizer(done, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([begin for begin, _ in encoded["offset_mapping"]], dtype=np.int64)
    if not replies:
        return encoded["input_ids"], [0] * len(starts)
    # the replies come in order, apart: a token is trained where the first reply ending after its
    # start also begins at or before it
    begins, ends = np.array(replies, dtype=np.int64).T
    k = np.minimum(np.searchsorted(ends, starts, side="right"), len(ends) - 1)
    return encoded["input_ids"], ((begins[k] <= starts) & (starts < ends[k])).astype(int).tolist()


def _ids(files: list[pathlib.Path], tokenizer, text_field: str, chat: bool,
         batch: int = 1024) -> Iterator[tuple[list[int], list[int] | None]]:
    """Each document's (ids, trained flags or None), in file order: a text then the
    end-of-sequence token (tokenized `batch` documents at a time: a fast tokenizer spreads a batch
    over the cores), or a conversation as `conversation` renders it."""
    eos = tokenizer.eos_token_id

    def encoded(documents: list[list[str]]) -> Iterator[tuple[list[int], None]]:
        flat = tokenizer([piece for pieces in documents for piece in pieces], add_special_tokens=False)["input_ids"]
        at = 0
        for pieces in documents:
            ids = [i for part in flat[at:at + len(pieces)] for i in part]
            at += len(pieces)
            if ids:
                yield [*ids, eos], None

    pending: list[list[str]] = []
    for file in files:
        for document in _documents(file, text_field, chat):
            if chat:
                yield conversation(tokenizer, document)
                continue
            pending.append(document)
            if len(pending) == batch:
                yield from encoded(pending)
                pending = []
    if pending:
        yield from encoded(pending)


def _write(at: pathlib.Path, documents: Iterator[tuple[list[int], list[int] | None]], dtype, chat: bool) -> None:
    """The tokens at `at`, each document's first token's index beside it (`.starts`), and with
    `chat` the trained flags (`.trained`); each written aside and renamed, the tokens last."""
    at.parent.mkdir(parents=True, exist_ok=True)
    parts = {suffix: tempfile.NamedTemporaryFile(dir=at.parent, suffix=".partial", delete=False)
             for suffix in (at.suffix, ".starts", ".trained")[:3 if chat else 2]}
    try:
        count = 0
        for ids, trained in documents:
            parts[".starts"].write(np.int64(count).tobytes())
            parts[at.suffix].write(np.asarray(ids, dtype=dtype).tobytes())
            if chat:
                parts[".trained"].write(np.asarray(trained, dtype=np.uint8).tobytes())
            count += len(ids)
    except BaseException:
        for f in parts.values():
            f.close()
            os.unlink(f.name)
        raise
    for f in parts.values():
        f.close()
    for suffix in [s for s in parts if s != at.suffix] + [at.suffix]:
        os.replace(parts[suffix].name, at.with_suffix(suffix))


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
