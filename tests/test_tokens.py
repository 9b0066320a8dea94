"""Your own data (`models.tokens`, `models.train --data`): documents in every supported format,
tokenized by a tokenizer made here, kept once by content, trained on. Nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest
import torch
import transformers

import ndfunc as nf
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
    corpus = tokens.store(path, tokenizer_dir, tmp_path / "cache")
    assert corpus.vocab_size == len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    assert corpus.tokens.dtype == torch.uint16 and corpus.tokens.tolist() == expected(tokenizer_dir, documents)
    lengths = [len(expected(tokenizer_dir, [d])) for d in documents]
    assert corpus.starts.tolist() == [sum(lengths[:i]) for i in range(len(documents))]  # where each begins


def test_a_long_text_is_tokenized_in_pieces_cut_at_newlines_as_a_whole(tmp_path, tokenizer_dir, monkeypatch):
    text = "".join(DOCUMENTS)
    path = write(tmp_path / "data", "text", [text])
    monkeypatch.setattr(tokens, "_CHUNK", 100)  # many pieces
    store = tokens.store(path, tokenizer_dir, tmp_path / "cache").tokens
    assert store.tolist() == expected(tokenizer_dir, [text])  # cut where a byte-level BPE cuts the whole too


def test_a_directory_is_its_files_in_path_order_and_the_store_is_read_back_not_made_again(
        tmp_path, tokenizer_dir, monkeypatch):
    write(tmp_path / "data" / "b", "jsonl", DOCUMENTS[30:])
    write(tmp_path / "data" / "a", "jsonl", DOCUMENTS[:30])
    (tmp_path / "data" / "notes.bin").write_bytes(b"\x00\x01")  # neither text nor records: left out
    store = tokens.store(tmp_path / "data", tokenizer_dir, tmp_path / "cache").tokens
    assert store.tolist() == expected(tokenizer_dir, DOCUMENTS)
    kept = sorted((tmp_path / "cache").iterdir())  # the tokens and where each document starts
    assert [p.suffix for p in kept] == [".starts", ".uint16"] and kept[1].stat().st_size == 2 * store.numel()
    monkeypatch.setattr(tokens, "_ids", lambda *a: pytest.fail("tokenized again"))
    again = tokens.store(tmp_path / "data", tokenizer_dir, tmp_path / "cache").tokens
    assert torch.equal(again, store)
    monkeypatch.undo()
    write(tmp_path / "data" / "b", "jsonl", DOCUMENTS[31:])  # changed data: a new store
    changed = tokens.store(tmp_path / "data", tokenizer_dir, tmp_path / "cache").tokens
    assert changed.tolist() == expected(tokenizer_dir, DOCUMENTS[:30] + DOCUMENTS[31:])
    assert len(list((tmp_path / "cache").iterdir())) == 4


def test_the_store_is_a_memory_map_read_where_a_batch_reads(tmp_path, tokenizer_dir):
    store = tokens.store(write(tmp_path / "data", "jsonl", DOCUMENTS), tokenizer_dir, tmp_path / "cache").tokens
    (kept,) = (tmp_path / "cache").glob("*.uint16")
    assert str(kept) in pathlib.Path("/proc/self/maps").read_text()  # mapped, not read into memory
    assert store[5:9].tolist() == np.fromfile(kept, dtype=np.uint16)[5:9].tolist()


@pytest.mark.parametrize("record,message", [
    ({"body": "x"}, "docs.jsonl:1 has no field 'text' (its keys: ['body']); name the field with --text-field."),
    ({"text": 3}, "docs.jsonl:1: 'text' is int, expected a string."),
    ({"text": [{"role": "user", "content": "hi"}]}, "docs.jsonl:1: 'text' is list, expected a string; for "
                                                    "conversations pass --chat."),
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


@pytest.mark.parametrize("flags,message", [
    (["--chat"], "--chat is about --data; give the data too"),
    (["--eval-data", "held.jsonl", "--data", "d.jsonl", "--tokenizer", "t"],
     "--eval-data is evaluated every --eval-every steps; give --eval-every N too"),
])
def test_chat_and_eval_flags_without_what_they_need_are_refused_when_parsed(capsys, flags, message):
    with pytest.raises(SystemExit):
        train.parse(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("layout", [["--dp-shard", "1", "--cp", "1", "--tp", "1"],
                                    pytest.param(["--dp-shard", "2", "--cp", "2", "--tp", "1"], marks=pytest.mark.slow)],
                         ids=["one rank", "dp_shard 2 x cp 2"])
def test_epochs_stop_after_whole_passes_and_the_metrics_count_tokens_and_epochs(tmp_path, tokenizer_dir, layout):
    # an epoch is counted in sequences of the global batch: cp splits each sequence, it does not
    # make more of them (axolotl #3218 counted epochs off by cp)
    path = write(tmp_path / "data", "jsonl", DOCUMENTS)
    store = tokens.store(path, tokenizer_dir, tmp_path / "cache").tokens
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


# --- chat data: conversations rendered by the tokenizer's template, trained on the assistant's turns

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Conversations of one to three exchanges, some with a system turn, replies of varied length:
    sequences then hold different numbers of the assistant's tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for j in range(1 + i % 3):
            words = int(torch.randint(1, 12, (), generator=g))
            turns += [{"role": "user", "content": f"what is f{i + j}(x)?"},
                      {"role": "assistant", "content": " ".join(f"return x * {i}" for _ in range(words))}]
        out.append(turns)
    return out


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """The documents' BPE with ChatML's turn markers and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(DOCUMENTS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("chat_tokenizer")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    return path


def write_chats(path: pathlib.Path, chats: list[list[dict]]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return path


def test_a_conversation_is_its_template_rendering_trained_on_the_assistants_replies_only(tmp_path, chat_tokenizer_dir):
    chats = conversations(6)
    corpus = tokens.store(write_chats(tmp_path / "chat.jsonl", chats), chat_tokenizer_dir, tmp_path / "cache",
                          "messages", chat=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    bounds = [*corpus.starts.tolist(), corpus.tokens.numel()]
    for i, chat in enumerate(chats):
        ids, flags = corpus.tokens[bounds[i]:bounds[i + 1]], corpus.trained[bounds[i]:bounds[i + 1]].bool()
        rendered = tokenizer.apply_chat_template(chat, tokenize=False)
        assert tokenizer.decode(ids) == rendered  # the template's text, nothing added or lost
        replies = "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant")
        assert tokenizer.decode(ids[flags]) == replies  # each reply and its end of turn, no role header


MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def test_a_sentencepiece_style_tokenizers_conversation_is_tokenized_as_its_template_tokenizes_it(tmp_path):
    # a Metaspace tokenizer (Llama 2's, Mistral's) marks the start of each text it tokenizes: the
    # rendering is tokenized whole, as apply_chat_template(tokenize=True) does, never piece by piece
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    bpe.decoder = decoders.Metaspace(prepend_scheme="always")
    bpe.train_from_iterator(DOCUMENTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "[INST]",
                                                                                          "[/INST]"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = MISTRAL
    for chat in conversations(6):
        ids, trained = tokens.conversation(tokenizer, chat)
        assert ids == tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
        replies = [m["content"] for m in chat if m["role"] == "assistant"]
        got = tokenizer.decode([i for i, t in zip(ids, trained) if t])
        assert got.replace(" ", "") == "".join(r + "</s>" for r in replies).replace(" ", "")


def test_chat_data_needs_a_template_and_conversations(tmp_path, tokenizer_dir, chat_tokenizer_dir):
    path = write_chats(tmp_path / "chat.jsonl", conversations(2))
    with pytest.raises(ValueError, match="has no chat template to render conversations with; use the tokenizer "
                                         "of a chat model"):
        tokens.store(path, tokenizer_dir, tmp_path / "cache", "messages", chat=True)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "text": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a conversation is a non-empty list of \{'role': ..., "
                                         r"'content': ...\} messages with string values"):
        tokens.store(tmp_path / "bad.jsonl", chat_tokenizer_dir, tmp_path / "cache", "messages", chat=True)
    assert not list((tmp_path / "cache").glob("*.partial"))  # nothing half-written left behind


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, chat_tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{{ messages | length }}{% endfor %}"
    with pytest.raises(ValueError, match="does not extend its rendering of the first 1"):
        tokens.conversation(tokenizer, conversations(1)[0])


@pytest.mark.slow
def test_the_sft_loss_is_the_mean_over_the_global_batchs_trained_tokens_as_on_one_device(tmp_path, chat_tokenizer_dir):
    # rows hold different numbers of trained tokens, so a mean of per-rank or per-micro-batch means
    # would differ from the global mean one device takes
    from models import data, llama

    path = write_chats(tmp_path / "chat.jsonl", conversations(40))
    flags = ["--data", str(path), "--tokenizer", str(chat_tokenizer_dir), "--chat", "--data-cache",
             str(tmp_path / "cache"), "--steps", "2", "--seq-len", "32", "--warmup", "1", "--tp", "1"]
    one = train.main([*flags, "--dp-shard", "1", "--cp", "1", "--micro-batch", "8"])
    four = train.main([*flags, "--dp-shard", "2", "--cp", "2", "--micro-batch", "2", "--grad-accum", "2"])
    np.testing.assert_allclose(four, one, rtol=2e-5)
    # the first step's loss, from the untrained model on one device in plain torch
    corpus = tokens.store(path, chat_tokenizer_dir, tmp_path / "cache", "messages", chat=True)
    sequences = train._sequences(corpus, train.parse(flags))
    batch = next(data.batches(sequences, 8, steps=1))
    trained = (batch["targets"] != data.IGNORE_INDEX).sum(1)
    assert len(set(trained.tolist())) > 1 and (batch["targets"] == data.IGNORE_INDEX).any()
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), vocab_size=320)
    expected = llama.loss(llama.init(cfg, nf.random.key(0)), batch, cfg)
    assert one[0] == pytest.approx(float(expected), rel=1e-5)


def test_eval_data_short_of_a_batch_is_refused_before_any_step(tmp_path, tokenizer_dir):
    # the evaluation batches are read lazily: the shortfall used to surface after --eval-every steps
    held = write(tmp_path / "eval", "jsonl", DOCUMENTS[:4])
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(SystemExit, match=r"the evaluation data holds \d+ sequences of 32 tokens, fewer than a batch "
                                         r"of 8; pass more with --eval-data, use a smaller batch or shorter sequences, "
                                         r"or --eval-every 0 for no evaluation\."):
        train.main(["--data", str(write(tmp_path / "train", "jsonl", DOCUMENTS)), "--eval-data", str(held),
                    "--tokenizer", str(tokenizer_dir), "--data-cache", str(tmp_path / "cache"), "--steps", "3",
                    "--eval-every", "2", "--seq-len", "32", "--micro-batch", "4", "--metrics", str(metrics)])
    assert not metrics.exists()  # no step ran


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--dp-shard", "2", "--cp", "2", "--tp", "1", "--ring-attention", "--micro-batch", "1"],
                                    ["--dp-shard", "1", "--cp", "2", "--tp", "2", "--micro-batch", "2"]],
                         ids=["dp_shard 2 x cp 2, ring", "cp 2 x tp 2"])
