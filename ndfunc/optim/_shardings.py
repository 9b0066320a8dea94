"""Shardings for optimizer state, from the parameters' shardings."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ndfunc._src.sharding.named_sharding import NamedSharding
from ndfunc._src.sharding.partition_spec import PartitionSpec


def state_shardings(state: Any, param_shardings: Any, other: Any = None) -> Any:
    """A sharding tree for `state`: each subtree shaped like the parameters (Adam's `mu`, `nu`,
    momentum's `trace`) takes `param_shardings`; every other leaf (step counts) takes `other`
    (default `P()`, replicated).

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
            if isinstance(node, torch.Tensor) and node.ndim > 0:
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
    return out
