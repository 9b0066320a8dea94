"""`nf.remat`: recompute a region in backward instead of keeping its activations.

`nf.remat(layer)(params, x)` computes what `layer(params, x)` does and marks the ops it makes.
When `nf.jit` traces the step, `rematerialize` rewrites the program: every value made inside a
marked region that backward reads is computed again, from the region's inputs, just before
backward first needs it, and backward reads the copy. The forward values then die inside forward,
and a remat'd decoder layer's activations live only from its recomputation to its gradient, one
layer at a time. (Run eagerly, outside nf.jit, `nf.remat` changes nothing.)

Inside `nf.value_and_grad`, `torch.utils.checkpoint.checkpoint(fn, *args)` (either variant, and
so a Hugging Face model after `activation_checkpointing_enable()`) is `nf.remat(fn)(*args)`: its
own machinery (saved-tensor hooks, or a backward that runs autograd again) is what torch.func
cannot differentiate, and a remat region recomputes the same activations.

Policies (JAX's names): `'full'` keeps nothing made inside the region; `'save_dots'` keeps the
results of its matrix products (the expensive part) and recomputes the rest (norms, activations,
rotary embeddings) from them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint

from ndfunc._src import autodiff, stamp, swaps
from ndfunc._src.autodiff import (
    FORWARD,  # nf.value_and_grad marks the ops of what it differentiates
)
from ndfunc._src.contexts import set_within
from ndfunc._src.partition.planning.ops import saved_by_remat
from ndfunc._src.transforms.base import Transform

aten = torch.ops.aten
POLICIES = ("full", "save_dots")
REGION = "ndfunc_remat"
_regions = itertools.count()  # a fresh id per call of a remat'd function
stamp.PER_CALL[REGION] = lambda mark: (next(_regions), *mark[1:])  # and per copy of a repeated region


def remat(fn: Callable[..., Any], policy: str = "full") -> Callable[..., Any]:
    """`fn`, its activations recomputed in backward under nf.jit (see the module's text)."""
    if policy not in POLICIES:
        raise ValueError(f"nf.remat: policy is one of {POLICIES}, got {policy!r}.")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _region(policy):
            return fn(*args, **kwargs)

    return wrapped


def _region(policy: str):
    """The mark on the ops of one call of a remat'd function (a fresh id per call)."""
    return fx_traceback.annotate({REGION: (next(_regions), policy)})


_AS_REMAT: contextvars.ContextVar[bool] = contextvars.ContextVar("ndfunc_checkpoints_as_remat", default=False)


@contextlib.contextmanager
def checkpoints_as_remat():
    """torch.utils.checkpoint's calls, while inside (this thread and context), as `remat` regions of
    the 'full' policy: its two variants' entry points swapped (`swaps.swapped()`, entered here: the
    re-entrant `CheckpointFunction` and the saved-tensor hooks' generator), as is
    `Tensor.requires_grad_`. A call outside, in another thread meanwhile too, is torch's own.
    (torch.fx's annotations, which `nf.value_and_grad` sets, are process-wide: two threads
    differentiating at once are not supported.)"""
    with swaps.swapped(), set_within(_AS_REMAT):
        yield


@swaps.register(torch.Tensor, "requires_grad_")
def _requires_grad_(torchs: Callable) -> Callable:
    """`Tensor.requires_grad_(True)`, a no-op inside `checkpoints_as_remat` where torch.func refuses
    it: a Hugging Face model with checkpointing enabled marks its embeddings' output so (for the
    re-entrant variant's inputs), and what torch.func differentiates does not depend on the flag.
    `requires_grad_(False)` is refused as ever: it would stop a gradient torch.func still gives."""
    def requires_grad_(self, requires_grad=True):
        try:
            return torchs(self, requires_grad)
        except RuntimeError as e:
            if not requires_grad or not _AS_REMAT.get() or "functorch transform" not in str(e):
                raise
            return self

    return requires_grad_


@swaps.register(torch.utils.checkpoint, "CheckpointFunction")
class _Reentrant:
    """`CheckpointFunction` as `checkpoint(use_reentrant=True)` calls it: inside
    `checkpoints_as_remat`, the function under `remat`; else torch's."""

    def __init__(self, torchs: type[torch.autograd.Function]):
        self.torchs = torchs

    def apply(self, function, preserve_rng_state, *args):
        if _AS_REMAT.get():
            return remat(function)(*args)
        return self.torchs.apply(function, preserve_rng_state, *args)


@swaps.register(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator")
def _without_reentrant(torchs: Callable) -> Callable:
    """The generator `checkpoint(use_reentrant=False)` steps around its call of `fn`: inside
    `checkpoints_as_remat`, the call marked as a `remat` region, of the 'full' policy whatever
    `context_fn` says (a selective policy of torch's: mark the function with
    `nf.remat(fn, 'save_dots')` instead); else torch's."""
    def generator(fn, preserve_rng_state, context_fn, determinism_check, debug, early_stop, *args, **kwargs):
        if not _AS_REMAT.get():
            yield from torchs(fn, preserve_rng_state, context_fn, determinism_check, debug, early_stop, *args,
                              **kwargs)
            return
        with _region("full"):
            yield

    return generator


autodiff.AROUND_GRAD.append(checkpoints_as_remat)


def rematerialize(graph: torch.fx.Graph) -> int:
    """Recompute, before backward, what backward reads of each marked region; how many ops were
    copied."""
    regions: dict = {}
    for node in graph.nodes:
        mark = (node.meta.get("custom") or {}).get(REGION)
        if mark is not None and node.op == "call_function":
            regions.setdefault(mark, []).append(node)
    copied = 0
    order = {n: i for i, n in enumerate(graph.nodes)}  # (numbered once: the copies keep the others' order)
    for (_, policy), inside in regions.items():
        copied += _recompute(graph, inside, policy, order)
    if copied:
        graph.lint()
    return copied


def _forward(node: torch.fx.Node) -> bool:
    return bool((node.meta.get("custom") or {}).get(FORWARD))


def _recompute(graph: torch.fx.Graph, inside: list, policy: str, order: dict) -> int:
    """Copy before backward what backward reads of one region. `order`: the graph's nodes
    numbered in order (as they were, or since: copies are added between them)."""
    members = set(inside)
    kept = {n for n in inside if policy == "save_dots" and saved_by_remat(n.target)}
    # what backward reads of the region: values with a reader outside forward
    read = [n for n in inside if n not in kept and any(not _forward(u) for u in n.users)]
    if not read:
        return 0
    # the region's ops these values need, back to its inputs (or kept products)
    need, todo = set(), list(read)
    while todo:
        n = todo.pop()
        if n in need:
            continue
        need.add(n)
        todo.extend(a for a in n.all_input_nodes if a in members and a not in kept)
    readers = [u for n in read for u in n.users if not _forward(u)]
    if any(u not in order for u in readers):  # a copy made for another region reads this one
        order.clear()
        order.update((n, i) for i, n in enumerate(graph.nodes))
    first = min(readers, key=order.__getitem__)
    env: dict = {}
    with graph.inserting_before(first):
        for n in sorted(need, key=order.__getitem__):
            copy = graph.node_copy(n, lambda a: env.get(a, a))
            copy.meta["custom"] = {k: v for k, v in (n.meta.get("custom") or {}).items() if k not in (FORWARD, REGION)}
            env[n] = copy
    copies = set(env.values())
    for n in read:
        for u in list(n.users):
            if not _forward(u) and u not in copies:
                u.replace_input_with(n, env[n])
    return len(need)


@dataclasses.dataclass(frozen=True)
class remat_regions(Transform):  # noqa: N801 - a transform is named like the function it stands for
    """The pass behind `nf.remat`, always first among a step's transforms: the regions `nf.remat`
    marked while the step was traced are recomputed for backward (`rematerialize`)."""

    def traced(self, program) -> None:
        rematerialize(program.traced.graph)
