"""Which mesh axes a value inside `nf.shard_map` varies along: JAX's `check_vma`.

An input varies along the axes its in_spec splits it over; an op's result varies along every axis
any of its tensor inputs varies along; a collective sets its result's (`nf.lax`: a psum, pmean, pmax
or all_gather over an axis makes it the same along it; psum_scatter, ppermute and all_to_all make
it vary; `axis_index` varies along its axes). A result whose out_spec leaves out an axis it varies
along would be declared the same on every rank of that axis where it is not: `nf.shard_map` refuses
it, as JAX does. The axes ride on the tensor objects, so they are gone with them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ATTRIBUTE = "_ndfunc_varying_axes"
_NONE: frozenset = frozenset()


def axes_of(x: Any) -> frozenset:
    """The axes `x` varies along (none for what no tracked value made: a constant, a new tensor)."""
    return getattr(x, _ATTRIBUTE, _NONE) if isinstance(x, torch.Tensor) else _NONE


def varies(x: Any, axes: Iterable[str]) -> Any:
    """`x`, marked as varying along exactly `axes`."""
    if isinstance(x, torch.Tensor):
        setattr(x, _ATTRIBUTE, frozenset(axes))
    return x


def _tensors(tree: Any) -> Iterable[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


class Tracked(TorchFunctionMode):
    """While in force (the mapped function's call), each op's results vary along the union of
    what its inputs vary along; a result an op hands back unchanged keeps what it had, widened."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        axes = _NONE.union(*(axes_of(x) for x in _tensors((args, kwargs or {}))))
        if axes:
            for x in _tensors(out):
                varies(x, axes | axes_of(x))
        return out