def test_the_eval_loss_on_eval_data_is_one_devices_on_every_layout(tmp_path, tokenizer_dir, layout):
    # under cp the eval loss was NaN or multiplied by cp elsewhere (axolotl #3026, transformers #48167)
    from models import data, llama

    held = write(tmp_path / "eval", "jsonl", DOCUMENTS[::-1][:24])
    flags = ["--data", str(write(tmp_path / "train", "jsonl", DOCUMENTS)), "--eval-data", str(held),
             "--tokenizer", str(tokenizer_dir), "--data-cache", str(tmp_path / "cache"), "--steps", "1",
             "--eval-every", "1", "--seq-len", "32", "--warmup", "1", *layout]
    train.main([*flags, "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ck")])
    (record,) = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    # the same evaluation on one device: the trained parameters, every whole batch of the eval data
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), vocab_size=320)
    params = llama.init(cfg, nf.random.key(0))
    opt = nf.optim.chain(nf.optim.clip_by_global_norm(1.0), nf.optim.adamw(1e-3))
    like = {"params": params, "opt": opt.init(params), "step": 0, "sequences": 0, "key": nf.random.key(0)}
    params = nf.checkpoint.load(tmp_path / "ck" / "step_1", like)["params"]
    sequences = train._sequences(tokens.store(held, tokenizer_dir, tmp_path / "cache"), train.parse(flags))
    total, count = 0.0, 0
    for batch in data.batches(sequences, 2):
        total += float(llama.token_losses(params, batch, cfg).sum())
        count += int((batch["targets"] != data.IGNORE_INDEX).sum())
    assert record["eval_loss"] == pytest.approx(total / count, rel=1e-5)


