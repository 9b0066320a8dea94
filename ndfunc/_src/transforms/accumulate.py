"""`nf.accumulate`: gradient accumulation over micro-batches, one program however many there are.

`nf.accumulate(nf.value_and_grad(loss), k)(params, batch)` splits the batch into `k`
micro-batches along dim 0 and returns the mean loss and mean gradients, equal (up to the order of
sums) to the big batch's when every micro-batch weighs the same (a mean loss over equally many
targets). Where they do not (a token mean, micro-batches holding different numbers of trained
tokens), pass the whole batch's count to the loss as an argument after the batch, divide each
micro-batch's sum by it, and take the sums with `mean=False`: the loss is then the mean over every
trained token of the batch, as one device computes it.

One program adds a micro-batch's loss and gradients into running sums, which it receives donated
and updates where they lie; it is traced, partitioned and lowered once and run `k` times, so the
program does not grow with `k` and only one micro-batch's activations are alive.
With `reduce='each'` (the default) each run reduces its gradients to the parameters' layouts
(an FSDP gradient is reduce-scattered per micro-batch, as FSDP does by default). With
`reduce='end'` the running sums stay unreduced over the batch's mesh axes (`P(..., unreduced=...)`:
each rank adds its own part, as big as the whole parameter where FSDP would keep a shard) and are
reduced once, after the last micro-batch: more memory, a `k`-th of the gradient traffic.

A sharded batch (DTensor) is cut per rank: each rank's micro-batch `i` is rows `i*b .. (i+1)*b`
of its own block, so no data moves; the micro-batches are then other samples than a cut of the
global batch would give, which the mean does not notice. Arguments after the batch (a frozen base,
`nf.nn.functional`'s buffers) reach every micro-batch as they are: not cut, not differentiated,
laid out as given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import optree
import torch
from torch.distributed.tensor import DTensor

from ndfunc._src.jit import jit
from ndfunc._src.transfer import from_local, make_array_from_callback, sharding_of
from ndfunc.sharding import NamedSharding, P


def accumulate(value_and_grad_fn: Callable, num_micro_batches: int, transforms=(), reduce: str = "each",
               compile: bool | str = False, mean: bool = True) -> Callable:
    """`fn(params, batch, *rest) -> (loss, grads)` over `num_micro_batches` micro-batches of `batch`,
    returning the means (see the module's text); `rest` is passed to each as it is. `value_and_grad_fn` is what `nf.value_and_grad`
    returns for a mean loss; `transforms` and `compile` go to the micro-batch program's `nf.jit`;
    `reduce`: `'each'` micro-batch reduces its gradients, or they are reduced once at the `'end'`;
    `mean=False`: the sums, not the means (for a loss already divided by the whole batch's count)."""
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f"nf.accumulate: num_micro_batches must be an int >= 1, got {num_micro_batches!r}.")
    if not isinstance(mean, bool):
        raise TypeError(f"nf.accumulate: mean is True (the mean of the micro-batches' losses and gradients) or "
                        f"False (their sums), got {mean!r}.")
    if reduce not in ("each", "end"):
        raise ValueError(f"nf.accumulate: reduce must be 'each' (each micro-batch reduces its gradients) or "
                         f"'end' (reduce once, after the last), got {reduce!r}.")
    k = num_micro_batches
    divisor = k if mean else 1

    def add(params, sums, batch, *rest):
        loss, grads = value_and_grad_fn(params, batch, *rest)
        return sums[0] + loss, optree.tree_map(torch.add, sums[1], grads)

    add.__name__ = getattr(value_and_grad_fn, "__name__", "add")  # (the program, and its errors, named as the loss)

    def zeros(params):
        return torch.zeros(()), optree.tree_map(torch.zeros_like, params)

    def means(sums):
        return sums[0] / divisor, optree.tree_map(lambda g: g / divisor, sums[1])

    programs: dict = {}

    def compiled(params, batch, rest=()):
        """(zeros, add, means or None): the programs for arguments laid out as these, made once. The sums
        are laid out as the parameters (a plain parameter: replicated), so each run hands the
        next sums in the layout it takes."""
        key = tuple((tuple(x.shape), x.dtype, getattr(x, "placements", None))
                    for x in optree.tree_leaves((params, batch, rest)))
        if key not in programs:
            found = [s for s in map(sharding_of, optree.tree_leaves((params, batch, rest))) if s is not None]
            mesh = found[0].mesh if found else None
            spec = P() if mesh is not None else None
            shardings = optree.tree_map(lambda p: sharding_of(p) or spec, params)
            sums_sharding = (spec, shardings)
            make_zeros = jit(zeros, mesh=mesh, out_shardings=sums_sharding)
            unreduced = reduce == "end" and mesh is not None  # the sums, until `means` reduces them
            if unreduced:
                axes = {a for s in map(sharding_of, optree.tree_leaves(batch)) if s is not None for a in s.spec.axes
                        if mesh.axis_size(a) > 1}
                sums_sharding = (spec, optree.tree_map(lambda p: NamedSharding(mesh, _unreduced(p, axes)), params))
                make_zeros = functools.partial(_zeros, mesh, sums_sharding)
            # (sums already in the parameters' layouts are returned as they lie: no program to run)
            finish = None if divisor == 1 and not unreduced else \
                jit(means, mesh=mesh, out_shardings=(spec, shardings), donate_argnums=(0,))
            programs[key] = (make_zeros,
                             jit(add, mesh=mesh, out_shardings=sums_sharding, donate_argnums=(1,),
                                 transforms=list(transforms), compile=compile),
                             finish)
        return programs[key]

    compiled.programs = programs
    return Accumulated(compiled, k, f"accumulate({add.__name__})")


class Accumulated:
    """What `nf.accumulate` returns: call it as the function it wraps; `.lower(params, batch)` is the
    program run once per micro-batch; `.trace_count` how many such programs were traced."""

    # what `nf.jit` of it says: it runs a jitted program per micro-batch, so it is compiled already
    ndfunc_not_jitted = ("this function is what nf.accumulate returns, which runs jitted programs of its own (one "
                         "per micro-batch, its sums kept laid out as the parameters) and is compiled already; call "
                         "it as it is, and give nf.accumulate the transforms= and compile= you would give nf.jit. "
                         "To jit the whole step, jit a function that calls nf.value_and_grad once per micro-batch.")

    def __init__(self, compiled, k: int, name: str = "accumulated"):
        self._compiled, self._k = compiled, k
        self.__name__ = name

    def __call__(self, params, batch, *rest):
        make_zeros, add_one, take_mean = self._compiled(params, batch, rest)
        sums = make_zeros(params)
        for i in range(self._k):
            sums = add_one(params, sums, optree.tree_map(lambda x, i=i: _micro(x, i, self._k), batch), *rest)
        return sums if take_mean is None else take_mean(sums)

    def lower(self, params, batch, *rest):
        """The program run once per micro-batch, lowered (read its text and costs)."""
        make_zeros, add_one, _ = self._compiled(params, batch, rest)
        return add_one.lower(params, make_zeros(params), optree.tree_map(lambda x: _micro(x, 0, self._k), batch),
                             *rest)

    @property
    def trace_count(self) -> int:
        return sum(programs[1].trace_count for programs in self._compiled.programs.values())


def _unreduced(param, axes: set) -> P:
    """The layout of a running gradient sum for `param`: its spec without the batch's mesh axes,
    which instead hold parts of the sum."""
    spec = sharding_of(param).spec
    entries = [tuple(a for a in spec.dim_axes(d) if a not in axes) or None for d in range(len(spec))]
    return P(*entries, unreduced=axes | set(spec.unreduced))


def _zeros(mesh, shardings, params):
    """Zero sums laid out as `shardings` (unreduced: each rank's part is zero)."""
    loss_spec, grad_shardings = shardings
    zero = lambda shape, dtype, s: make_array_from_callback(  # noqa: E731
        shape, s, lambda index: torch.zeros(s.shard_shape(shape), dtype=dtype))
    grads = optree.tree_map(lambda p, s: zero(tuple(p.shape), p.dtype, s), params, grad_shardings)
    return zero((), torch.float32, NamedSharding(mesh, loss_spec)), grads


def _micro(x: torch.Tensor, i: int, k: int) -> torch.Tensor:
    """Micro-batch `i` of `k`: rows of each rank's own block for a DTensor, of the whole else."""
    if isinstance(x, DTensor):
        local = x.to_local()
        if local.shape[0] % k:
            raise ValueError(f"nf.accumulate: each rank's {local.shape[0]} rows do not split into {k} "
                             f"micro-batches; use a batch whose per-rank rows divide by {k}.")
        b = local.shape[0] // k
        shape = (x.shape[0] // k, *x.shape[1:])
        return from_local(local[i * b:(i + 1) * b], x.device_mesh, x.placements, shape)
    if x.shape[0] % k:
        raise ValueError(f"nf.accumulate: a batch of {x.shape[0]} rows does not split into {k} micro-batches; "
                         f"use a batch size that divides by {k}.")
    b = x.shape[0] // k
    return x[i * b:(i + 1) * b]
