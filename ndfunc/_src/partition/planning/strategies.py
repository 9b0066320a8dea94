"""Strategies from DTensor's own sharding rules, and the local form of an op's arguments.

A `Strategy` says, for one way of running a node on the mesh, the layout of each tensor output and
the layout each tensor input must arrive in. DTensor registers rules two ways and we read both:
single-dim rules (placements valid along one mesh axis; we take their product over the axes) and
full op strategies (called with every layout each input could have). A reshape also takes, as they
are, the splits whose blocks stay contiguous where DTensor's view rule would move them
(`ndfunc._src.partition.planning.views`). What ndfunc adds to them
(its own ops, attention, the rules it corrects) is in the op registry, `ndfunc._src.partition.planning.ops`,
which asks here for the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
from collections.abc import Sequence

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from ndfunc._src.partition.planning.layout import (
    R,
    Layout,
    all_layouts,
    axis_placements,
    fits,
    local_shape,
    replicated,
    subset_products,
)
from ndfunc._src.partition.planning.views import contiguous_view
from ndfunc._src.torch_compat import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    TensorMeta,
    TupleStrategy,
    pytree,
    renames_dims_only,
    rewrites_shape_args,
    rules_without_costs,
    shape_only_device_mesh,
    view_rule,
)
from ndfunc._src.torch_compat import sharding_propagator as propagator
from ndfunc._src.view_ops import BY_AXIS, RESHAPES

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Strategy:
    outs: tuple[Layout | None, ...]  # per tensor output (None: an output the op leaves empty)
    ins: tuple[Layout, ...]  # per tensor input, in `tensor_inputs` order
    # one the search admits only once it has settled without it (`solve.Problem.solve`), so that
    # it changes a plan only where it lowers the cost
    late: bool = dataclasses.field(default=False, compare=False, repr=False)


class NoStrategy(Exception):
    """DTensor has no sharding rule for this op (and ndfunc adds none)."""


@functools.cache
def planning_mesh(sizes: tuple[int, ...]) -> DeviceMesh:
    """A DeviceMesh of `sizes` with no process group: strategies need only its shape."""
    return shape_only_device_mesh(sizes)


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's tensor-valued inputs, in the order DTensor's OpSchema lists them."""
    return list(inputs_and_signature(node)[0])


def inputs_and_signature(node: torch.fx.Node) -> tuple[tuple, tuple]:
    """(`tensor_inputs` as a tuple, `signature`) of `node`, remembered while its arguments and their
    values are the objects they were (the partitioner and the lowering ask each node's many times)."""
    known = getattr(node, _READ, None)
    if known is not None and known[0] is node.args and known[1] is node.kwargs and all(
            a.meta.get("val") is v for a, v in known[2]):
        return known[3]
    leaves, spec = _flattened((node.args, node.kwargs))
    ins, key = [], []
    for a in leaves:
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                ins.append(a)
                key.append((tuple(v.shape), v.dtype))
            else:
                key.append(("N", repr(v)))
        else:
            key.append(a if isinstance(a, (int, float, bool, str, type(None))) else repr(a))
    read = (tuple(ins), (node.target, spec, tuple(key)))
    setattr(node, _READ, (node.args, node.kwargs, [(a, a.meta.get("val")) for a in node.all_input_nodes], read))
    return read


def _flattened(tree) -> tuple[list, object]:
    """`tree`'s leaves in pytree's order (DTensor's OpSchema lists tensors in it) and a key equal
    for trees of one structure. Arguments made of tuples, lists and dicts of plain leaves (nearly
    every node's) are walked here, several times faster than pytree builds a TreeSpec; anything
    else by pytree."""
    leaves: list = []
    shape: list = []

    def walk(x) -> bool:
        t = type(x)
        if t in _SEQUENCES:
            shape.append((_SEQUENCES[t], len(x)))
            return all(walk(y) for y in x)
        if t in _MAPPINGS:
            shape.append((_MAPPINGS[t], tuple(x)))
            return all(walk(y) for y in x.values())
        leaves.append(x)
        shape.append(None)  # where each leaf sits, as pytree's spec says
        return t in _PLAIN_LEAVES
    if walk(tree):
        return leaves, tuple(shape)
    leaves, spec = pytree.tree_flatten(tree)
    return leaves, str(spec)


_SEQUENCES = {tuple: "T", list: "L", torch.fx.immutable_collections.immutable_list: "L"}
_MAPPINGS = {dict: "D", torch.fx.immutable_collections.immutable_dict: "D"}
# leaves pytree does not look into (its own registered types, namedtuples among them, it does)
_PLAIN_LEAVES = frozenset({torch.fx.Node, int, float, bool, str, type(None), torch.dtype, torch.device,
                           torch.layout, torch.memory_format})


