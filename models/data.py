"""A corpus every machine has: the bytes of the Python standard library's own source files.

Tokens are bytes (vocabulary 256). The corpus is cut into sequences of `seq_len + 1` bytes; a
sample's tokens are the first `seq_len`, its targets the last `seq_len` (next-token prediction).
Sample order is a permutation from a seed, the same on every rank. A loader yields global batches,
or, given a batch sharding, each rank's block only (`nf.make_array_from_callback`).
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator

import torch

import ndfunc as nf
from models.llama import IGNORE_INDEX  # a target no loss is taken on (torch's cross_entropy default)

VOCAB_SIZE = 256


def stdlib_corpus(max_bytes: int = 4 << 20, skip: int = 0) -> torch.Tensor:
    """Up to `max_bytes` bytes (uint8) of the standard library's `.py` files, in sorted path order,
    after the first `skip` bytes (`held_out()`: bytes training never sees)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for file in sorted(root.rglob("*.py")):
        if "site-packages" in file.parts:
            continue
        data = file.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= skip + max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py files under {root}; the corpus needs the standard library's sources.")
    return torch.frombuffer(bytearray(b"".join(chunks)[skip:skip + max_bytes]), dtype=torch.uint8)


def held_out(max_bytes: int = 256 << 10) -> torch.Tensor:
    """Evaluation bytes: the standard library's sources that follow `stdlib_corpus()`'s."""
    return stdlib_corpus(max_bytes, skip=4 << 20)


class Sequences:
    """The corpus as `num_sequences` samples of `seq_len` tokens and targets, in seeded order.

    With `starts` (the index of each document's first token, ascending, from 0) the corpus is
    documents packed end to end: a sample also carries `positions`, each token's place in its own
    document (counted from 0 where the document starts, or where the sample does for a document
    an earlier sample began: attention keeps to the sample, so only the offset within it counts,
    and positions stay under `seq_len`), and `documents`, which document it belongs to, so that
    attention keeps to it (`llama.apply`); a target across a document boundary (the next
    document's first token) is -100. With `trained` (a 0/1 flag per corpus token) only the tokens
    flagged are targets, the rest -100: a chat's assistant turns.
    """

    def __init__(self, corpus: torch.Tensor, seq_len: int, seed: int = 0, vocab_size: int = VOCAB_SIZE,
                 starts: torch.Tensor | None = None, trained: torch.Tensor | None = None):
        if corpus.ndim != 1:
            raise ValueError(f"corpus must be 1-d tokens, got shape {tuple(corpus.shape)}.")
        if trained is not None and trained.shape != corpus.shape:
            raise ValueError(f"trained flags one corpus token each: {tuple(trained.shape)} for a corpus of "
                             f"{tuple(corpus.shape)}.")
        if starts is not None and (starts.ndim != 1 or not len(starts) or int(starts[0]) != 0):
            raise ValueError("starts is each document's first token, ascending, the first 0; got "
                             f"{starts[:4].tolist()}{'...' if len(starts) > 4 else ''}.")
        self.seq_len = seq_len
        self.num_sequences = (corpus.numel() - 1) // seq_len
        if self.num_sequences < 1:
            raise ValueError(f"a corpus of {corpus.numel()} tokens holds no sequence of {seq_len + 1}.")
        self.corpus = corpus  # as it is (a memory-mapped store stays on disk): rows are read as int64
        self.starts, self.trained = starts, trained
        self.vocab_size = vocab_size
        self.seed = seed
        self.order = self.epoch_order(0)

    @property
    def fields(self) -> tuple[str, ...]:
        """What a sample holds: tokens and targets, and with documents their positions and ids."""
        return ("tokens", "targets") + (("positions", "documents") if self.starts is not None else ())

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of sequences for one epoch: a function of (seed, epoch) only."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_sequences, generator=generator)

    def rows(self, sample_ids: torch.Tensor, cols: slice, order: torch.Tensor | None = None) -> dict:
        """`fields` of the given samples (positions in `order`, by default epoch 0's), positions
        `cols` only: (n, cols) int64 tensors, read from the corpus at those places alone."""
        first = (self.order if order is None else order)[sample_ids] * self.seq_len  # each sample's first token
        at = first[:, None] + torch.arange(cols.start, cols.stop)  # each token's index in the corpus
        spans = torch.cat([at, at[:, -1:] + 1], 1)  # and its target's, one column further
        ids = self.corpus[spans].to(torch.int64)  # (read once: targets are the tokens shifted by one)
        out = {"tokens": ids[:, :-1], "targets": ids[:, 1:]}
        if self.trained is not None:
            out["targets"] = out["targets"].masked_fill(self.trained[at + 1] == 0, IGNORE_INDEX)
        if self.starts is not None:  # each token's document, and its target's
            documents = torch.searchsorted(self.starts, spans, right=True) - 1
            document = documents[:, :-1]
            # from the document's start, or the sample's where the document began in an earlier one
            out["positions"] = at - torch.maximum(self.starts[document], first[:, None])
            out["documents"] = document
            out["targets"] = out["targets"].masked_fill(documents[:, 1:] != document, IGNORE_INDEX)
        return out


def batches(
    sequences: Sequences, batch_size: int, sharding=None, *, steps: int | None = None, start: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Global batches (`sequences.fields`: tokens, targets, ...) of shape (batch_size, seq_len),
    int64, in order.

    With `sharding` (a NamedSharding for (batch, seq), e.g. `ParallelConfig.batch_spec` on a mesh)
    each rank builds only its block of every batch. Without `steps`, one epoch of full batches; with
    it, `steps` batches, each new epoch in a new order. `start`: the batches before it are skipped
    (nothing is read for them), as a run resumed at step `start` needs: the stream's position is
    the step, whatever the layout.
    """
    per_epoch = sequences.num_sequences // batch_size
    if per_epoch < 1:
        raise ValueError(
            f"batch_size {batch_size} exceeds the {sequences.num_sequences} sequences available; use a "
            f"smaller batch, shorter sequences or a larger corpus."
        )
    shape = (batch_size, sequences.seq_len)
    total = per_epoch if steps is None else steps
    for step in range(start, total):
        epoch, first = divmod(step, per_epoch)
        first *= batch_size
        order = sequences.epoch_order(epoch) if epoch else sequences.order

        read: dict = {}  # a block's fields, read once for all of them

        def block(index, field: str, first=first, order=order, read=read):
            rows, cols = index
            key = (rows.start, rows.stop, cols.start, cols.stop)
            if key not in read:
                read[key] = sequences.rows(torch.arange(first + rows.start, first + rows.stop), cols, order)
            return read[key][field]

        if sharding is None:
            whole = (slice(0, batch_size), slice(0, sequences.seq_len))
            yield {field: block(whole, field) for field in sequences.fields}
        else:
            yield {field: nf.make_array_from_callback(shape, sharding, lambda index, f=field: block(index, f))
                   for field in sequences.fields}
