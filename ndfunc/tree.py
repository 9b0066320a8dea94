"""Pytree helpers over optree, with paths as strings.

A leaf's path is its keys joined by '.': `{'layers': [{'attn': {'wq': w}}]}` holds `w` at
`layers.0.attn.wq`. Spec trees (of `P`, `NamedSharding` or `None`) are matched to value trees as
*prefixes*, JAX's way: one spec may stand for a whole subtree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

PyTree = Any


__all__ = ["keystr", "tree_broadcast_prefix", "tree_flatten_with_path", "tree_map_with_path"]


def keystr(path: tuple) -> str:
    """`('layers', 0, 'attn')` -> `'layers.0.attn'`."""
    return ".".join(str(key) for key in path)


def tree_flatten_with_path(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None):
    """`([(path, leaf), ...], treespec)`, paths as strings, in optree's leaf order."""
    paths, leaves, treespec = optree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(keystr(p), leaf) for p, leaf in zip(paths, leaves)], treespec


def tree_map_with_path(fn: Callable[..., Any], tree: PyTree, *rest: PyTree, is_leaf=None) -> PyTree:
    """`fn(path, leaf, *other_leaves)` over every leaf, path a string."""
    return optree.tree_map_with_path(
        lambda path, *leaves: fn(keystr(path), *leaves), tree, *rest, is_leaf=is_leaf
    )


def _is_prefix_leaf(node: Any, is_leaf: Callable[[Any], bool] | None) -> bool:
    if node is None or (is_leaf is not None and is_leaf(node)):
        return True
    return optree.treespec_is_leaf(optree.tree_structure(node, none_is_leaf=True))


def tree_broadcast_prefix(
    prefix_tree: PyTree,
    full_tree: PyTree,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    prefix_name: str = "prefix tree",
    full_name: str = "tree",
) -> PyTree:
    """A tree shaped like `full_tree` whose leaves are `prefix_tree`'s, each repeated over the
    subtree it stands for. `None` in the prefix is a leaf.

    Raises:
        ValueError: if `prefix_tree` is not a prefix of `full_tree`, naming the path where the two
            structures part and how.
    """

    def broadcast(prefix: Any, full: Any, path: tuple) -> Any:
        if _is_prefix_leaf(prefix, is_leaf):
            return optree.tree_map(lambda _: prefix, full)
        p_children, p_meta, p_entries, _ = optree.tree_flatten_one_level(prefix, none_is_leaf=True)
        if optree.treespec_is_leaf(optree.tree_structure(full)):
            raise ValueError(_mismatch(path, f"{prefix_name} has a {type(prefix).__name__} where "
                                             f"{full_name} has a leaf ({_brief(full)})"))
        f_children, f_meta, f_entries, unflatten = optree.tree_flatten_one_level(full)
        if type(prefix) is not type(full):
            raise ValueError(_mismatch(path, f"{prefix_name} has a {type(prefix).__name__} where "
                                             f"{full_name} has a {type(full).__name__}"))
        if tuple(p_entries) != tuple(f_entries):
            missing = [keystr(path + (e,)) for e in f_entries if e not in p_entries]
            extra = [keystr(path + (e,)) for e in p_entries if e not in f_entries]
            named = []
            if missing:
                named.append(f"{prefix_name} has no entry for {', '.join(map(repr, missing))}")
            if extra:
                named.append(f"{prefix_name} has an entry for {', '.join(map(repr, extra))}, which is not in {full_name}")
            keys = f"{prefix_name} has keys {list(p_entries)}; {full_name}: {list(f_entries)}"
            raise ValueError(_mismatch(path, f"{'; '.join(named)} ({keys})" if named else keys))
        children = [broadcast(p, f, path + (e,)) for p, f, e in zip(p_children, f_children, f_entries)]
        return unflatten(f_meta, children)

    return broadcast(prefix_tree, full_tree, ())


def _mismatch(path: tuple, what: str) -> str:
    at = f"at {keystr(path)!r}" if path else "at the root"
    return f"{what} {at}; a spec tree must be a prefix of the value tree (one spec may stand for a whole subtree)."


def _brief(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"{type(x).__name__} of shape {tuple(shape)}" if shape is not None else repr(x)
