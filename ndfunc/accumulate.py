"""`nf.accumulate`: gradient accumulation over micro-batches, one program however many there are.

`nf.accumulate(nf.value_and_grad(loss), k)(params, batch)` splits the batch into `k`
micro-batches along dim 0 and returns the mean loss and mean gradients, equal (up to the order of
sums) to the big batch's when every micro-batch weighs the same (a mean loss over equally many
targets). One program adds a micro-batch's loss and gradients into running sums, which it
receives donated and updates where they lie; it is traced, partitioned and lowered once and run
`k` times, so the program does not grow with `k` and only one micro-batch's activations are alive.
Each run reduces its gradients to the parameters' layouts (an FSDP gradient is reduce-scattered
per micro-batch, as FSDP does by default).

A sharded batch (DTensor) is cut per rank: each rank's micro-batch `i` is rows `i*b .. (i+1)*b`
of its own block, so no data moves; the micro-batches are then other samples than a cut of the
global batch would give, which the mean does not notice.
"""

from __future__ import annotations

from collections.abc import Callable

import optree
import torch
from torch.distributed.tensor import DTensor

from ndfunc.jit import jit
from ndfunc.sharding import P
from ndfunc.transfer import sharding_of


def accumulate(value_and_grad_fn: Callable, num_micro_batches: int, transforms=()) -> Callable:
    """`fn(params, batch) -> (loss, grads)` over `num_micro_batches` micro-batches of `batch`,
    returning the means (see the module's text). `value_and_grad_fn` is what `nf.value_and_grad`
    returns for a mean loss; `transforms` go to the micro-batch program's `nf.jit`."""
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f"nf.accumulate: num_micro_batches must be an int >= 1, got {num_micro_batches!r}.")
    k = num_micro_batches

    def add(params, sums, batch):
        loss, grads = value_and_grad_fn(params, batch)
        return sums[0] + loss, optree.tree_map(torch.add, sums[1], grads)

    def zeros(params):
        return torch.zeros(()), optree.tree_map(torch.zeros_like, params)

    def mean(sums):
        return sums[0] / k, optree.tree_map(lambda g: g / k, sums[1])

    programs: dict = {}

    def compiled(params, batch):
        """(zeros, add, mean): the programs for arguments laid out as these, made once. The sums
        are laid out as the parameters (a plain parameter: replicated), so each run hands the
        next sums in the layout it takes."""
        key = tuple((tuple(x.shape), x.dtype, getattr(x, "placements", None))
                    for x in optree.tree_leaves((params, batch)))
        if key not in programs:
            found = [s for s in map(sharding_of, optree.tree_leaves((params, batch))) if s is not None]
            mesh = found[0].mesh if found else None
            spec = P() if mesh is not None else None
            shardings = optree.tree_map(lambda p: sharding_of(p) or spec, params)
            sums_sharding = (spec, shardings)
            programs[key] = (jit(zeros, mesh=mesh, out_shardings=sums_sharding),
                             jit(add, mesh=mesh, out_shardings=sums_sharding, donate_argnums=(1,),
                                 transforms=list(transforms)),
                             jit(mean, mesh=mesh, out_shardings=sums_sharding, donate_argnums=(0,)))
        return programs[key]

    def accumulated(params, batch):
        make_zeros, add_one, take_mean = compiled(params, batch)
        sums = make_zeros(params)
        for i in range(k):
            sums = add_one(params, sums, optree.tree_map(lambda x: _micro(x, i, k), batch))
        return take_mean(sums)

    def lower(params, batch):
        """The program run once per micro-batch, lowered (read its text and costs)."""
        make_zeros, add_one, _ = compiled(params, batch)
        return add_one.lower(params, make_zeros(params), optree.tree_map(lambda x: _micro(x, 0, k), batch))

    accumulated.lower = lower
    return accumulated


def _micro(x: torch.Tensor, i: int, k: int) -> torch.Tensor:
    """Micro-batch `i` of `k`: rows of each rank's own block for a DTensor, of the whole else."""
    if isinstance(x, DTensor):
        local = x.to_local()
        if local.shape[0] % k:
            raise ValueError(f"nf.accumulate: each rank's {local.shape[0]} rows do not split into {k} "
                             f"micro-batches; use a batch whose per-rank rows divide by {k}.")
        b = local.shape[0] // k
        shape = (x.shape[0] // k, *x.shape[1:])
        return DTensor.from_local(local[i * b:(i + 1) * b], x.device_mesh, x.placements, run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
    if x.shape[0] % k:
        raise ValueError(f"nf.accumulate: a batch of {x.shape[0]} rows does not split into {k} micro-batches; "
                         f"use a batch size that divides by {k}.")
    b = x.shape[0] // k
    return x[i * b:(i + 1) * b]
