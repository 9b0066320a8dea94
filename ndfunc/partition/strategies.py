"""Candidate strategies per graph node, from DTensor's own sharding rules.

A `Strategy` says, for one way of running a node on the mesh, the layout of each tensor output and
the layout each tensor input must arrive in. DTensor registers rules two ways and we read both:
single-dim rules (placements valid along one mesh axis; we take their product over the axes) and
full op strategies (called with every layout each input could have). Ops DTensor has no rule for,
but ndfunc needs, get one here: CPU flash attention (batch or heads split), factories (built
replicated), and `ndfunc.*` ops. Results are cached by op, input shapes and other arguments, so a
model's repeated layers cost one lookup each.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    TupleStrategy,
)
from torch.nn import _reduction
from torch.utils import _pytree as pytree

from ndfunc import manual
from ndfunc.partition.layout import MANUAL, Layout, all_layouts, fits, replicated

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Strategy:
    outs: tuple[Layout | None, ...]  # per tensor output (None: an output the op leaves empty)
    ins: tuple[Layout, ...]  # per tensor input, in `tensor_inputs` order


class NoStrategy(Exception):
    """DTensor has no sharding rule for this op (and ndfunc adds none)."""


def propagator():
    return DTensor._op_dispatcher.sharding_propagator


@functools.cache
def planning_mesh(sizes: tuple[int, ...]) -> DeviceMesh:
    """A DeviceMesh of `sizes` with no process group: strategies need only its shape."""
    return DeviceMesh("cpu", torch.arange(math.prod(sizes)).view(sizes), _init_backend=False, _rank=0)


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's tensor-valued inputs, in the order DTensor's OpSchema lists them."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def tensor_outputs(node: torch.fx.Node) -> list[torch.Tensor | None]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def _signature(node: torch.fx.Node) -> tuple:
    """What a node's strategies depend on: its op, its tensors' shapes and dtypes, other args."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    key = []
    for a in leaves:
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            key.append((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("N", repr(v)))
        else:
            key.append(a if isinstance(a, (int, float, bool, str, type(None))) else repr(a))
    return (node.target, str(spec), tuple(key))


def candidates(node: torch.fx.Node, sizes: tuple[int, ...]) -> list[Strategy]:
    """Every strategy for `node` on a mesh of `sizes` whose layouts fit the values' shapes."""
    if node.meta.get("ndfunc_manual") or node.target is manual.exit_op:
        return _manual_rule(node, sizes)
    cache = _CACHE.setdefault(sizes, {})
    # a sharding constraint's layout (its own, or an input's) is resolved on the mesh: the same
    # spec is another layout on another mesh of these sizes (('dp_replicate', 'dp_shard') on dp=4
    # or on tp=4)
    layouts = (node.meta.get("ndfunc_layout"), *(a.meta.get("ndfunc_layout") for a in tensor_inputs(node)))
    sig = (_signature(node), repr(node.meta.get("ndfunc_ring")), repr(layouts))
    if sig not in cache:
        cache[sig] = _candidates(node, sizes)
    return cache[sig]


_CACHE: dict[tuple[int, ...], dict] = {}


def _candidates(node: torch.fx.Node, sizes: tuple[int, ...]) -> list[Strategy]:
    op = node.target
    ins = tensor_inputs(node)
    outs = tensor_outputs(node)
    k = len(sizes)
    if k == 0:  # nothing to partition over: every op runs whole
        return _replicated_rule(node, sizes)
    if op in _OWN_RULES:
        found = _OWN_RULES[op](node, sizes)
    elif not ins:
        found = [Strategy(tuple(None if o is None else replicated(k) for o in outs), ())]
    elif op in propagator().op_single_dim_strategy_funcs:
        found = _from_single_dim(node, ins, outs, sizes)
    elif op in propagator().op_strategy_funcs:
        found = _from_op_strategy(node, ins, outs, sizes)
    elif all(_constrained_replicated(a) for a in ins):
        found = _replicated_rule(node, sizes)  # no rule, but the user replicated every input
    else:
        raise NoStrategy(op)
    shapes_in = [tuple(a.meta["val"].shape) for a in ins]
    shapes_out = [None if o is None else tuple(o.shape) for o in outs]
    kept, seen = [], set()
    for s in found:
        if len(s.ins) != len(ins) or len(s.outs) != len(outs) or s in seen:
            continue
        if all(fits(lay, shp, sizes) for lay, shp in zip(s.ins, shapes_in)) and all(
                shp is None or (lay is not None and fits(lay, shp, sizes)) for lay, shp in zip(s.outs, shapes_out)):
            kept.append(s)
            seen.add(s)
    if not kept:
        raise NoStrategy(op)
    return kept


def _constrained_replicated(a: torch.fx.Node) -> bool:
    from ndfunc.constraints import sharding_constraint_op

    layout = a.meta.get("ndfunc_layout")
    return a.target is sharding_constraint_op and layout is not None and all(
        isinstance(p, Replicate) for p in layout)


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
    found = []
    for combo in itertools.product(rules, repeat=len(sizes)):
        cols = list(zip(*combo))  # per tensor: its placement on each mesh axis
        out_lays = tuple(None if o is None else tuple(cols[i]) for i, o in enumerate(outs))
        in_lays = tuple(tuple(c) for c in cols[len(outs):])
        found.append(Strategy(out_lays, in_lays))
    return found


def _from_op_strategy(node, ins, outs, sizes) -> list[Strategy]:
    """DTensor's full op strategies expect each input to arrive in one layout (they follow it).
    Ask once per layout of each input, the others replicated, and pool the answers."""
    found: list[Strategy] = []
    errors = []
    for i, a in enumerate(ins):
        for lay in all_layouts(tuple(a.meta["val"].shape), sizes):
            given = [replicated(len(sizes))] * len(ins)
            given[i] = lay
            try:
                found += _ask(node, given, len(outs), sizes)
            except Exception as e:  # noqa: BLE001 - a layout the rule rejects has no strategy
                errors.append(e)
    if not found:
        raise NoStrategy(node.target) from (errors[0] if errors else None)
    return found


def _ask(node, given: list[Layout], n_outs: int, sizes) -> list[Strategy]:
    mesh = planning_mesh(sizes)
    layouts = iter(given)

    def strategy_for(a: torch.fx.Node):
        return OpStrategy([OpSpec(DTensorSpec(mesh, next(layouts), tensor_meta=_meta(a.meta["val"])))])

    args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: strategy_for(a) if isinstance(
        a.meta.get("val"), torch.Tensor) else a.meta.get("val"), (node.args, node.kwargs))

    def tuples(a):  # a list of tensors is one TupleStrategy, as DTensor's rules expect
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, OpStrategy) for x in a):
            return TupleStrategy(tuple(a))
        return a

    schema = OpSchema(node.target, tuple(tuples(a) for a in args), {k: tuples(v) for k, v in kwargs.items()},
                      schema_info=propagator().op_to_schema_info.get(node.target))
    result = propagator().op_strategy_funcs[node.target](schema)
    if not isinstance(result, OpStrategy):
        raise NoStrategy(node.target)
    found = []
    n_ins = len(given)
    for spec in result.strategies:
        out_specs = spec.output_specs
        out_specs = out_specs if isinstance(out_specs, (tuple, list)) else (out_specs,) * max(n_outs, 1)
        out_lays = tuple(None if s is None else tuple(s.placements) for s in out_specs)[:n_outs]
        in_specs = spec.input_specs if spec.input_specs is not None else (spec.output_spec,) * n_ins
        found.append(Strategy(out_lays, tuple(tuple(s.placements) for s in in_specs)))
    return found