# where a node keeps what `inputs_and_signature` read of it: on the node, so that it goes with its
# graph (a table keyed weakly by node would keep every graph alive, each entry holding the node's
# inputs, and through their users the node)
_READ = "_ndfunc_inputs_and_signature"


def value_of(arg: torch.fx.Node) -> tuple:
    """The value an fx argument refers to, `(node, output index)`: a getitem of a multi-output
    node is (node, i)."""
    if arg.op == "call_function" and arg.target is operator.getitem and isinstance(
            arg.args[0].meta.get("val"), (tuple, list)):
        return (arg.args[0], arg.args[1])
    return (arg, 0)


def tensor_outputs(node: torch.fx.Node) -> list[torch.Tensor | None]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def signature(node: torch.fx.Node) -> tuple:
    """What a node's strategies depend on: its op, its tensors' shapes and dtypes, other args."""
    return inputs_and_signature(node)[1]


def from_dtensor(node: torch.fx.Node, ins: list, outs: list, sizes: tuple[int, ...]) -> Sequence[Strategy] | None:
    """DTensor's strategies for `node` (a factory with no tensor input: built replicated); None if
    DTensor has no rule for its op."""
    op = node.target
    if not ins:
        return [Strategy(tuple(None if o is None else replicated(len(sizes)) for o in outs), ())]
    if op in propagator().op_single_dim_strategy_funcs:
        return _from_single_dim(node, ins, outs, sizes)
    if len(ins) == 1 and (view := view_rule(op)) is not None:
        return _from_view_rule(node, outs, sizes, *view)
    if op in propagator().op_strategy_funcs:
        return from_op_strategy(node, ins, outs, sizes)
    return None


def _placeholder_to_shard(p):
    if p is None or isinstance(p, (Replicate, Partial, Shard)):
        return p
    return Shard(p.dim)  # DTensor's _ShardingPlaceholder


def _from_single_dim(node, ins, outs, sizes) -> list[Strategy]:
    info = propagator().op_single_dim_strategy_funcs[node.target]
    args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: _meta(a.meta["val"]) if isinstance(
        a.meta.get("val"), torch.Tensor) else a.meta.get("val"), (node.args, node.kwargs))
    try:
        rules = info.func(node.target, tuple(args), kwargs)
    except Exception as e:  # noqa: BLE001 - a rule that cannot handle these arguments has none
        raise NoStrategy(node.target) from e
    width = len(ins) + len(outs)
    rules = [[_placeholder_to_shard(p) for p in r] for r in rules if len(r) == width]
    all_replicate = [None if o is None else Replicate() for o in outs] + [Replicate()] * len(ins)
    if all_replicate not in rules:
        rules.insert(0, all_replicate)
    # one rule per mesh axis, in every combination (a repeated rule only repeats strategies)
    shapes = [None if o is None else tuple(o.shape) for o in outs] + [tuple(a.meta["val"].shape) for a in ins]
    rules = list({tuple(r): None for r in rules})
    return _axis_product([rules] * len(sizes), shapes, sizes, len(outs), [o is None for o in outs])


def per_axis(rules: list[tuple], shapes: list, sizes: tuple[int, ...], n_outs: int) -> Fitted:
    """The strategies of a rule given for one mesh axis (`rules`: a placement per tensor, outputs
    first), one per axis in every combination that fits `shapes`, as DTensor's single-dim rules."""
    return _axis_product([rules] * len(sizes), shapes, sizes, n_outs, [False] * n_outs)


def _axis_product(rows: list[list[tuple]], shapes: list, sizes: tuple[int, ...], n_outs: int, empty: list[bool],
                  n_checked: int = 0) -> Fitted:
    """The strategies of one row of placements per mesh axis (`rows[axis]`: a placement per
    tensor, outputs first, as `_combined` reads them), in every combination that fits the shapes
    (a tensor of shape None: an output the op leaves empty). A row no layout that fits can hold is
    dropped first. Each distinct placement goes as an int and each distinct layout is made once in
    the process: the partitioner numbers layouts by identity first (`Problem._layout`), and a
    4-axis op has thousands."""
    codes, cuts = [], []
    for axis_rows in rows:
        kept = [r for r in axis_rows if all(shp is None or _holds(p, shp) for p, shp in zip(r, shapes))]
        codes.append([[_placement_code(p) for p in r] for r in kept])
        cuts.append([[(t, p.dim) for t, p in enumerate(r) if type(p) is Shard and shapes[t] is not None]
                     for r in kept])
    return _combined(codes, cuts, shapes, sizes, n_outs, empty, n_checked)


