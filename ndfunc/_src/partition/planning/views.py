"""Views of split blocks that DTensor's view rule refuses but that need no communication.

DTensor keeps a split through a flatten only on the group's first dim, and through a split of one
dim into several only on the first of them: anything else is, in general, a strided block.
Yet a block is often contiguous all the same. A loss flattens (batch, sequence) to tokens with the
batch split over the data-parallel axes and the sequence over `cp`; where each rank holds one
sequence (a batch dim split down to size 1), its tokens are one contiguous run of the flattened
dim, block `dp_rank * cp + cp_rank`: a split over the data-parallel axes and `cp` in mesh order,
which is how a `Layout` splits one dim over several axes. `contiguous_view` finds those cases, so
the logits stay split over `cp` and are never made for the whole sequence on every rank.

A flattened group keeps its blocks whole when every dim before the last split one has one element
per rank, and the axes splitting the group's dims run in mesh order from its first dim to its
last (outer dims on outer axes). A dim split into several takes its axes the same way: in mesh
order, each output dim taking axes until it has one element per rank, the last taking what is left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

from ndfunc._src.partition.planning.layout import R, Layout
from ndfunc._src.torch_compat import view_dim_map


def contiguous_view(rule: Sequence, shape: Sequence[int], layout: Layout,
                    sizes: Sequence[int]) -> tuple[Layout, Layout] | None:
    """`(input layout, output layout)` of a view by DTensor's dim map `rule` (`view_groups`'s)
    that takes a value of `shape` in `layout` as it is, each rank viewing its own block; None
    where the blocks of some flattened or split dim would not be contiguous (or the rule is one
    this does not read). Pending sums pass through on their axes."""
    kinds = view_dim_map()
    Flatten, InputDim, NewDim, Singleton, Split = (kinds.Flatten, kinds.InputDim, kinds.NewDim,  # noqa: N806
                                                   kinds.Singleton, kinds.Split)
    axes_of = [[] for _ in shape]  # input dim -> the axes splitting it, in mesh order
    for axis, p in enumerate(layout):
        if type(p) is Shard:
            axes_of[p.dim].append(axis)
        elif not (type(p) is Replicate or isinstance(p, Partial)):
            return None
    out_axes: list[list[int]] = [[] for _ in rule]  # output dim -> its axes
    used = set()
    splits: dict[int, list[list[int]]] = {}  # input dim -> its split's axes per group member
    for out_dim, cmd in enumerate(rule):
        if type(cmd) is InputDim:
            out_axes[out_dim] = axes_of[cmd.input_dim]
            used.add(cmd.input_dim)
        elif type(cmd) is Flatten:
            dims = [d.input_dim if type(d) is InputDim else None for d in cmd.input_dims]
            if None in dims or (group := _flatten(dims, shape, axes_of, sizes)) is None:
                return None
            out_axes[out_dim] = group
            used.update(dims)
        elif type(cmd) is Split:
            if type(cmd.input_dim) is not InputDim:
                return None
            dim = cmd.input_dim.input_dim
            if dim not in splits:
                splits[dim] = _split(cmd.group_shape, axes_of[dim], sizes)
                if splits[dim] is None:
                    return None
            out_axes[out_dim] = splits[dim][cmd.split_id]
            used.add(dim)
        elif type(cmd) not in (Singleton, NewDim):
            return None  # broadcasts and repeats: DTensor's rule
    if any(axes_of[d] for d in range(len(shape)) if d not in used):
        return None  # a split dim the view drops
    out = list(layout)
    for axis, p in enumerate(layout):
        if type(p) is Shard:
            out[axis] = R
    for out_dim, axes in enumerate(out_axes):
        for axis in axes:
            out[axis] = Shard(out_dim)
    return layout, tuple(out)


def _flatten(dims: list[int], shape, axes_of, sizes) -> list[int] | None:
    """The axes splitting the flattened `dims` (mesh order), or None if a block is not contiguous."""
    split_at = [d for d in dims if axes_of[d]]
    if not split_at:
        return []
    last = dims.index(split_at[-1])
    for d in dims[:last]:
        if shape[d] // math.prod(sizes[a] for a in axes_of[d]) != 1:
            return None  # more than one element a rank before the last split dim: strided
    axes = [a for d in dims for a in axes_of[d]]
    return axes if axes == sorted(axes) else None


def _split(group_shape: Sequence[int], axes: list[int], sizes) -> list[list[int]] | None:
    """Each member of a dim's split into `group_shape` takes the dim's axes in mesh order until it
    has one element a rank; the member that keeps more takes the last of them. None if an axis
    would straddle two members."""
    taken: list[list[int]] = [[] for _ in group_shape]
    rest = list(axes)
    for i, n in enumerate(group_shape):
        blocks = 1
        while rest and blocks < n:
            if n % (blocks * sizes[rest[0]]):
                return None
            blocks *= sizes[rest[0]]
            taken[i].append(rest.pop(0))
        if not rest:
            break
    return None if rest else taken
