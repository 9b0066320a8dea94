"""From parameter trees to PartitionSpecs: regex rules on paths, and logical axis names.

Two ways a model says how it is sharded, both pure:
- `match_rules`: `(regex, spec)` pairs over leaf paths (`layers.0.attn.wq`), first match wins.
- `logical_to_mesh`: the model names each dim (`('embed', 'mlp')`), a strategy maps names to
  mesh axes (Flax linen's logical axis rules). Changing strategy is changing that mapping.

Activations are named the same way inside the model (`nf.with_logical_constraint(x, ('batch',
'seq', None))`); `axis_rules(rules)` says, for the code it wraps, which mapping those names take
(Flax's `nn.logical_axis_rules`). Without rules such a constraint does nothing, so one model
runs unchanged on one device and under every strategy.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator, Sequence
from typing import Any

from ndfunc._src.sharding.errors import ShardingError
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc.tree import PyTree, tree_map_with_path

MeshAxes = None | str | tuple[str, ...]
LogicalRules = Sequence[tuple[str, MeshAxes]]


def match_rules(rules: Sequence[tuple[str, PartitionSpec]], tree: PyTree) -> PyTree:
    """A tree of `P` for `tree`: each leaf takes the spec of the first rule whose regex
    `re.search`es its path. Scalars (rank-0 leaves) get `P()`.

    Example:
        >>> rules = [(r'attn\\.w[qkv]$', P(None, 'tp')), (r'.*', P())]
        >>> match_rules(rules, {'attn': {'wq': torch.zeros(4, 8)}, 'step': torch.zeros(())})
        {'attn': {'wq': P(None, 'tp')}, 'step': P()}

    Raises:
        ShardingError: a leaf no rule matches (its path and every pattern are listed).
    """
    compiled = []
    for i, (pattern, spec) in enumerate(rules):
        try:
            compiled.append((re.compile(pattern), spec))
        except re.error as e:
            raise ShardingError(f"rule {i} has pattern {pattern!r}, which is not a valid regular expression: {e}.") from None

    def spec_for(path: str, leaf: Any) -> PartitionSpec:
        if getattr(leaf, "ndim", None) == 0 or isinstance(leaf, (int, float, bool)):
            return PartitionSpec()
        for regex, spec in compiled:
            if regex.search(path):
                return spec
        patterns = ", ".join(repr(pattern) for pattern, _ in rules) or "(none)"
        raise ShardingError(
            f"no rule matches the parameter {path!r}; patterns tried, in order: {patterns}. "
            f"Add a rule for it, or end the list with ('.*', P()) to replicate what is left."
        )

    return tree_map_with_path(spec_for, tree)


def _is_axes_leaf(node: Any) -> bool:
    return isinstance(node, PartitionSpec) or (
        isinstance(node, tuple) and all(n is None or isinstance(n, str) for n in node)
    )


def _logical_names(path: str, names: Any) -> tuple:
    if isinstance(names, PartitionSpec):  # Flax's form: a P of logical names
        if any(isinstance(entry, tuple) for entry in names):
            raise ShardingError(
                f"{path!r} is {names!r}: a logical axis spec names one logical axis per dim, not a tuple."
            )
        return tuple(names)
    if isinstance(names, tuple):
        return names
    raise ShardingError(
        f"{path!r} is {names!r}; expected a tuple of logical dim names, one per dim (or a P of "
        f"them), e.g. ('embed', 'mlp'), or () for a scalar."
    )


def logical_to_mesh(axes_tree: PyTree, rules: LogicalRules) -> PyTree:
    """Map a tree of logical dim names (a tuple or `P` per tensor, e.g. `('vocab', 'embed')`) to `P`s.

    Flax linen semantics: rules are walked in order, as priorities; a rule gives its mesh axes
    to the dim with its logical name if that dim has none yet and this tensor has not used any of
    those axes. So a dim takes the first rule for its name whose axes are still free; a rule of
    `None`, or no usable rule, leaves the dim unsharded.

    Example:
        >>> rules = [('embed', ('dp_shard', 'cp')), ('mlp', 'tp'), ('vocab', 'tp')]
        >>> logical_to_mesh({'w1': ('embed', 'mlp'), 'emb': ('vocab', 'embed')}, rules)
        {'w1': P(('dp_shard', 'cp'), 'tp'), 'emb': P('tp', ('dp_shard', 'cp'))}

    Raises:
        ShardingError: a logical name repeated within one tensor's axes.
    """
    normalized = _normalized(rules)
    return tree_map_with_path(lambda path, names: _to_spec(path, names, normalized), axes_tree,
                              is_leaf=_is_axes_leaf)


def _normalized(rules: LogicalRules) -> list:
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
                and (rule[1] is None or isinstance(rule[1], str)
                     or (isinstance(rule[1], (tuple, list)) and all(isinstance(a, str) for a in rule[1])))):
            raise ShardingError(f"logical rule {i} is {rule!r}; a rule is (logical name, mesh axis or tuple of mesh "
                                f"axes or None), e.g. ('batch', 'dp') or ('embed', ('dp_shard', 'cp')).")
        out.append((rule[0], _as_axes(rule[1])))
    return out


def _to_spec(path: str, names: Any, normalized: list) -> PartitionSpec:
    """One tensor's `P` from its dims' logical names and the normalized rules."""
    names = _logical_names(path, names)
    seen = [n for n in names if n is not None]
    duplicates = sorted({n for n in seen if seen.count(n) > 1})
    if duplicates:
        raise ShardingError(
            f"{path!r} names logical axis {duplicates[0]!r} twice in {names}; each dim of a "
            f"tensor needs its own logical name (e.g. 'embed' and 'embed_out')."
        )
    # Rules are priorities, as in Flax: walk the rules in order and give each one to its
    # dim if that dim is still unassigned and none of the rule's mesh axes is taken.
    unassigned = object()
    entries: list = [unassigned if n is not None else None for n in names]
    for rule_name, mesh_axes in normalized:
        if rule_name not in names:
            continue
        dim = names.index(rule_name)
        taken = {a for e in entries if isinstance(e, tuple) for a in e}
        if entries[dim] is unassigned and not taken & set(mesh_axes or ()):
            entries[dim] = mesh_axes
    entries = [None if e is unassigned else e for e in entries]
    return PartitionSpec(*entries)


_rules: contextvars.ContextVar[LogicalRules | None] = contextvars.ContextVar("ndfunc_axis_rules", default=None)


class axis_rules(contextlib.ContextDecorator):
    """Logical axis rules for `with_logical_constraint` in the code run inside (a context manager,
    or a decorator of the step that `nf.jit` traces). A plain object of its rules, so a step it
    decorates pickles (`nf.processes` sends steps to its workers).

    Example:
        >>> @nf.sharding.axis_rules([('batch', 'dp')])
        ... def f(x):
        ...     return nf.with_logical_constraint(x, ('batch', None))  # in nf.jit: split over 'dp'
    """

    def __init__(self, rules: LogicalRules | None):
        self.rules = None if rules is None else list(rules)
        self._tokens: list = []

    def __enter__(self) -> None:
        self._tokens.append(_rules.set(self.rules))

    def __exit__(self, *exc) -> None:
        _rules.reset(self._tokens.pop())

    def __reduce__(self):
        return (axis_rules, (self.rules,))

    def _recreate_cm(self) -> "axis_rules":  # a decorated step's each call enters a fresh one (threads)
        return axis_rules(self.rules)


def current_rules() -> LogicalRules | None:
    """The rules `axis_rules` set here, or None."""
    return _rules.get()


def logical_spec(names: tuple, rules: LogicalRules, what: str = "value") -> PartitionSpec:
    """The `P` that `rules` give one tensor whose dims are named `names` (see `logical_to_mesh`)."""
    return _to_spec(what, tuple(names), _normalized(rules))


def _as_axes(axes: MeshAxes) -> tuple[str, ...] | None:
    if axes is None:
        return None
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)