def _placement_code(p) -> int:
    code = _PLACEMENT_CODES.get(p)
    if code is None:
        with _INTERNING:  # (programs may be lowered in several threads)
            code = _PLACEMENT_CODES.get(p)
            if code is None:
                _PLACEMENTS_BY_CODE.append(p)
                code = _PLACEMENT_CODES[p] = len(_PLACEMENTS_BY_CODE) - 1
    return code


# placements as ints, and layouts made of them, shared by every rule's candidates (`_combined`):
# the same layout is the same object in every list
_PLACEMENT_CODES: dict = {}
_PLACEMENTS_BY_CODE: list = []
_LAYOUTS: dict = {}  # placement codes -> the layout (two threads making one at once make equal layouts: no lock)
_INTERNING = threading.Lock()


def _combined(codes, cut, shapes, sizes, n_outs, empty, n_checked: int = 0) -> Fitted:
    """Every combination of one rule per mesh axis, in `itertools.product`'s order, whose cuts
    divide the shapes. `codes[axis]` and `cut[axis]` list that axis's rules (the same list on
    every axis for a single-dim rule). The combinations are walked as arrays (`_walked`). The last
    `n_checked` tensors are only held to their shapes, not part of a strategy; a strategy made
    again by another combination is then kept once, the first.

    Remembered by what the walk reads (`_COMBINED`): the rules, and which products of the axes'
    sizes divide each cut dim. Ops with the same rules over shapes that divide alike (the adds of
    values of different widths, each width a multiple of every product) share one list."""
    products = subset_products(tuple(sizes))
    cut_dims = sorted({td for rows in cut for row in rows for td in row})
    key = (tuple(sizes), n_outs, tuple(empty), n_checked, tuple(tuple(map(tuple, rows)) for rows in codes),
           tuple(tuple(map(tuple, rows)) for rows in cut),
           tuple(tuple(shapes[t][d] % q == 0 for q in products) for t, d in cut_dims))
    known = _COMBINED.get(key)
    if known is None:
        known = _COMBINED[key] = _walked(codes, cut, cut_dims, shapes, sizes, n_outs, empty, n_checked)
    return known


_COMBINED: dict = {}  # what `_combined` reads -> its list