@pytest.mark.slow
def test_a_hugging_face_model_fine_tunes_on_chat_data_with_its_own_tokenizer(tmp_path, chat_tokenizer_dir):
    # as a user runs it: the model's directory holds its tokenizer; 4 ranks (dp_shard 2 x cp 2, ring
    # attention), accumulation; the first loss is the eager model's on each packed piece alone
    from models import data

    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir).save_pretrained(model_dir)
    path = write_chats(tmp_path / "chat.jsonl", conversations(40))
    flags = ["--hf-model", str(model_dir), "--data", str(path), "--chat", "--data-cache", str(tmp_path / "cache"),
             "--steps", "2", "--seq-len", "32", "--warmup", "1", "--tp", "1"]
    losses = train.main([*flags, "--dp-shard", "2", "--cp", "2", "--ring-attention", "--micro-batch", "1",
                         "--grad-accum", "2"])
    sequences = train._sequences(tokens.store(path, model_dir, tmp_path / "cache", "messages", chat=True),
                                 train.parse(flags))
    batch = next(data.batches(sequences, 4, steps=1))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    total, count = 0.0, 0
    for row in range(4):
        for document in batch["documents"][row].unique():
            piece = batch["documents"][row] == document
            with torch.no_grad():
                logits = model(batch["tokens"][row][piece][None], position_ids=batch["positions"][row][piece][None]).logits
            targets = batch["targets"][row][piece]
            total += float(torch.nn.functional.cross_entropy(logits[0], targets, reduction="sum"))
            count += int((targets != data.IGNORE_INDEX).sum())
    assert losses[0] == pytest.approx(total / count, rel=1e-5)


def test_a_run_resumed_on_other_data_is_refused(tmp_path, tokenizer_dir):
    # the resumed position is a count of sequences: with the evaluation split changed, the same
    # count would point at other batches
    path = write(tmp_path / "data", "jsonl", DOCUMENTS * 2)
    flags = ["--data", str(path), "--tokenizer", str(tokenizer_dir), "--data-cache", str(tmp_path / "cache"),
             "--seq-len", "32", "--micro-batch", "2", "--warmup", "1", "--dp-shard", "1", "--cp", "1", "--tp", "1",
             "--checkpoint-dir", str(tmp_path / "run")]
    train.main([*flags, "--steps", "1"])
    with pytest.raises(SystemExit, match=r"--resume: the run in .* trained on other data than this run's \(tokens "
                                         r"\d+ -> \d+, sequences \d+ -> \d+"):
        train.main([*flags, "--steps", "2", "--resume", "--eval-every", "1"])
    assert len(train.main([*flags, "--steps", "2", "--resume"])) == 1  # the same data resumes