# --- ndfunc's own rules ------------------------------------------------------------------------

def _attention_rule(node, sizes) -> list[Strategy]:
    """Flash attention (CPU) forward and backward: q, k, v (B, H, L, K) split alike on batch or
    heads (grouped key/value heads split by the same factor); the mask follows where it has the
    dim, else stays whole; logsumexp (B, H, L) follows q.

    With an explicit mask (not `is_causal`, whose mask assumes the block starts at position 0) the
    sequence may be split too: each rank's queries against every key and value (gathered), the mask's
    rows following the queries; in backward the key and value gradients are then partial sums
    over that axis. On the axis `nf.ring_attention` marked, keys and values (and their gradients)
    stay split instead: the lowering writes a ring there."""
    backward = "backward" in str(node.target)
    ins = tensor_inputs(node)
    outs = tensor_outputs(node)
    q = node.args[1] if backward else node.args[0]
    kv = {node.args[2], node.args[3]} if backward else {node.args[1], node.args[2]}
    causal = node.args[7] if backward else (node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False))
    q_shape = tuple(q.meta["val"].shape)
    seq = Shard(2)
    ring = (node.meta.get("ndfunc_ring") or {}).get("live")  # nf.ring_attention's axis: keys stay split
    per_axis = [Replicate(), Shard(0), Shard(1)] + ([] if causal else [seq])
    # on the ring's axis the sequence is what is split (else the cheapest plan may well split the
    # batch there instead, which is data parallelism, not context parallelism)
    options = [[seq] if axis == ring else per_axis for axis in range(len(sizes))]
    found = []
    for combo in itertools.product(*options):
        def follow(t: torch.Tensor | None, key_side: bool, grad: bool = False):
            if t is None:
                return None
            lay = []
            for axis, p in enumerate(combo):
                if p == seq and key_side and axis == ring:
                    lay.append(seq)  # keys, values and their gradients travel the ring
                elif p == seq and key_side:
                    lay.append(Partial("sum") if grad else Replicate())  # every key, each rank's queries
                elif isinstance(p, Shard) and (t.ndim <= p.dim or t.shape[p.dim] != q_shape[p.dim]) and not (
                        p.dim == 1 and t.ndim == 4 and t.shape[1] > 1):
                    lay.append(Replicate())  # a broadcast mask dim: every block needs all of it
                else:
                    lay.append(p)
            return tuple(lay)
        out_lays = tuple(follow(o, backward and j in (1, 2), grad=True) for j, o in enumerate(outs))
        found.append(Strategy(out_lays, tuple(follow(a.meta["val"], a in kv) for a in ins)))
    return found


