import pytest
import torch

import ndfunc as nf
from models import data
from ndfunc.sharding import NamedSharding

CORPUS = data.stdlib_corpus(1 << 18)


def test_corpus_is_the_standard_library_source():
    import pathlib
    import sysconfig

    first = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[0].read_bytes()
    assert bytes(CORPUS[: len(first)].tolist()) == first
    assert CORPUS.numel() == 1 << 18 and torch.equal(data.stdlib_corpus(1 << 18), CORPUS)


def test_sequences_are_next_token_pairs_in_seeded_order():
    seqs = data.Sequences(CORPUS, seq_len=32, seed=3)
    batch = next(data.batches(seqs, batch_size=4))
    assert batch["tokens"].shape == (4, 32) and batch["tokens"].dtype == torch.int64
    corpus = CORPUS.to(torch.int64)
    for row in range(4):
        start = int(seqs.order[row]) * 32
        assert torch.equal(batch["tokens"][row], corpus[start:start + 32])
        assert torch.equal(batch["targets"][row], corpus[start + 1:start + 33])
    assert torch.equal(data.Sequences(CORPUS, 32, seed=3).order, seqs.order)
    assert not torch.equal(data.Sequences(CORPUS, 32, seed=4).order, seqs.order)


def test_an_epoch_takes_each_sequence_once_in_permuted_order():
    seqs = data.Sequences(CORPUS[:1000], seq_len=9, seed=0)  # 111 sequences: 13 full batches of 8
    rows = torch.cat([b["tokens"] for b in data.batches(seqs, 8)])
    assert sorted(seqs.order.tolist()) == list(range(111))
    assert torch.equal(rows, CORPUS[:999].to(torch.int64).view(111, 9)[seqs.order[:104]])


@pytest.mark.parametrize("sizes", [dict(dp_shard_size=2, cp_size=2, tp_size=2), dict(dp_replicate_size=2, dp_shard_size=4)])
def test_sharded_batches_give_each_rank_its_block(sizes):
    seqs = data.Sequences(CORPUS, seq_len=16, seed=0)
    expected = list(data.batches(seqs, batch_size=8, steps=3))
    config = nf.ParallelConfig(**sizes)
    with nf.simulate(8):
        sharding = NamedSharding(config.build_mesh(), config.batch_spec)
        got = list(data.batches(seqs, batch_size=8, sharding=sharding, steps=3))
        assert len(got) == 3
        for g, e in zip(got, expected):
            for field in ("tokens", "targets"):
                blocks = g[field].to_local()._local_tensors
                for rank, index in enumerate(sharding.shard_indices((8, 16))):
                    assert torch.equal(blocks[rank], e[field][index]), (field, rank)


def test_errors():
    with pytest.raises(ValueError, match="batch_size 64 exceeds the 15 sequences available; use a smaller batch"):
        next(data.batches(data.Sequences(CORPUS[:250], 16), 64))
    with pytest.raises(ValueError, match="a corpus of 10 tokens holds no sequence of 17"):
        data.Sequences(CORPUS[:10], 16)


def test_steps_past_an_epoch_start_a_new_order():
    seqs = data.Sequences(CORPUS[:1000], seq_len=9, seed=0)  # 13 full batches of 8 an epoch
    got = list(data.batches(seqs, 8, steps=20))
    assert len(got) == 20
    assert torch.equal(got[0]["tokens"], next(data.batches(seqs, 8))["tokens"])
    second = seqs.epoch_order(1)
    assert not torch.equal(second, seqs.order)
    assert torch.equal(got[13]["tokens"], CORPUS[:999].to(torch.int64).view(111, 9)[second[:8]])
