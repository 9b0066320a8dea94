"""Your own data (`models.tokens`, `models.train --data`): documents in every supported format,
tokenized by a tokenizer made here, kept once by content, trained on. Nothing is downloaded."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
import transformers

from models import tokens, train

DOCUMENTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 4) for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """A byte-level BPE trained on the documents in about a second, saved as AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(DOCUMENTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tokenizer")
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(path)
    return path


def expected(tokenizer_dir: pathlib.Path, documents: list[str]) -> list[int]:
    """Each document encoded on its own by the tokenizer, then its end-of-sequence token."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for text in documents:
        out += [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return out


def write(directory: pathlib.Path, kind: str, documents: list[str]) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path = directory / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents)))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = directory / "docs.parquet"
        pq.write_table(pa.table({"text": documents}), path)
    elif kind == "dataset":
        import datasets

        path = directory / "saved"
        datasets.Dataset.from_dict({"text": documents}).save_to_disk(str(path))
    else:
        path = directory / "doc.txt"
        path.write_text(documents[0])
    return path


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "dataset"])
def test_each_format_is_its_documents_tokenized_with_an_end_of_sequence_after_each(tmp_path, tokenizer_dir, kind):
    documents = DOCUMENTS[:1] * 3 if kind == "text" else DOCUMENTS
    documents = ["".join(documents)] if kind == "text" else documents
    path = write(tmp_path / "data", kind, documents)
    store, vocab = tokens.store(path, tokenizer_dir, tmp_path / "cache")
    assert vocab == len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    assert store.dtype == torch.uint16 and store.tolist() == expected(tokenizer_dir, documents)


def test_a_long_text_is_tokenized_in_pieces_cut_at_newlines_as_a_whole(tmp_path, tokenizer_dir, monkeypatch):
    text = "".join(DOCUMENTS)
    path = write(tmp_path / "data", "text", [text])
    monkeypatch.setattr(tokens, "_CHUNK", 100)  # many pieces
    store, _ = tokens.store(path, tokenizer_dir, tmp_path / "cache")
    assert store.tolist() == expected(tokenizer_dir, [text])  # cut where a byte-level BPE cuts the whole too


def test_a_directory_is_its_files_in_path_order_and_the_store_is_read_back_not_made_again(
        tmp_path, tokenizer_dir, monkeypatch):
    write(tmp_path / "data" / "b", "jsonl", DOCUMENTS[30:])
    write(tmp_path / "data" / "a", "jsonl", DOCUMENTS[:30])
    (tmp_path / "data" / "notes.bin").write_bytes(b"\x00\x01")  # neither text nor records: left out
    store, _ = tokens.store(tmp_path / "data", tokenizer_dir, tmp_path / "cache")
    assert store.tolist() == expected(tokenizer_dir, DOCUMENTS)
    kept = sorted((tmp_path / "cache").iterdir())
    assert len(kept) == 1 and kept[0].stat().st_size == 2 * store.numel()
    monkeypatch.setattr(tokens, "_ids", lambda *a: pytest.fail("tokenized again"))
    again, _ = tokens.store(tmp_path / "data", tokenizer_dir, tmp_path / "cache")
    assert torch.equal(again, store)
    monkeypatch.undo()
    write(tmp_path / "data" / "b", "jsonl", DOCUMENTS[31:])  # changed data: a new store
    changed, _ = tokens.store(tmp_path / "data", tokenizer_dir, tmp_path / "cache")
    assert changed.tolist() == expected(tokenizer_dir, DOCUMENTS[:30] + DOCUMENTS[31:])
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_the_store_is_a_memory_map_read_where_a_batch_reads(tmp_path, tokenizer_dir):
    store, _ = tokens.store(write(tmp_path / "data", "jsonl", DOCUMENTS), tokenizer_dir, tmp_path / "cache")
    (kept,) = (tmp_path / "cache").iterdir()
    assert str(kept) in pathlib.Path("/proc/self/maps").read_text()  # mapped, not read into memory
    assert store[5:9].tolist() == np.fromfile(kept, dtype=np.uint16)[5:9].tolist()


@pytest.mark.parametrize("record,message", [
    ({"body": "x"}, "docs.jsonl:1 has no string field 'text' (its keys: ['body']); name the field with --text-field."),
    ({"text": 3}, "docs.jsonl:1 has no string field 'text' (its keys: ['text'])"),
])
def test_a_record_without_the_text_field_says_which_line(tmp_path, tokenizer_dir, record, message):
    (tmp_path / "docs.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace(".", r"\.")):
        tokens.store(tmp_path / "docs.jsonl", tokenizer_dir, tmp_path / "cache")


def test_no_data_there_is_refused(tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="does not exist; give a text, .jsonl or .parquet file"):
        tokens.store(tmp_path / "nowhere", tokenizer_dir, tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no text"):
        tokens.store(tmp_path / "empty", tokenizer_dir, tmp_path / "cache")


@pytest.mark.slow
def test_the_job_trains_on_your_data_and_four_ranks_train_what_one_does(tmp_path, tokenizer_dir):
    path = write(tmp_path / "data", "jsonl", DOCUMENTS * 4)
    flags = ["--data", str(path), "--tokenizer", str(tokenizer_dir), "--data-cache", str(tmp_path / "cache"),
             "--steps", "3", "--seq-len", "32", "--micro-batch", "2", "--warmup", "1", "--cp", "1"]
    one = train.main([*flags, "--dp-shard", "1", "--tp", "1", "--micro-batch", "4"])
    four = train.main([*flags, "--dp-shard", "2", "--tp", "2"])
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    assert abs(one[0] - np.log(vocab)) < 0.3  # the reference Llama, its vocabulary sized to the tokenizer's
    torch.testing.assert_close(torch.tensor(four), torch.tensor(one), rtol=1e-4, atol=1e-4)


def test_data_without_a_tokenizer_is_refused_when_parsed(capsys):
    with pytest.raises(SystemExit):
        train.parse(["--data", "corpus.jsonl"])
    assert "--data needs a tokenizer: --tokenizer DIR, or --hf-model DIR to use the model's own" in capsys.readouterr().err


@pytest.mark.parametrize("layout", [["--dp-shard", "1", "--cp", "1", "--tp", "1"],
                                    pytest.param(["--dp-shard", "2", "--cp", "2", "--tp", "1"], marks=pytest.mark.slow)],
                         ids=["one rank", "dp_shard 2 x cp 2"])
def test_epochs_stop_after_whole_passes_and_the_metrics_count_tokens_and_epochs(tmp_path, tokenizer_dir, layout):
    # an epoch is counted in sequences of the global batch: cp splits each sequence, it does not
    # make more of them (axolotl #3218 counted epochs off by cp)
    path = write(tmp_path / "data", "jsonl", DOCUMENTS)
    store, _ = tokens.store(path, tokenizer_dir, tmp_path / "cache")
    sequences, batch = (store.numel() - 1) // 32, 4
    metrics = tmp_path / "metrics.jsonl"
    losses = train.main(["--data", str(path), "--tokenizer", str(tokenizer_dir), "--data-cache", str(tmp_path / "cache"),
                         "--epochs", "2", "--seq-len", "32", "--micro-batch", str(batch // int(layout[1])),
                         "--warmup", "1", "--metrics", str(metrics), *layout])
    per_epoch = sequences // batch
    assert len(losses) == 2 * per_epoch
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["tokens_seen"] for r in records] == [(i + 1) * batch * 32 for i in range(2 * per_epoch)]
    assert records[0]["batch_tokens"] == batch * 32
    assert records[per_epoch - 1]["epoch"] == pytest.approx(per_epoch * batch / sequences) and \
        1 - batch / sequences < records[per_epoch - 1]["epoch"] <= 1