def _walked(codes, cut, cut_dims, shapes, sizes, n_outs, empty, n_checked) -> Fitted:
    """`_combined`, as arrays: every combination of one rule per axis (rows in `itertools.product`'s
    order), those whose products of cuts divide the dims kept (`cut_dims`: each (tensor, dim) some
    rule splits), each tensor's placements along the axes as one int (placement codes as digits),
    and the layouts numbered in the order the strategies read them (inputs, then the outputs
    made). A 4-axis op walks 10^4 combinations."""
    k, n_tensors = len(sizes), len(shapes)
    counts = [len(rules) for rules in codes]
    combos = np.indices(counts).reshape(k, -1)  # (axis, combination): each axis's rule
    kept = np.ones(combos.shape[1], dtype=bool)
    for t, d in cut_dims:
        split = np.ones(combos.shape[1], dtype=np.int64)
        for axis in range(k):
            cuts_it = np.array([(t, d) in row for row in cut[axis]], dtype=bool)
            split *= np.where(cuts_it[combos[axis]], sizes[axis], 1)
        kept &= shapes[t][d] % split == 0
    combos = combos[:, kept]
    used = sorted({c for rules in codes for rule in rules for c in rule})  # the placements here, as digits
    digit_of = {c: i for i, c in enumerate(used)}
    base = len(used)
    if base ** k >= 2 ** 63:  # (a dozen placements over 17 partitioned axes)
        raise ValueError(f"{k} partitioned mesh axes with {base} placements each: more layouts than an int64 numbers")
    keys = np.zeros((n_tensors, combos.shape[1]), dtype=np.int64)  # (tensor, combination): its layout's code
    for axis in range(k):
        table = np.array([[digit_of[c] for c in rule] for rule in codes[axis]], dtype=np.int64)
        keys = keys * base + table.reshape(counts[axis], n_tensors)[combos[axis]].T
    n_real = n_tensors - n_checked
    if n_checked:  # a strategy made again by another combination: the first kept
        _, first = np.unique(keys[:n_real].T, axis=0, return_index=True)
        keys = keys[:, np.sort(first)]
    reads = [*range(n_outs, n_real), *(t for t in range(n_outs) if not empty[t])]
    read = keys[reads].T.ravel()  # strategy by strategy, in the order each reads its layouts
    distinct, first, number = np.unique(read, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # the layouts as first read
    renumber = np.empty(len(distinct), dtype=np.int64)
    renumber[order] = np.arange(len(distinct))
    at = np.full((keys.shape[1], n_real), -1, dtype=np.int64)
    at[:, reads] = renumber[number].reshape(keys.shape[1], len(reads))
    digits = distinct[order][:, None] // base ** np.arange(k - 1, -1, -1) % base  # (layout, axis)
    layouts = [*map(_layout_of, map(tuple, np.array(used, dtype=np.int64)[digits].tolist()))]
    return Fitted(layouts, np.ascontiguousarray(at[:, :n_outs]), np.ascontiguousarray(at[:, n_outs:]))


class Fitted(Sequence):
    """Strategies known to fit their values' shapes, each once, kept as the distinct layouts they
    are made of and, per strategy, the index of each output's and input's layout among them (-1:
    an output the op leaves empty). A 4-axis op has thousands of strategies over a few dozen
    layouts: the partitioner reads the indices (`Problem._add_node`), and a `Strategy` is made
    when one is read. The indices come as lists of tuples or as (strategies, slots) int arrays
    (`outs`, `ins`), and each form is made from the other when first read: a walk of axis
    combinations makes arrays, which is all the partitioner reads of a long list."""

    def __init__(self, layouts: list[Layout], outs, ins, late: frozenset[int] = frozenset()):
        self.layouts = layouts
        self.late = late  # the strategies that are `Strategy.late`, by index
        if isinstance(ins, np.ndarray):
            self.__dict__["arrays"] = (ins, outs)
        else:
            self.__dict__["ins"], self.__dict__["outs"] = ins, outs

    def __len__(self) -> int:
        rows = self.__dict__.get("ins")
        return len(rows) if rows is not None else len(self.arrays[0])

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """`ins` and `outs` as (strategies, slots) int64 arrays."""
        return tuple(np.array(rows, dtype=np.int64).reshape(len(rows), len(rows[0]) if rows else 0)
                     for rows in (self.ins, self.outs))

    @functools.cached_property
    def ins(self) -> list[tuple[int, ...]]:
        return list(map(tuple, self.arrays[0].tolist()))

    @functools.cached_property
    def outs(self) -> list[tuple[int, ...]]:
        return list(map(tuple, self.arrays[1].tolist()))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if "ins" in self.__dict__:
            outs, ins = self.outs[i], self.ins[i]
        else:  # one row of the arrays, not every row as a list
            outs, ins = (a[i].tolist() for a in (self.arrays[1], self.arrays[0]))
        lays = self.layouts
        return Strategy(tuple(None if k < 0 else lays[k] for k in outs), tuple(lays[k] for k in ins),
                        late=i in self.late)


def fitted(found: Sequence[Strategy], shapes_in: list, shapes_out: list, sizes: tuple[int, ...]) -> Fitted:
    """The strategies of `found` with one layout per tensor input and output that fits its value's
    shape (an output the op leaves empty: None), each once (the first, `late` or not), in order, as a
    `Fitted`: its layouts numbered as the strategies first read them, inputs before outputs."""
    coded: dict = {}  # id(layout) -> (the layout, its placement codes): by identity first, placements hash slowly

    def codes(lay) -> tuple[int, ...] | None:
        if lay is None:
            return None
        known = coded.get(id(lay))
        if known is None or known[0] is not lay:
            known = coded[id(lay)] = (lay, _codes(lay))
        return known[1]
    n_ins, n_outs = len(shapes_in), len(shapes_out)
    return _kept(((tuple(map(codes, s.ins)), tuple(map(codes, s.outs)), s.late) for s in found
                  if len(s.ins) == n_ins and len(s.outs) == n_outs), shapes_in, shapes_out, sizes)


def _kept(rows, shapes_in: list, shapes_out: list, sizes: tuple[int, ...]) -> Fitted:
    """`fitted` of strategies given as placement codes: rows of (each input's codes, each output's
    (None: an output the op leaves empty), late)."""
    def fit(codes, shape) -> bool:
        if shape is None:  # an output the op leaves empty takes any layout
            return True
        if codes is None:
            return False
        ok = _FITS.get((codes, shape, sizes))
        if ok is None:
            ok = _FITS[codes, shape, sizes] = fits(_layout_of(codes), shape, sizes)
        return ok
    at: dict = {}  # codes -> number, as first read (inputs, then outputs)
    outs, ins, late, seen = [], [], set(), set()
    for in_codes, out_codes, is_late in rows:
        if (in_codes, out_codes) in seen or not (all(map(fit, in_codes, shapes_in))
                                                 and all(map(fit, out_codes, shapes_out))):
            continue
        seen.add((in_codes, out_codes))
        for codes in (*in_codes, *out_codes):
            if codes is not None and codes not in at:
                at[codes] = len(at)
        if is_late:
            late.add(len(ins))
        ins.append(tuple([at[c] for c in in_codes]))
        outs.append(tuple([-1 if c is None else at[c] for c in out_codes]))
    return Fitted([*map(_layout_of, at)], outs, ins, frozenset(late))


_FITS: dict = {}  # (placement codes, shape, mesh sizes) -> whether the layout fits (`_kept`): views of one
# shape ask it for the same layouts


def _holds(p, shape: tuple[int, ...]) -> bool:
    """Whether placement `p` can be one axis's part of a layout that `fits` a value of `shape`."""
    if type(p) is Shard:
        return 0 <= p.dim < len(shape)
    return fits((p,), shape, (1,))


def from_op_strategy(node, ins, outs, sizes) -> Sequence[Strategy]:
    """DTensor's full op strategies expect each input to arrive in one layout (they follow it).
    Ask once per layout of each input, the others replicated, and pool the answers (a rule of
    `AXIS_BY_AXIS`: once per placement of each mesh axis, `_asked_by_axis`)."""
    if len(ins) == 1 and node.target in AXIS_BY_AXIS and (made := _asked_by_axis(node, ins[0], outs, sizes)):
        return made
    found: list[Strategy] = []
    errors = []
    asking = _Asking(node, sizes)
    with rules_without_costs():  # the strategies only: the solver prices layout changes itself
        for i, a in enumerate(ins):
            for lay in all_layouts(tuple(a.meta["val"].shape), sizes):
                try:
                    found += asking.ask(i, lay, len(outs))
                except Exception as e:  # noqa: BLE001 - a layout the rule rejects has no strategy
                    errors.append(e)
    if not found:
        raise NoStrategy(node.target) from (errors[0] if errors else None)
    return found


# Ops whose DTensor rule maps each mesh axis's placement of their one input on its own, whatever
# the other axes hold: it follows the input (clone, fill_, empty_like), transposes it, unshards one
# dim (slice, split) or turns a split of a summed dim into a pending sum (sum: a pending sum stays
# one). Not a mean's, a max's or a product's: theirs replicate every axis once any axis holds a
# pending sum of another kind, or a split that does not divide. The views among them are the
# views table's (`view_ops.BY_AXIS`: slice, split, t, clone, ...).
AXIS_BY_AXIS = BY_AXIS | frozenset({
    aten.sum.default, aten.sum.dim_IntList, aten.fill_.Scalar, aten.zero_.default, aten.empty_like.default})


def _asked_by_axis(node, a: torch.fx.Node, outs: list, sizes: tuple[int, ...]) -> Fitted | None:
    """`from_op_strategy`'s strategies for a rule of `AXIS_BY_AXIS`, asked once per placement of
    each mesh axis (the other axes replicated) and made as the product of the answers
    (`_combined`): the same strategies in the same order as asking every layout (`all_layouts`'
    order is the product's), each once. None where an answer is not one strategy that keeps the
    other axes replicated, or an output is empty: then every layout is asked."""
    k = len(sizes)
    shape = tuple(a.meta["val"].shape)
    if any(o is None for o in outs):
        return None
    shapes = [*(tuple(o.shape) for o in outs), shape, shape]  # the outputs, the input, the layout asked (only checked)
    asking = _Asking(node, sizes)
    rows = []
    with rules_without_costs():
        for m in range(k):
            rows.append([])
            for p in axis_placements(len(shape)):
                asked = tuple(p if i == m else R for i in range(k))
                if not fits(asked, shape, sizes):
                    continue  # no layout that holds it fits
                try:
                    found = asking.ask(0, asked, len(outs))
                except Exception:  # noqa: BLE001 - a layout the rule rejects has no strategy
                    continue
                if len(found) != 1 or any(lay is None or any(q != R for i, q in enumerate(lay) if i != m)
                                          for lay in (*found[0].outs, *found[0].ins)):
                    return None
                rows[m].append((*(lay[m] for lay in found[0].outs), found[0].ins[0][m], p))
    return _axis_product(rows, shapes, sizes, len(outs), [False] * len(outs), n_checked=1)


def _from_view_rule(node, outs, sizes, dim_map, strict_view, propagate) -> Fitted:
    """`from_op_strategy` for a view-like op, by the function DTensor's rule applies per input
    layout: the same strategies in the same order, without a spec or a cost built per question."""
    asking = _Asking(node, sizes)
    try:
        rules = _dim_map_of(asking, dim_map)
    except Exception as e:  # noqa: BLE001 - arguments the rule cannot map have no strategy
        raise NoStrategy(node.target) from e
    shape = tuple(asking.metas[0].shape)
    mesh_shape = asking.mesh.shape
    out_shape = tuple(node.meta["val"].shape) if isinstance(node.meta.get("val"), torch.Tensor) else None

    def answer(asked):
        try:
            return propagate(asked, shape, rules, mesh_shape, strict_view)
        except Exception:  # noqa: BLE001 - a layout the rule rejects has no strategy
            return None
    part = _by_axis(rules, answer, len(sizes))
    # A reshape also takes as they are the splits DTensor's rule moves but whose blocks stay
    # contiguous (`views`): after the rule's own, and `late`
    reshape = node.target in RESHAPES
    if part is not None and not reshape and len(outs) == 1 and out_shape is not None:
        return _by_axis_product(part, shape, out_shape, sizes)
    return _asked_layout_by_layout(answer if part is None else functools.partial(_joined, part), shape, out_shape,
                                   sizes, outs, rules if reshape else None)


def _asked_layout_by_layout(answer, shape: tuple, out_shape: tuple | None, sizes: tuple[int, ...], outs: list,
                            rules) -> Fitted:
    """`_from_view_rule`'s strategies asked layout by layout, each layout with its pending sums
    as Replicate (`answer` once per such layout) and the sums put back on both sides; with a
    reshape's `rules`, then those taking as it is a split the rule moves (`contiguous_view`,
    `late`); kept as `fitted` keeps them. Walked on placement codes: a 4-axis view has hundreds of
    layouts, and placements hash slowly."""
    # The rule moves shards only: a pending sum passes a view as it is, where Replicate would (a
    # view is linear, and neither changes a block's shape).
    partial, replicate = _placement_code(Partial("sum")), _placement_code(R)
    n_outs = len(outs)
    answers: dict = {}  # asked codes -> (input codes, output codes) or None, and the same taken as it is
    ruled, late = [], []  # (input codes, output codes), layout by layout
    for codes in _layout_codes(shape, sizes):
        sums = [i for i, c in enumerate(codes) if c == partial]
        asked = tuple(replicate if c == partial else c for c in codes) if sums else codes
        known = answers.get(asked)
        if known is None:
            lay = _layout_of(asked)
            found = answer(lay)
            as_is = None
            if rules is not None and not _takes(found, lay, out_shape, sizes):
                as_is = contiguous_view(rules, shape, lay, sizes)
            known = answers[asked] = tuple(None if f is None else (_codes(f[0]), _codes(f[1])) for f in (found, as_is))
        for into, got in zip((ruled, late), known):
            if got is not None:
                if sums:
                    got = tuple(tuple(codes[i] if i in sums else c for i, c in enumerate(side)) for side in got)
                into.append(got)
    rows = [((i,), (o,) * n_outs, is_late) for made, is_late in ((ruled, False), (late, True)) for i, o in made]
    return _kept(rows, [shape], [None if o is None else tuple(o.shape) for o in outs], sizes)


def _codes(layout) -> tuple[int, ...]:
    return tuple(map(_placement_code, layout))


def _layout_of(codes: tuple[int, ...]) -> Layout:
    """The layout of these placement codes, one object for each in the process."""
    lay = _LAYOUTS.get(codes)
    if lay is None:
        lay = _LAYOUTS[codes] = tuple(_PLACEMENTS_BY_CODE[c] for c in codes)
    return lay


@functools.lru_cache(maxsize=4096)
def _layout_codes(shape: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """`all_layouts(shape, sizes)` as placement codes, in its order."""
    return tuple(map(_codes, all_layouts(shape, sizes)))


def _dim_map_of(asking: "_Asking", dim_map) -> tuple:
    """DTensor's dim map of a view-like node, its arguments read as the rule reads them."""
    args, kwargs = pytree.tree_unflatten(asking.leaves, asking.spec)
    return dim_map(*args, **kwargs)


def _by_axis(rules, answer, k: int):
    """For a rule that only renames dims or adds and drops ones of size 1 (permute, transpose,
    squeeze, unsqueeze: each output dim an input dim or a singleton), `answer` of a layout from
    each axis's placement asked alone, as `part(axis, placement)` -> (the input's placement asked
    for, the output's), or None: DTensor's propagation then treats each mesh axis on its own (a
    split dim stays one dim, with no strides between axes). None for other rules."""
    if not renames_dims_only(rules):
        return None
    alone = {}  # (axis, placement) -> (the input's placement asked for, the output's), or None

    def part(m, p):
        if (m, p) not in alone:
            found = answer(tuple(p if i == m else R for i in range(k)))
            alone[m, p] = None if found is None else (found[0][m], found[1][m])
        return alone[m, p]
    return part


def _joined(part, asked: Layout):
    """`answer(asked)` of a rule `_by_axis` reads axis by axis: (input, output placements) or None."""
    parts = [part(m, p) for m, p in enumerate(asked)]
    if None in parts:
        return None
    return [p for p, _ in parts], [q for _, q in parts]


def _by_axis_product(part, shape: tuple, out_shape: tuple, sizes: tuple[int, ...]) -> Fitted:
    """`_from_view_rule`'s strategies for a rule `_by_axis` reads axis by axis, made as the product
    of each axis's (input, output) placements (`_combined`), not layout by layout: the same
    strategies in the same order (`all_layouts`' order is the product's), each once. A pending sum
    passes as it is where the rule takes Replicate; the layout asked is held to the input's shape,
    as `all_layouts` holds it."""
    rows = []
    for m in range(len(sizes)):
        rows.append([])
        for p in axis_placements(len(shape)):
            pair = part(m, R if type(p) is Partial else p)
            if pair is not None:
                rows[m].append((p, p, p) if type(p) is Partial else (pair[1], pair[0], p))
    # the output, the input, the layout asked (only checked)
    return _axis_product(rows, [out_shape, shape, shape], sizes, 1, [False], n_checked=1)


class _Asking:
    """One node's arguments as DTensor's rule reads them, built once: each question changes one
    input's layout (the others replicated), so only that input's spec is made anew."""

    def __init__(self, node: torch.fx.Node, sizes: tuple[int, ...]):
        self.node, self.mesh = node, planning_mesh(sizes)
        self.leaves, self.spec = pytree.tree_flatten((node.args, node.kwargs))
        self.slots = []  # leaf index of each tensor input, in order
        self.metas = []
        for k, a in enumerate(self.leaves):
            if not isinstance(a, torch.fx.Node):
                continue
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                self.slots.append(k)
                self.metas.append(_meta(v))
                self.leaves[k] = self._strategy(len(self.metas) - 1, replicated(len(sizes)))
            else:
                self.leaves[k] = v
        self.info = propagator().op_to_schema_info.get(node.target)
        self.rule = propagator().op_strategy_funcs[node.target]

    def _strategy(self, i: int, layout: Layout) -> OpStrategy:
        return OpStrategy([OpSpec(DTensorSpec(self.mesh, layout, tensor_meta=self.metas[i]))])

    def ask(self, i: int, layout: Layout, n_outs: int) -> list[Strategy]:
        """DTensor's strategies with input `i` in `layout`, every other input replicated."""
        leaves = list(self.leaves)
        leaves[self.slots[i]] = self._strategy(i, layout)
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        schema = OpSchema(self.node.target, tuple(_tuples(a) for a in args),
                          {k: _tuples(v) for k, v in kwargs.items()}, schema_info=self.info)
        result = self.rule(schema)
        if not isinstance(result, OpStrategy):
            raise NoStrategy(self.node.target)
        found = []
        n_ins = len(self.slots)
        for spec in result.strategies:
            out_specs = spec.output_specs
            out_specs = out_specs if isinstance(out_specs, (tuple, list)) else (out_specs,) * max(n_outs, 1)
            out_lays = tuple(None if s is None else tuple(s.placements) for s in out_specs)[:n_outs]
            in_specs = spec.input_specs if spec.input_specs is not None else (spec.output_spec,) * n_ins
            found.append(Strategy(out_lays, tuple(tuple(s.placements) for s in in_specs)))
        return found


def _tuples(a):
    """A list of tensors' strategies is one TupleStrategy, as DTensor's rules expect."""
    if isinstance(a, (list, tuple)) and a and all(isinstance(x, OpStrategy) for x in a):
        return TupleStrategy(tuple(a))
    return a


def local_args(node: torch.fx.Node, in_layouts: Sequence[Layout], sizes: tuple[int, ...],
               out_layout: Layout | None = None):
    """`(op, args, kwargs)` for the node's local op: shapes rewritten to local blocks by DTensor's
    propagator, as its dispatcher would (squeeze may become squeeze.dims). Tensor inputs stay fx
    Nodes. `out_layout`: the output's layout in the plan, where the op takes its output's shape
    as an argument (`new_zeros`, `expand`, `slice_backward`): that shape is its block there, which
    need not be the layout DTensor's propagator would pick for these inputs (a `new_zeros` of a
    split tensor, made whole)."""
    if not rewrites_shape_args(node.target):
        return node.target, node.args, node.kwargs
    key = (signature(node), tuple(in_layouts), sizes, out_layout)
    if key not in _LOCAL_ARGS:
        _LOCAL_ARGS[key] = _local_args(node, in_layouts, sizes, out_layout)
    op, args, kwargs = _LOCAL_ARGS[key]
    nodes = tensor_inputs(node)
    return op, *torch.fx.node.map_aggregate((args, kwargs), lambda s: nodes[s.index] if type(s) is _Slot else s)


class _Slot:
    """Where the i-th tensor input goes in a cached argument template."""

    def __init__(self, index: int):
        self.index = index


_LOCAL_ARGS: dict = {}


def _local_args(node: torch.fx.Node, in_layouts: Sequence[Layout], sizes: tuple[int, ...],
                out_layout: Layout | None):
    if node.target in RESHAPES and (out := _contiguous_out(node, in_layouts[0], sizes)) is not None:
        return node.target, (_Slot(0), list(local_shape(tuple(node.meta["val"].shape), out, sizes))), {}
    mesh = planning_mesh(sizes)
    layouts = iter(in_layouts)
    args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: DTensorSpec(
        mesh, next(layouts), tensor_meta=_meta(a.meta["val"])) if isinstance(a.meta.get("val"), torch.Tensor)
        else a.meta.get("val"), (node.args, node.kwargs))
    schema = OpSchema(node.target, tuple(args), kwargs,
                      schema_info=propagator().op_to_schema_info.get(node.target))
    sharding = propagator().propagate_op_sharding_non_cached(schema)
    slots = iter(range(len(in_layouts)))
    if not sharding.use_val_from_redistribute_schema or sharding.redistribute_schema is None:
        new_op, args, kwargs = node.target, node.args, node.kwargs
        is_tensor = lambda x: isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)  # noqa: E731
    else:
        new = sharding.redistribute_schema
        new_op, args, kwargs = new.op, tuple(new.args_schema), dict(new.kwargs_schema)
        is_tensor = lambda x: isinstance(x, DTensorSpec)  # noqa: E731
    args, kwargs = pytree.tree_map(lambda x: _Slot(next(slots)) if is_tensor(x) else x, (args, kwargs),
                                   is_leaf=is_tensor)
    at = propagator().op_to_shape_and_stride_idx.get(node.target)
    chosen = sharding.output_spec
    if at is not None and out_layout is not None and isinstance(chosen, DTensorSpec) and \
            tuple(chosen.placements) != tuple(out_layout):  # the plan's output layout, not the propagator's
        at = at if isinstance(at, int) else at[0]
        args = (*args[:at], list(local_shape(tuple(node.meta["val"].shape), out_layout, sizes)), *args[at + 1:])
    return new_op, args, kwargs


