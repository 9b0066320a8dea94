"""Packed documents do not see each other: each document's losses in a packed batch, on
`dp_shard x cp` with ring attention (in order and zigzag), equal that document run alone on one
device; and the loader packs a corpus of documents into the fields the model reads."""

from __future__ import annotations

import optree
import pytest
import torch

import ndfunc as nf
from models import data, llama
from ndfunc.sharding import P

CFG = llama.LlamaConfig.tiny()
EOS = 0
L = 32  # tokens a row; zigzag over cp 2 cuts it in 4 chunks


def documents(lengths, seed=0) -> list[torch.Tensor]:
    """Documents of random bytes, each ending in EOS."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(1, 256, (n - 1,), generator=g), torch.tensor([EOS])]) for n in lengths]


def alone(params, document: torch.Tensor) -> torch.Tensor:
    """The reference: one document's next-token losses, by itself, on one device, no mask but
    torch's causal one."""
    tokens = document[None, :-1]
    return llama.token_losses(params, {"tokens": tokens, "targets": document[None, 1:]}, CFG)[0]


def packed(docs: list[torch.Tensor], rows: int) -> dict:
    """The documents packed end to end in `rows` rows of L (the corpus cut as the loader cuts it)."""
    corpus = torch.cat(docs)
    starts = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0)[:-1].tolist()])
    sequences = data.Sequences(corpus, L, starts=starts)
    sequences.order = torch.arange(sequences.num_sequences)  # in corpus order, to find each document again
    return next(data.batches(sequences, rows, steps=1))


# whole documents in each row, one of them ending exactly at the row's end, the next row starting
# with the next document (the last token of a row has the next row's first as its target)
LENGTHS = [5, 11, 16, 9, 7, 3, 13]  # rows of 32: 5+11+16 | 9+7+3+13 (and one token past: the last target)


@pytest.mark.parametrize("load_balance", [None, "zigzag"])
def test_each_packed_documents_losses_on_dp_shard_x_cp_with_ring_attention_equal_it_alone(load_balance):
    params = llama.init(CFG, nf.random.key(0))
    docs = documents(LENGTHS + [2])
    batch = packed(docs, rows=2)
    assert batch["positions"][0, :6].tolist() == [0, 1, 2, 3, 4, 0]  # positions restart per document
    with nf.simulate(4):
        mesh = nf.make_mesh(dp_shard=2, cp=2)
        laid = nf.zigzag(batch, 2) if load_balance else batch
        step = nf.jit(lambda p, b: llama.token_losses(p, b, CFG), mesh=mesh,
                      in_shardings=(P(), P("dp_shard", "cp")), out_shardings=P("dp_shard", "cp"),
                      transforms=[nf.ring_attention("cp", load_balance=load_balance)])
        lowered = step.lower(params, laid)
        assert "ppermute" in lowered.as_text()  # keys and values went round the ring, not gathered
        losses = nf.device_get(step(params, laid))
    if load_balance:
        losses = nf.unzigzag(losses, 2)
    flat, at = losses.flatten(), 0
    for i, doc in enumerate(docs[:-1]):  # (the last is only the final target)
        got = flat[at:at + len(doc) - 1]  # its tokens but the EOS, whose target is the next document's
        torch.testing.assert_close(got, alone(params, doc), rtol=1e-5, atol=1e-5, msg=f"document {i}")
        assert flat[at + len(doc) - 1] == 0  # the target across the boundary is not trained
        at += len(doc)


def test_without_document_ids_packed_documents_leak_into_each_other():
    """The control: positions restarting alone do not keep documents apart (a later document sees
    the earlier ones' tokens at its own positions), so the losses differ."""
    params = llama.init(CFG, nf.random.key(0))
    docs = documents(LENGTHS + [2])
    batch = packed(docs, rows=2)
    del batch["documents"]
    losses = llama.token_losses(params, batch, CFG).flatten()
    second = losses[len(docs[0]):len(docs[0]) + len(docs[1]) - 1]
    assert not torch.allclose(second, alone(params, docs[1]), rtol=1e-3, atol=1e-3)