def _manual_rule(node, sizes) -> list[Strategy]:
    """Inside a shard_map region every value is a rank's own block; a value from outside it
    (a captured constant) comes whole. The region's entry and exit have the specs' layouts."""
    from ndfunc.partition.solve import value_of

    k = len(sizes)
    outs = tensor_outputs(node)
    if node.target is manual.enter_op:
        return [Strategy((MANUAL,), (node.meta["ndfunc_layout"],))]
    if node.target is manual.exit_op:
        return [Strategy((node.meta["ndfunc_layout"],), (MANUAL,))]
    ins = tuple(MANUAL if value_of(a)[0].meta.get("ndfunc_manual") else replicated(k) for a in tensor_inputs(node))
    return [Strategy(tuple(None if o is None else MANUAL for o in outs), ins)]


def _constraint_rule(node, sizes) -> list[Strategy]:
    lay = node.meta["ndfunc_layout"]
    return [Strategy((lay,), (lay,))]


def _replicated_rule(node, sizes) -> list[Strategy]:
    k = len(sizes)
    return [Strategy(tuple(None if o is None else replicated(k) for o in tensor_outputs(node)),
                     tuple(replicated(k) for _ in tensor_inputs(node)))]


def _mean_loss_rule(node, sizes) -> list[Strategy]:
    """DTensor's rule for an `nll_loss` forward, less its sharded mean: that averages each rank's
    own mean, the batch's only when every rank ignores as many targets. (The tracer writes a
    float32 or float64 mean as a sum over a count, which shards; this is the mean it leaves.)"""
    found = _from_op_strategy(node, tensor_inputs(node), tensor_outputs(node), sizes)
    if node.args[3] != _reduction.get_enum("mean"):
        return found
    return [s for s in found if not any(isinstance(p, Partial) for p in s.outs[0])]


def _own_rules() -> dict:
    from ndfunc.constraints import sharding_constraint_op
    from ndfunc.random._op import random_block_op

    return {
        aten._scaled_dot_product_flash_attention_for_cpu.default: _attention_rule,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _attention_rule,
        sharding_constraint_op: _constraint_rule,
        aten.nll_loss_forward.default: _mean_loss_rule,
        aten.nll_loss2d_forward.default: _mean_loss_rule,
        random_block_op: _replicated_rule,  # whole, from the key: every rank computes it
    }


_OWN_RULES = _own_rules()


def needs_local_args(op) -> bool:
    """Whether DTensor rewrites this op's non-tensor arguments (shapes) for local blocks."""
    p = propagator()
    return op in p.op_to_shape_and_stride_idx or op in p.op_to_scalar_shape_adjuster or op in p.squeeze_op_to_dims_variant


def local_args(node: torch.fx.Node, in_layouts: Sequence[Layout], sizes: tuple[int, ...]):
    """`(op, args, kwargs)` for the node's local op: shapes rewritten to local blocks by DTensor's
    propagator, as its dispatcher would (squeeze may become squeeze.dims). Tensor inputs stay fx
    Nodes."""
    if not needs_local_args(node.target):
        return node.target, node.args, node.kwargs
    key = (_signature(node), tuple(in_layouts), sizes)
    if key not in _LOCAL_ARGS:
        _LOCAL_ARGS[key] = _local_args(node, in_layouts, sizes)
    op, args, kwargs = _LOCAL_ARGS[key]
    nodes = tensor_inputs(node)
    return op, *pytree.tree_map_only(_Slot, lambda s: nodes[s.index], (args, kwargs))


class _Slot:
    """Where the i-th tensor input goes in a cached argument template."""

    def __init__(self, index: int):
        self.index = index


_LOCAL_ARGS: dict = {}


def _local_args(node: torch.fx.Node, in_layouts: Sequence[Layout], sizes: tuple[int, ...]):
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
    return new_op, args, kwargs