def _contiguous_out(node: torch.fx.Node, layout: Layout, sizes: tuple[int, ...]) -> Layout | None:
    """The output layout of a reshape that takes `layout` as it is where DTensor's rule would not
    (`views.contiguous_view`), else None: DTensor's propagator writes the local shape then."""
    dim_map, strict_view, propagate = view_rule(node.target)
    shape = tuple(node.args[0].meta["val"].shape)
    rules = _dim_map_of(_Asking(node, sizes), dim_map)
    asked = tuple(R if isinstance(p, Partial) else p for p in layout)
    try:
        theirs = propagate(asked, shape, rules, planning_mesh(sizes).shape, strict_view)
    except Exception:  # noqa: BLE001 - a layout the rule rejects: ours may take it
        theirs = None
    if _takes(theirs, asked, tuple(node.meta["val"].shape), sizes):
        return None
    found = contiguous_view(rules, shape, asked, sizes)
    return None if found is None else found[1]


def _takes(answer, asked: Layout, out_shape, sizes) -> bool:
    """Whether DTensor's answer for a reshape takes `asked` as it is, to a layout a program can
    hold (no `_StridedShard`, every split dim dividing evenly)."""
    return answer is not None and tuple(answer[0]) == asked and out_shape is not None and fits(
        tuple(answer[1]), out_shape, sizes)
