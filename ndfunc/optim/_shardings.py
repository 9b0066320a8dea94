"""Shardings for optimizer state, from the parameters' shardings."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ndfunc._src.sharding.mesh import get_mesh
from ndfunc._src.sharding.named_sharding import NamedSharding
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.sharding.shape_dtype import ShapeDtypeStruct, has_stand_ins


def state_shardings(state: Any, param_shardings: Any, other: Any = None) -> Any:
    """A sharding tree for `state`: each subtree shaped like the parameters (Adam's `mu`, `nu`,
    momentum's `trace`) takes `param_shardings`; every other leaf (step counts) takes `other`
    (default `P()`, replicated).

    Over a state of `nf.ShapeDtypeStruct` stand-ins (`opt.init` over stand-ins) it returns the
    stand-ins laid out so: each a `NamedSharding` on the mesh of the shardings given (or of the
    stand-ins, or the current one), ready for `nf.jit(...).lower`.

    Example:
        >>> opt = nf.optim.adam(1e-3)
        >>> state = opt.init({'w': torch.zeros(4, 2)})
        >>> specs = nf.optim.state_shardings(state, {'w': P('dp')})
        >>> specs[0].mu, specs[0].count
        ({'w': P('dp')}, P())
    """
    other = PartitionSpec() if other is None else other
    is_spec = lambda x: isinstance(x, (PartitionSpec, NamedSharding))  # noqa: E731
    params_structure = optree.tree_structure(param_shardings, is_leaf=is_spec)

    matched, big = [], []

    def walk(node: Any) -> Any:
        if optree.tree_structure(node) == params_structure:
            matched.append(node)
            return param_shardings
        if optree.treespec_is_leaf(optree.tree_structure(node)):
            if isinstance(node, (torch.Tensor, ShapeDtypeStruct)) and node.ndim > 0:
                big.append(node)
            return other
        children, meta, _, unflatten = optree.tree_flatten_one_level(node)
        return unflatten(meta, [walk(c) for c in children])

    out = walk(state)
    if big and not matched:  # moments shaped like the parameters, but not like these specs
        raise ValueError(
            f"nf.optim.state_shardings: no part of the optimizer state is shaped like param_shardings "
            f"({params_structure.num_leaves} specs); its {len(big)} non-scalar tensors would be laid out as "
            f"{other}. Give param_shardings the structure of the parameters the state was made from (a spec for "
            f"every parameter).")
    if has_stand_ins(state):
        return _laid_out(state, out, (param_shardings, state))
    return out


def _laid_out(state: Any, shardings: Any, where: Any) -> Any:
    """The stand-ins of `state` with `shardings` (a tree like it), a bare P bound to a mesh found
    in `where` (a NamedSharding's, a stand-in's) or the current one."""
    is_spec = lambda x: isinstance(x, (PartitionSpec, NamedSharding))  # noqa: E731
    found = [s.mesh for s in optree.tree_leaves(where, is_leaf=is_spec) if isinstance(s, NamedSharding)]
    found += [x.sharding.mesh for x in optree.tree_leaves(where) if isinstance(x, ShapeDtypeStruct) and x.sharding]
    mesh = found[0] if found else get_mesh()

    def lay_out(x, spec):
        if not isinstance(x, ShapeDtypeStruct):
            return x
        if isinstance(spec, PartitionSpec):
            if mesh is None:
                raise ValueError(f"nf.optim.state_shardings: the state is stand-ins (ShapeDtypeStruct) and the "
                                 f"shardings bare {spec!r}s, with no mesh to bind them to; give "
                                 f"NamedSharding(mesh, spec)s, or call it under `with mesh:`.")
            spec = NamedSharding(mesh, spec)
        return x.with_sharding(spec)

    leaves, treespec = optree.tree_flatten(state)
    specs = optree.tree_leaves(shardings, is_leaf=is_spec)
    assert len(specs) == len(leaves), (len(specs), len(leaves))
    return optree.tree_unflatten(treespec, [lay_out(x, s) for x, s in zip(leaves, specs)])
