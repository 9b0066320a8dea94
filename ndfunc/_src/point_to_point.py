"""Blocks sent rank to rank at run time, on simulated ranks and real ones alike (no process group
is made here: a real one is torchrun's, joined by `nf.init`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ndfunc._src.torch_compat import FakeTensor, LocalTensor, local_blocks


def across_ranks(fn):
    """Mark `fn`, a function a program calls, as one that sends blocks between ranks: simulated
    ranks call it once with all their blocks (as LocalTensors), not once per rank; a program
    through torch.compile (`nf.jit(compile=True)`) calls it as it is, between compiled graphs
    (Dynamo traces no `batch_isend_irecv`)."""
    fn = torch.compiler.disable(fn)
    fn.across_ranks = True
    return fn


@across_ranks
def permute_blocks(x: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Each rank's block sent to another (`pairs`: (global rank, the global rank it sends to)); a
    rank nothing is sent to gets zeros. One block per rank moves, point to point: simulated ranks
    (a LocalTensor) hand theirs on in this process, real ones by `batch_isend_irecv`."""
    if isinstance(x, FakeTensor):
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    to, source_of = _routes(tuple(pairs))
    if isinstance(x, LocalTensor):
        blocks = local_blocks(x)
        out = {to[r]: t.clone() for r, t in blocks.items() if r in to}  # a copy: the program may write into it
        return LocalTensor({r: out[r] if r in out else torch.zeros_like(t) for r, t in blocks.items()})
    me = dist.get_rank()
    if to.get(me) == me:  # its own block stays (and nothing else comes)
        return x.clone(memory_format=torch.contiguous_format)
    source = source_of.get(me)
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    ops = ([dist.P2POp(dist.isend, x.contiguous(), to[me])] if me in to else []) + (
        [dist.P2POp(dist.irecv, out, source)] if source is not None else [])
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return out


@functools.lru_cache(maxsize=256)
def _routes(pairs: tuple) -> tuple[dict, dict]:
    """(where each rank sends, where each receives from), worked out once per permutation, not per step."""
    return dict(pairs), {d: s for s, d in pairs}


@across_ranks
def trade_blocks(x: torch.Tensor, coords: torch.Tensor, axis: int, m: int, split: int, join: int,
                 rounds: Sequence[Sequence[tuple[int, int]]]) -> torch.Tensor:
    """Two axes of sizes n and n/m trading the dims they split, in `m` rounds of `permute_blocks`.

    `x` is this rank's block: the larger axis (at `coords[axis]`, x) splits dim `join`, the smaller
    one dim `split`. After, the larger one splits `split` and the smaller `join`: this rank's block
    of `split` is an m-th of what it holds now, of `join` m times it. So the block is cut in m
    pieces along `split`, and round r sends piece (x + r) mod m (`rounds[r]`: the (global rank,
    the rank it sends to) pairs, each round a permutation); what arrives in round r is the piece of
    `join` at (x - r) mod m. Each rank sends its block once in all, as one permute would."""
    mine = torch.remainder(coords[axis], m).reshape(1)
    pieces = x.unflatten(split, (m, x.shape[split] // m))
    arrived = []
    for r, pairs in enumerate(rounds):
        piece = pieces.index_select(split, torch.remainder(mine + r, m)).squeeze(split)
        arrived.append(permute_blocks(piece.contiguous(), pairs))
    order = torch.remainder(mine - torch.arange(m, device=mine.device), m)
    return torch.stack(arrived, join).index_select(join, order).flatten(join, join + 1)