def test_a_document_cut_by_a_row_end_goes_on_in_the_next_row_counted_from_its_start():
    # (attention keeps to a row, so only offsets within it matter to rotary embeddings; positions
    # stay under the row's length, as a learned position table needs)
    docs = documents([20, 30, 40])
    batch = packed(docs, rows=2)
    second = batch["positions"][1]
    assert second[:18].tolist() == list(range(18))  # document 1 (tokens 20..49) goes on from 0
    assert second[18:].tolist() == list(range(14))
    assert batch["documents"][1, :18].eq(1).all() and batch["documents"][1, 18:].eq(2).all()
    assert batch["targets"][0, 19] == data.IGNORE_INDEX  # document 0's EOS: its target starts document 1
    assert (batch["targets"] == data.IGNORE_INDEX).sum() == 2


def test_trained_flags_keep_only_the_flagged_targets():
    corpus = torch.arange(1, 41)
    trained = (torch.arange(40) % 3 == 0).to(torch.uint8)
    sequences = data.Sequences(corpus, 8, trained=trained)
    sequences.order = torch.arange(sequences.num_sequences)
    batch = next(data.batches(sequences, 2, steps=1))
    kept = batch["targets"] != data.IGNORE_INDEX
    assert torch.equal(kept.flatten(), trained[1:17].bool())
    assert torch.equal(batch["targets"][kept], corpus[1:17][trained[1:17].bool()])


def test_documents_without_positions_are_refused():
    params = llama.init(CFG, nf.random.key(0))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="documents need positions"):
        llama.apply(params, tokens, CFG, documents_BL=tokens)


@pytest.mark.parametrize("family,attn,load_balance", [("llama", "sdpa", "zigzag"), ("qwen2", "sdpa", None),
                                                     ("llama", "eager", "zigzag")])
def test_a_hugging_face_models_packed_documents_on_dp_shard_x_cp_equal_each_alone_in_eager(family, attn, load_balance):
    """The job's `--hf-model` loss (`train.hf_model`) on a packed batch: transformers is given the
    document mask (zigzag's order hides where documents start from transformers' own detection of
    packing, which reads restarts of positions in order), and each document's losses equal the
    eager model's on it alone. SDPA attention runs as a ring; eager attention (matmuls and a
    softmax, no ring) adds its mask to the scores, so it is given the mask as 0 and -inf's stand-in."""
    transformers = pytest.importorskip("transformers")
    from models import train

    config_cls, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                       "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    torch.manual_seed(0)
    model = cls(config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                           attn_implementation=attn)).eval()
    docs = documents(LENGTHS + [2])
    batch = packed(docs, rows=2)
    with nf.simulate(4):
        mesh = nf.make_mesh(dp_shard=2, cp=2)
        _, params, _, _, token_losses, _ = train.hf_model(model, mesh)
        step = nf.jit(token_losses, mesh=mesh, in_shardings=(P(), P("dp_shard", "cp")),
                      out_shardings=P("dp_shard", "cp"),
                      transforms=[nf.ring_attention("cp", load_balance=load_balance)] if attn == "sdpa" else [])
        losses = nf.device_get(step(params, nf.zigzag(batch, 2) if load_balance else batch))
    losses = (nf.unzigzag(losses, 2) if load_balance else losses).flatten()
    at = 0
    for i, doc in enumerate(docs[:-1]):
        with torch.no_grad():
            logits = model(doc[None, :-1]).logits[0]
        expected = torch.nn.functional.cross_entropy(logits, doc[1:], reduction="none")
        torch.testing.assert_close(losses[at:at + len(doc) - 1], expected, rtol=1e-5, atol=1e-5, msg=f"document {i}")
        at += len(doc)


def test_the_jobs_token_mean_of_a_batch_with_no_trained_target_is_zero_with_no_gradient():
    # (chat data: a batch may hold only prompts; a plain mean is 0 / 0 and would poison the parameters)
    from models import train

    params = llama.init(CFG, nf.random.key(0))
    batch = packed(documents(LENGTHS + [2]), rows=2)
    untrained = dict(batch, targets=torch.full_like(batch["targets"], data.IGNORE_INDEX))
    loss = train.token_mean(lambda p, b: llama.token_losses(p, b, CFG))
    value, grads = nf.value_and_grad(loss)(params, untrained)
    assert value == 0 and all(g.abs().max() == 0 for g in optree.tree_leaves(grads))
    torch.testing.assert_close(loss(params, batch), llama.loss(params, batch, CFG))  # else the mean
