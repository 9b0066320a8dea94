"""The op registry: everything ndfunc knows about an op beyond DTensor's own sharding rules.

One `OpRule` per op, registered in this file and nowhere else:

    strategies(node, sizes) -> [Strategy]   ndfunc's sharding rule (else DTensor's is read)
    flops(node) -> int                       the work, where torch's flop counter has no formula
    saved_by_remat                           `nf.remat(policy='save_dots')` keeps its result
    lower(emitter, node, locals) -> Node     its local op, where that is not the op on blocks
    local(node, args) -> args                the op on blocks, with other arguments than the
                                             traced ones (attention: the mesh device's kernel)

`candidates(node, sizes)` is what the partitioner asks: the registered rule, else DTensor's
(`ndfunc._src.partition.planning.strategies`), else the op whole: its inputs replicated (gathered
where they are sharded, which the solver prices like any other move), its outputs replicated. No
op is refused. Before that, tracing decomposes every op with no rule that PyTorch's core ATen
decompositions cover (`decompositions()`: `mse_loss` into `sub`, `pow`, `mean`), so what runs
whole is only what has neither; `runs_whole` tells the pipeline which nodes those are, and it warns.

Adding a rule for an op is one `register(op, ...)` call at the end of this file; see
docs/models.md, "Adding an op rule".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.nn import _reduction

from ndfunc._src import attention, cast_ops, dot, manual, opaque
from ndfunc._src import ctc_loss, experts, rnn  # noqa: F401 (importing them fills opaque.OPS)
from ndfunc._src.constraints import sharding_constraint_op
from ndfunc._src.copy_slices import copied_in_order, dense_order
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.planning import attention_rule, dots, redistribute
from ndfunc._src.partition.planning.layout import (
    MANUAL,
    all_layouts,
    fits,
    local_shape,
    replicated,
    subset_products,
)
from ndfunc._src.partition.planning.strategies import (
    Fitted,
    NoStrategy,
    Strategy,
    fitted,
    from_dtensor,
    per_axis,
    from_op_strategy,
    inputs_and_signature,
    tensor_inputs,
    tensor_outputs,
    value_of,
)
from ndfunc._src.torch_compat import core_aten_decompositions, decomposition_table
from ndfunc._src.torch_compat import sharding_propagator as propagator
from ndfunc.random._op import random_block_at_op, random_block_op, threefry_op

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class OpRule:
    """What ndfunc knows of one op (see the module's text); every field may be left out."""

    strategies: Callable | None = None
    flops: Callable[[torch.fx.Node], int] | None = None
    attention: bool = False  # its flops are attention's (a program's time prices them at its kernels' rate)
    executed: Callable[[torch.fx.Node], float] | None = None  # the share of its flops the slowest rank runs
    saved_by_remat: bool = False
    lower: Callable | None = None
    local: Callable | None = None


_RULES: dict = {}


def register(op, **fields) -> None:
    """Register what ndfunc knows of `op` (an OpOverload, or a transform's local function that a
    lowered program calls: its `flops`): `OpRule`'s fields."""
    if op in _RULES:
        raise ValueError(f"{op} has an OpRule already; change that registration instead of adding one.")
    _RULES[op] = OpRule(**fields)


# Rules of ops that exist only once a library defines them (transformers' custom ops), by their
# qualified name: taken into the registry when the partitioner first asks for the op's rule (`rule_of`)
_BY_NAME: dict[str, OpRule] = {}


def register_by_name(name: str, **fields) -> None:
    """`register` for the op `name` ("namespace::op", its default overload), which may not exist yet."""
    _BY_NAME[name] = OpRule(**fields)


def rule_of(op) -> OpRule | None:
    """The registered rule of `op` (one registered by name taken in the first time it is asked), or None."""
    rule = _RULES.get(op)
    if rule is None and isinstance(op, torch._ops.OpOverload) and op._name in _BY_NAME:
        rule = _RULES[op] = _BY_NAME.pop(op._name)
    return rule


def saved_by_remat(op) -> bool:
    rule = rule_of(op)
    return rule is not None and rule.saved_by_remat


def has_rule(op) -> bool:
    """Whether ndfunc (this registry) or DTensor has a sharding rule for `op`."""
    table = propagator()
    ours = rule_of(op)
    return (ours is not None and ours.strategies is not None) or op in table.op_single_dim_strategy_funcs \
        or op in table.op_strategy_funcs


# Ops whose core decomposition computes another thing than the kernel its backward pairs with:
# CPU flash attention's gives the attention weights where the kernel gives the logsumexp, which
# the flash backward reads (correct only where nothing differentiates it). An SDPA call that
# `nf.jit`'s tracer does not see as such (inside a function torch dispatches as a whole, as
# `nn.MultiheadAttention`'s) reaches these; without dropout the tracer makes it `ndfunc.attention`
# (`attention.cpu_flash_as_attention`), with dropout it runs whole, and warns.
NOT_DECOMPOSED = frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default})


@functools.cache
def decompositions() -> dict:
    """PyTorch's core ATen decompositions of the ops on tensors that have no sharding rule: traced as
    the ops they decompose into, which mostly have one. (Factories, with no tensor argument, need no
    rule: every rank makes them whole.) And those of `DECOMPOSED`, whose rules cannot split the work."""
    table = {op: fn for op, fn in core_aten_decompositions().items()
             if isinstance(op, torch._ops.OpOverload) and _takes_tensors(op) and not has_rule(op)
             and op not in NOT_DECOMPOSED}
    also = {op: decomposition_table[op] for op in ALSO_DECOMPOSED if not has_rule(op)}
    return table | also | {op: decomposition_table[op] for op in DECOMPOSED} | {
        aten.var_mean.correction: _var_mean, aten.mean.default: _mean}


def _mean(x, dtype=None):
    """A mean of everything (a loss) as a sum over the count: the sum of a split value is a partial
    sum per rank, one all-reduce of a scalar, where DTensor's rule for the mean gathers the value."""
    return x.sum(dtype=dtype) / x.numel()


def _var_mean(x, dim=None, *, correction=1, keepdim=False):
    """Variance and mean as two sums (the mean, then the squares about it): each splits over a
    sharded dim as a partial sum, where ATen's one-pass `var_mean` (and so BatchNorm's statistics)
    has no sharded rule."""
    dims = list(range(x.ndim)) if dim is None else [d % x.ndim for d in dim]
    count = math.prod(x.shape[d] for d in dims)
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).square().sum(dims, keepdim=keepdim) / max(count - (correction or 0), 0)
    return var, mean if keepdim else mean.squeeze(dims)


# Ops with a rule that runs them whole over the dim the data is split on: BatchNorm's statistics
# need every sample, so DTensor's rule gathers the batch (a CNN under DP would compute all of it on
# every rank). Decomposed, the statistics are sums over the batch, which split like any other sum
# (a partial sum per rank, then one all-reduce of the channels' sums), and the running statistics
# are written by `copy_`.
DECOMPOSED = (aten.native_batch_norm.default, aten.native_batch_norm_backward.default,
              # a max, a sum of exponentials and their log: each splits over the classes (a pending
              # max or sum per rank), so a cross-entropy's logits stay split over the vocabulary
              aten._log_softmax.default, aten._log_softmax_backward_data.default)
# Ops with no rule whose decompositions are not among the core ones: traced as the ops they
# decompose into (a scaled product and sum, a norm of a difference, BatchNorm's backward called
# directly), not run whole
ALSO_DECOMPOSED = (aten.addmv.default, aten.dist.default, aten.batch_norm_backward.default)


def _takes_tensors(op) -> bool:
    return any(isinstance(a.type, (torch.TensorType, torch.ListType, torch.OptionalType))
               and "Tensor" in str(a.type) for a in op._schema.arguments)


def runs_whole(node: torch.fx.Node, sizes: tuple[int, ...], sig: tuple | None = None) -> bool:
    """Whether `node` runs whole for want of a sharding rule (`candidates` fell back to it).
    `sig`: `strategy_key(node)[0]`, where the caller has it."""
    if node.op != "call_function" or not sizes or prog.is_manual(node) or not tensor_inputs(node):
        return False
    sig = _sig(node) if sig is None else sig
    candidates(node, sizes, sig)
    return sig in _WHOLE.get(sizes, ())


# --- what the partitioner asks -------------------------------------------------------------------

def candidates(node: torch.fx.Node, sizes: tuple[int, ...], sig: tuple | None = None) -> Sequence[Strategy]:
    """Every strategy for `node` on a mesh of `sizes` whose layouts fit the values' shapes.
    `sig`: `strategy_key(node)[0]`, where the caller has it (the partitioner reads each node's
    once, for its plan's key, its candidates and which nodes run whole)."""
    if prog.is_manual(node) or node.target is manual.exit_op:
        return _manual_rule(node, sizes)
    cache = _CACHE.setdefault(sizes, {})
    # a sharding constraint's layout (its own, or an input's) is resolved on the mesh: the same
    # spec is another layout on another mesh of these sizes (('dp_replicate', 'dp_shard') on dp=4
    # or on tp=4)
    sig = _sig(node) if sig is None else sig
    known = cache.get(sig)  # (a signature is a deep tuple: hashed once where it is known)
    if known is not None:
        return known
    alike = _pointwise_key(node, sig, sizes)
    if alike is not None and alike in cache:
        cache[sig] = cache[alike]
        return cache[sig]
    try:
        cache[sig] = _candidates(node, sizes)
    except NoStrategy:  # no rule, or none that fits these shapes: the op whole
        cache[sig] = _replicated_rule(node, sizes)
        if not all(_constrained_replicated(a) for a in tensor_inputs(node)):  # (else the user chose it)
            _WHOLE.setdefault(sizes, set()).add(sig)
    else:
        if alike is not None:
            cache[alike] = cache[sig]
    return cache[sig]


def _pointwise_key(node: torch.fx.Node, sig: tuple, sizes: tuple[int, ...]) -> tuple | None:
    """For a pointwise op answered by DTensor's single-dim rule: a key shared by the nodes whose
    candidate lists are the same, None for any other op. The rule reads the shapes only as they
    broadcast (which dims are 1), and the candidates keep a split where its ranks divide the dim:
    so each dim is read as whether it is 1 and which products of the mesh's sizes divide it. An
    optimizer's update over parameters of many shapes asks once per such key, not per shape."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.pointwise not in op.tags or op in _RULES or (
            op not in propagator().op_single_dim_strategy_funcs):
        return None
    products = subset_products(sizes)
    (target, spec, args), *rest = sig

    def dim(d: int) -> tuple:
        return (d == 1, *(d % q == 0 for q in products))
    read = tuple((tuple(map(dim, a[0])), a[1]) if type(a) is tuple and len(a) == 2 and type(a[0]) is tuple else a
                 for a in args)
    return ("pointwise", (target, spec, read), *rest)


def strategy_key(node: torch.fx.Node) -> tuple:
    """Everything `candidates(node, sizes)` depends on besides the sizes: equal keys, equal lists."""
    return (_sig(node), prog.is_manual(node))


def _sig(node: torch.fx.Node) -> tuple:
    ins, sig = inputs_and_signature(node)
    layouts = (prog.constraint_layout(node), *(prog.constraint_layout(a) for a in ins))
    return (sig, repr(prog.kept_split(node)), repr(layouts))


_CACHE: dict[tuple[int, ...], dict] = {}
_WHOLE: dict[tuple[int, ...], set] = {}  # signatures that run whole for want of a rule


def _candidates(node: torch.fx.Node, sizes: tuple[int, ...]) -> Sequence[Strategy]:
    op = node.target
    ins = tensor_inputs(node)
    outs = tensor_outputs(node)
    k = len(sizes)
    if k == 0:  # nothing to partition over: every op runs whole
        return _replicated_rule(node, sizes)
    rule = rule_of(op)
    if rule is not None and rule.strategies is not None:
        found = rule.strategies(node, sizes)
    elif (found := from_dtensor(node, ins, outs, sizes)) is None:
        raise NoStrategy(op)
    if isinstance(found, Fitted):
        if not found:
            raise NoStrategy(op)
        return found
    kept = fitted(found, [tuple(a.meta["val"].shape) for a in ins], [None if o is None else tuple(o.shape) for o in outs],
                  sizes)
    if not kept:
        raise NoStrategy(op)
    return kept


def _constrained_replicated(a: torch.fx.Node) -> bool:
    layout = prog.constraint_layout(a)
    return a.target is sharding_constraint_op and layout is not None and all(
        isinstance(p, Replicate) for p in layout)


def _manual_rule(node, sizes) -> list[Strategy]:
    """Inside a shard_map region every value is a rank's own block; a value from outside it
    (a captured constant) comes whole. The region's entry and exit have the specs' layouts."""
    k = len(sizes)
    outs = tensor_outputs(node)
    if node.target is manual.enter_op:
        return [Strategy((MANUAL,), (prog.constraint_layout(node),))]
    if node.target is manual.exit_op:
        return [Strategy((prog.constraint_layout(node),), (MANUAL,))]
    ins = tuple(MANUAL if prog.is_manual(value_of(a)[0]) else replicated(k) for a in tensor_inputs(node))
    return [Strategy(tuple(None if o is None else MANUAL for o in outs), ins)]


def _constraint_rule(node, sizes) -> list[Strategy]:
    lay = prog.constraint_layout(node)
    return [Strategy((lay,), (lay,))]


def _replicated_rule(node, sizes) -> list[Strategy]:
    k = len(sizes)
    return [Strategy(tuple(None if o is None else replicated(k) for o in tensor_outputs(node)),
                     tuple(replicated(k) for _ in tensor_inputs(node)))]


def _mean_loss_rule(node, sizes) -> list[Strategy]:
    """DTensor's rule for an `nll_loss` forward, less its sharded mean: that averages each rank's
    own mean, the batch's only when every rank ignores as many targets. (The tracer writes a
    float32 or float64 mean as a sum over a count, which shards; this is the mean it leaves.)"""
    found = from_op_strategy(node, tensor_inputs(node), tensor_outputs(node), sizes)
    if node.args[3] != _reduction.get_enum("mean"):
        return found
    return [s for s in found if not any(isinstance(p, Partial) for p in s.outs[0])]


def _leading_dims_rule(trailing: int) -> Callable:
    """The rule of an op computed over its tensors' last `trailing` dims, each leading dim (a
    sample, a channel) on its own: any split of the leading dims, the same for every tensor
    (replication padding's backward, which PyTorch neither splits nor decomposes)."""
    def rule(node, sizes) -> list[Strategy]:
        out, ins = tensor_outputs(node)[0], [x.meta["val"] for x in tensor_inputs(node)]
        lead = out.dim() - trailing
        return [Strategy((lay,), tuple(lay for _ in ins))
                for lay in all_layouts(tuple(out.shape), sizes, partial=False)
                if all(not isinstance(p, Shard) or p.dim < lead for p in lay)
                and all(x.dim() == out.dim() and fits(lay, tuple(x.shape), sizes) for x in ins)]
    return rule


def _cdist_rule(node, sizes) -> Fitted:
    """Distances between the rows of x1 and of x2 (`torch.cdist` at sizes where ATen takes the
    direct kernel; above them it is matmuls), per mesh axis: whole, split alike by a batch dim, by
    x1's rows (x2 whole) or by x2's rows (x1 whole). Its backward (`x1`'s gradient: a sum over x2's
    rows) likewise, where a split of x2's rows leaves that sum pending. Batch dims that broadcast:
    whole."""
    backward = node.target is aten._cdist_backward.default
    x1, x2 = (a.meta["val"] for a in node.args[int(backward):][:2])
    if x1.shape[:-2] != x2.shape[:-2]:
        raise NoStrategy(node.target)
    tensors = [node.meta["val"], *(a.meta["val"] for a in tensor_inputs(node))]
    d, whole = x1.dim() - 2, Replicate()  # d: the rows' dim
    if backward:  # x1's gradient; the distances' gradient, x1, x2, the distances
        split = [(Shard(d), Shard(d), Shard(d), whole, Shard(d)),
                 (Partial("sum"), Shard(d + 1), whole, Shard(d), Shard(d + 1))]
    else:  # the distances; x1, x2
        split = [(Shard(d), Shard(d), whole), (Shard(d + 1), whole, Shard(d))]
    rules = [(whole,) * len(tensors), *((Shard(b),) * len(tensors) for b in range(d)), *split]
    return per_axis(rules, [tuple(t.shape) for t in tensors], sizes, 1)


def _solve_triangular_rule(node, sizes) -> list[Strategy]:
    """DTensor's strategies for `linalg.solve_triangular(A, B)` less those splitting a batch dim of
    B (and of the solution) where A, whole, has that dim and does not broadcast it: DTensor's rule
    takes A as broadcast there, so each rank solved its block of B against every matrix of A."""
    found = from_dtensor(node, tensor_inputs(node), tensor_outputs(node), sizes)
    a, b = (x.meta["val"] for x in tensor_inputs(node))
    lead = b.dim() - a.dim()  # (batch dims align from the right)

    def broadcasts(s) -> bool:
        return all(not (isinstance(p, Shard) and p.dim < b.dim() - 2 and isinstance(q, Replicate)
                        and p.dim >= lead and a.shape[p.dim - lead] != 1) for q, p in zip(*s.ins))
    return [s for s in found if broadcasts(s)]


def _unfold_rule(node, sizes) -> Fitted:
    """`Tensor.unfold` (sliding windows along a dim, as a new last dim) and its backward, per mesh
    axis: whole, or split alike along a dim other than the windowed one (each keeps its place)."""
    backward = node.target is aten.unfold_backward.default
    dim = node.args[2 if backward else 1] % len(node.meta["val"].shape if backward else node.args[0].meta["val"].shape)
    tensors = [node.meta["val"], *(a.meta["val"] for a in tensor_inputs(node))]
    rules = [(Replicate(),) * len(tensors), *((Shard(d),) * len(tensors) for d in range(tensors[-1].dim() - backward)
                                            if d != dim)]
    return per_axis(rules, [tuple(t.shape) for t in tensors], sizes, 1)


def _as_strided(emitter, node, locals_):
    """`as_strided` (with no rule: whole) reads its input's memory, not its elements. Over a copy the
    plan moved for it (a gathered block, contiguous) it read another layout's memory: that input is
    laid out first as it was traced (its dims in that memory order), where its elements filled
    their storage; refused where they did not (the strides name memory no copy has)."""
    x = tensor_inputs(node)[0]
    local, was, made = locals_[0], x.meta["val"], value_of(x)
    want = emitter.plan.strategy[node].ins[0]
    if not prog.is_manual(node) and emitter.plan.strategy[made[0]].outs[made[1]] != want:  # moved
        order = dense_order(was)
        if order is None or was.storage_offset() != 0:
            raise NotImplementedError(
                f"{node.target} views {x.name} by its strides, which the partitioner moves for it "
                f"({emitter.plan.strategy[made[0]].outs[made[1]]} there, {want} here) and whose elements do not fill "
                f"their storage: the moved copy's memory is laid out otherwise. Write the view with slices, "
                f"transposes and reshapes (x.unfold for sliding windows), or run it inside nf.shard_map.")
        if order != sorted(order):
            local = copied_in_order(emitter.call, local, order)
    out = emitter.call(node.target, local, *node.args[1:], **node.kwargs)
    val = node.meta["val"]
    return prog.note_local(out, tuple(val.shape), val.dtype)


def _unfold_backward(emitter, node, locals_):
    """`unfold_backward` on blocks: the input's shape it takes, its block's."""
    val = node.meta["val"]
    shape = local_shape(tuple(val.shape), emitter.plan.strategy[node].outs[0], emitter.sizes)
    out = emitter.call(aten.unfold_backward.default, locals_[0], list(shape), *node.args[2:])
    return prog.note_local(out, shape, val.dtype)


def _grouped_mm_fallback_rule(node, sizes) -> Fitted:
    """transformers' grouped matmul of a mixture of experts in float32 (`grouped_mm_fallback(input
    (tokens, K) sorted by expert, weight (experts, K, N), offs)`) and its backward (the input's and
    the weight's gradients), per mesh axis: whole, or the experts' weights split by their columns
    N (the output's too), or by the contracted K (the input's too, the output a pending sum). Never
    the tokens: each expert's run of them is read off `offs`, a value."""
    R, P, S1, S2 = Replicate(), Partial("sum"), Shard(1), Shard(2)
    if node.target._name.endswith("_backward"):  # grad input, grad weight; input, weight, offs, grad output
        rules = [(R,) * 6, (P, S2, R, S2, R, S1), (S1, S1, S1, S1, R, R)]
    else:  # output; input, weight, offs
        rules = [(R,) * 4, (S1, R, S2, R), (P, S1, S1, R)]
    outs = tensor_outputs(node)
    shapes = [tuple(t.shape) for t in (*outs, *(a.meta["val"] for a in tensor_inputs(node)))]
    return per_axis(rules, shapes, sizes, len(outs))


def _scatter_reduce_rule(node, sizes) -> Fitted:
    """`scatter_reduce` (a maximum per bag: `F.embedding_bag`'s by offsets), per mesh axis: whole,
    or split alike along a dim other than the one it scatters over, where the index and the source
    are as long as the tensor there (their blocks then meet the tensor's)."""
    into, index, src = (a.meta["val"] for a in tensor_inputs(node))
    dim = node.args[1] % into.dim()
    whole = (Replicate(),) * 4  # the result; the tensor, the index, the source
    dims = [d for d in range(into.dim()) if d != dim and into.shape[d] == index.shape[d] == src.shape[d]]
    shapes = [tuple(t.shape) for t in (node.meta["val"], into, index, src)]
    return per_axis([whole, *((Shard(d),) * 4 for d in dims)], shapes, sizes, 1)


def _split_along(dims_of: Callable[[torch.fx.Node], tuple[list, list]]) -> Callable:
    """A rule, per mesh axis: whole, or each tensor split along the dim `dims_of(node)` gives for it
    ((outputs, inputs); None: a weight, whole, and its gradient each rank's sum over its own part,
    pending): an opaque op's (`opaque.OPS`): `ndfunc::rnn` by the batch, `ndfunc::ctc_losses` by the
    samples, `ndfunc::experts` by the tokens."""
    def rule(node, sizes) -> Fitted:
        made, read = dims_of(node)
        tensors = [*tensor_outputs(node), *(a.meta["val"] for a in tensor_inputs(node))]
        split = tuple(Shard(d) if d is not None else Partial("sum") if i < len(made) else Replicate()
                      for i, d in enumerate(made + read))
        return per_axis([(Replicate(),) * len(tensors), split], [tuple(t.shape) for t in tensors], sizes, len(made))
    return rule


# --- local ops that are not the op on blocks -----------------------------------------------------

def _random_rule(node, sizes) -> list[Strategy]:
    """A random block (`nf.random`) in any layout whose splits divide it evenly: a counter-based
    sampler computes any block of the value from the key alone, so a sharded one is each rank's
    own (1/n of the values), the same bits as the whole. Key and tensor arguments whole."""
    k, out = len(sizes), tensor_outputs(node)[0]
    ins = tuple(replicated(k) for _ in tensor_inputs(node))
    return [Strategy((lay,), ins) for lay in all_layouts(tuple(out.shape), sizes, partial=False)]


def _key_flops(node) -> int:
    """A key's hash (`fold_in`, `split` traced): threefry2x32's rounds per pair of words."""
    return 64 * node.meta["val"][0].numel()


def _random_flops(node) -> int:
    """A counter-based sample: threefry2x32's 20 rounds of add, rotate and xor per pair of words,
    then the transform to the distribution (what makes computing a block, not the whole, pay)."""
    return 64 * node.meta["val"].numel()


def _random_block(emitter, node, locals_):
    """The local op of a random block: whole where replicated, else `random_block_at`, which reads
    where this rank's block starts from `coords`."""
    layout = emitter.plan.strategy[node].outs[0]
    key, kernel, shape, starts, stops, out_dtype, _, kernel_dtype = node.args
    tensors = locals_[1:]
    if all(isinstance(p, Replicate) for p in layout):
        return emitter.call(random_block_op, locals_[0], kernel, shape, starts, stops, out_dtype, tensors, kernel_dtype)
    ndim = len(shape)
    block = list(local_shape(tuple(b - a for a, b in zip(starts, stops)), layout, emitter.sizes))
    weights = [[0] * ndim for _ in layout]  # how far one step along axis i moves dim d
    for d in range(ndim):
        step = block[d]
        for i in reversed([i for i, p in enumerate(layout) if p == Shard(d)]):  # minor to major
            weights[i][d] = step
            step *= emitter.sizes[i]
    out = emitter.call(random_block_at_op, locals_[0], kernel, list(shape), list(starts), block, emitter.coords,
                       [w for row in weights for w in row], out_dtype, tensors, kernel_dtype)
    return prog.note_local(out, tuple(block), out_dtype)


def _cat_rule(node, sizes) -> list[Strategy]:
    """Concatenation: the inputs and the result alike, in every layout of the result that does not
    split the joined dim (a pending sum too: it is linear), in `all_layouts`' order. That is what
    DTensor's rule gives, pooled over its inputs' layouts (`from_op_strategy`), without asking it
    thousands of times on a 4-axis mesh. Inputs of another rank (legacy empty tensors): DTensor's."""
    ins, out = tensor_inputs(node), node.meta["val"]
    if any(a.meta["val"].ndim != out.ndim for a in ins):
        return from_op_strategy(node, ins, tensor_outputs(node), sizes)
    d = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.ndim
    return [Strategy((lay,), (lay,) * len(ins)) for lay in all_layouts(tuple(out.shape), sizes)
            if Shard(d) not in lay]


def _fill_rule(node, sizes) -> list[Strategy]:
    """DTensor's, less its fills of a pending sum with a value every rank holds whole: each rank's
    part would be the value, and their sum that many times it. A fill with 0, or with a value
    pending the same sum, stays one."""
    found = from_dtensor(node, tensor_inputs(node), tensor_outputs(node), sizes)
    if found is None:
        raise NoStrategy(node.target)
    if node.target is aten.fill_.Scalar and node.args[1] == 0:
        return list(found)

    def keeps(s: Strategy) -> bool:
        value = s.ins[1] if len(s.ins) > 1 else None
        return all(not isinstance(p, Partial) or (value is not None and value[m] == p) for m, p in enumerate(s.outs[0]))
    return [s for s in found if keeps(s)]


def _stack_rule(node, sizes) -> list[Strategy]:
    """Stacking: `_cat_rule`'s, each input in the result's layout without the new dim (a split of a
    later dim one lower). DTensor's, asked once per layout of each input, costs seconds where an
    unrolled loop (an LSTM's steps) stacks hundreds."""
    ins, out = tensor_inputs(node), node.meta["val"]
    d = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % out.ndim

    def without_it(lay):
        return tuple(Shard(p.dim - 1) if type(p) is Shard and p.dim > d else p for p in lay)
    return [Strategy((lay,), (without_it(lay),) * len(ins)) for lay in all_layouts(tuple(out.shape), sizes)
            if Shard(d) not in lay]


def _cumsum_rule(node, sizes) -> list[Strategy]:
    """DTensor's (split on other dims), and split along the summed dim over one axis: each rank's
    cumulative sum, then plus the totals of the ranks before it (`_cumsum`)."""
    found = list(from_dtensor(node, tensor_inputs(node), tensor_outputs(node), sizes) or [])
    d = node.args[1] % node.args[0].meta["val"].ndim
    for m in range(len(sizes)):
        lay = tuple(Shard(d) if i == m else Replicate() for i in range(len(sizes)))
        found.append(Strategy((lay,), (lay,)))
    return found


def _cumsum(emitter, node, locals_):
    """A cumulative sum on blocks: along a dim split over an axis, each rank's own sum plus the sum
    of the totals of the ranks before it on that axis (gathered: one value per rank and column)."""
    x, lay = locals_[0], emitter.plan.strategy[node].ins[0]
    val = node.meta["val"]
    d = node.args[1] % val.ndim
    dtype = node.kwargs.get("dtype")
    local = emitter.call(aten.cumsum.default, x, d, **({"dtype": dtype} if dtype is not None else {}))
    axes = [m for m, p in enumerate(lay) if p == Shard(d)]
    if not axes:
        return local
    (m,) = axes
    n, shape = emitter.sizes[m], local_shape(tuple(val.shape), lay, emitter.sizes)
    last = emitter.call(aten.narrow.default, local, d, shape[d] - 1, 1)
    total = emitter.call(aten.clone.default, emitter.call(aten.movedim.int, last, d, 0),
                         memory_format=torch.contiguous_format)
    rest = (1, *shape[:d], *shape[d + 1:])
    step = redistribute.Step("all_gather", m, 0, None, rest, (n, *rest[1:]), n)
    every = emitter.emit(step, total, val)  # (n, rest): each rank's total along the axis
    before = emitter.call(aten.lt.Tensor, emitter.call(aten.arange.default, n, device=val.device),
                          emitter.call(aten.select.int, emitter.coords, 0, m))
    weights = emitter.call(aten.view.default, emitter.call(cast_ops.CAST, before, dtype=val.dtype),
                           [n] + [1] * (len(rest) - 1))
    prefix = emitter.call(aten.sum.dim_IntList, emitter.call(aten.mul.Tensor, every, weights), [0], True)
    out = emitter.call(aten.add.Tensor, local, emitter.call(aten.movedim.int, prefix, 0, d))
    return prog.note_local(out, shape, val.dtype)


def _vocab_parallel_rule(node, sizes) -> list[Strategy]:
    """DTensor's strategies for an embedding lookup (or its backward), and on each axis where one
    keeps the table, the indices and the lookup whole: the table split by rows (the vocabulary)
    instead, each rank looking up the rows it holds and zeros for the rest, a pending sum
    (Megatron's vocabulary-parallel embedding; DTensor's masked partial). In the backward the
    gradient's rows are split the same way: each rank's rows from the tokens that fall in them.
    Not for `scale_grad_by_freq` (it counts tokens over the whole table), whose backward divides
    each row by its token's count over all the indices: DTensor's strategies with the indices
    whole only (split, each rank counted its own block's tokens)."""
    found = from_dtensor(node, tensor_inputs(node), tensor_outputs(node), sizes)
    if found is None:
        found = from_op_strategy(node, tensor_inputs(node), tensor_outputs(node), sizes)
    forward = node.target is aten.embedding.default
    if _embedding_args(node)[1]:
        return found if forward else [s for s in found if not any(isinstance(p, Shard) for p in s.ins[1])]
    table_shape = tuple((node.args[0] if forward else node).meta["val"].shape)
    extra = []
    for s in found:
        table = s.ins[0] if forward else s.outs[0]
        if any(p == Shard(0) for p in table):
            continue
        for m in range(len(sizes)):
            if not all(isinstance(lay[m], Replicate) for lay in (*s.ins, s.outs[0])):
                continue
            if local_shape(table_shape, table, sizes)[0] % sizes[m]:
                continue
            if forward:  # the table's rows split, the lookup a pending sum
                extra.append(Strategy((_with(s.outs[0], m, Partial()),), (_with(table, m, Shard(0)), *s.ins[1:])))
            else:  # the gradient's rows split, from the whole incoming gradient and indices
                extra.append(Strategy((_with(s.outs[0], m, Shard(0)),), s.ins))
    return [*found, *extra]


def _with(layout, m, placement):
    return tuple(placement if i == m else p for i, p in enumerate(layout))


def _embedding_args(node) -> tuple[int, bool]:
    """(padding_idx, scale_grad_by_freq) of an embedding lookup or its backward."""
    if node.target is aten.embedding.default:
        padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        freq = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq", False)
        return padding, freq
    return node.args[3], node.args[4]


def _vocab_parallel(emitter, node, locals_):
    """The local lookup: the op on blocks where no axis splits the table's rows; else each rank's
    rows looked up with the indices moved into its range (others read row 0), and what fell
    outside zeroed: in the forward the lookup (a pending sum over the axis), in the backward the
    incoming gradient (and a padding token's: its row gets none) before it is added into this
    rank's rows."""
    s = emitter.plan.strategy[node]
    forward = node.target is aten.embedding.default
    padding, freq = _embedding_args(node)
    table = s.ins[0] if forward else s.outs[0]
    table_shape = tuple((node.args[0] if forward else node).meta["val"].shape)
    local_rows = local_shape(table_shape, table, emitter.sizes)[0]
    val = node.meta["val"]
    shape = local_shape(tuple(val.shape), s.outs[0], emitter.sizes)
    first, indices = locals_
    axes = [emitter.axis_names[m] for m, p in enumerate(table) if p == Shard(0)]
    if not axes:
        if forward:
            out = emitter.call(aten.embedding.default, first, indices, *node.args[2:], **node.kwargs)
        else:
            out = emitter.call(aten.embedding_dense_backward.default, first, indices, local_rows, padding, freq)
        return prog.note_local(out, shape, val.dtype)
    start = emitter.call(aten.mul.Tensor, emitter.axis_index(axes), local_rows)
    moved = emitter.call(aten.sub.Tensor, indices, start)
    inside = emitter.call(aten.bitwise_and.Tensor, emitter.call(aten.ge.Scalar, moved, 0),
                          emitter.call(aten.lt.Scalar, moved, local_rows))
    if not forward and padding >= 0:
        inside = emitter.call(aten.bitwise_and.Tensor, inside, emitter.call(aten.ne.Scalar, indices, padding))
    index = emitter.call(aten.where.ScalarOther, inside, moved, 0)
    keep = emitter.call(aten.unsqueeze.default, inside, -1)
    if forward:
        out = emitter.call(aten.where.ScalarOther, keep, emitter.call(aten.embedding.default, first, index), 0.0)
    else:
        grad = emitter.call(aten.where.ScalarOther, keep, first, 0.0)
        out = emitter.call(aten.embedding_dense_backward.default, grad, index, local_rows, -1, freq)
    return prog.note_local(out, shape, val.dtype)


def _same_value(emitter, node, locals_):
    """A constraint or region boundary: the layouts were the point; the value is its input's."""
    return locals_[0]


def _ppermute(emitter, node, locals_):
    """`nf.lax.ppermute` inside nf.jit: each rank's block to its peer, point to point (`permute_blocks`)."""
    from ndfunc._src.point_to_point import permute_blocks

    x, flat, axis = node.args
    pairs = tuple(zip(flat[0::2], flat[1::2]))
    out = emitter.call(permute_blocks, locals_[0], pairs)
    val = x.meta["val"]
    block = val.numel() * val.element_size()
    prog.set_comm(out, prog.Comm("ppermute", tuple(axis.split(",")), tuple(val.shape), tuple(val.shape), val.dtype,
                                 val.device, None, block, block))
    return prog.note_local(out, tuple(val.shape), val.dtype)


def _axis_index(emitter, node, locals_):
    """`nf.lax.axis_index` inside nf.jit: this rank's position, read from `coords`."""
    return emitter.axis_index(json.loads(node.args[0]))


# --- work ----------------------------------------------------------------------------------------

# --- the registrations ---------------------------------------------------------------------------

register(attention.attention_op, strategies=attention_rule.rule, flops=attention_rule.flops,
         local=attention_rule.kernel, attention=True)
register(attention.attention_backward_op, strategies=attention_rule.rule, flops=attention_rule.backward_flops,
         local=attention_rule.kernel, attention=True)
register(aten.nll_loss_forward.default, strategies=_mean_loss_rule)
register(aten.embedding.default, strategies=_vocab_parallel_rule, lower=_vocab_parallel)
register(aten.embedding_dense_backward.default, strategies=_vocab_parallel_rule, lower=_vocab_parallel)
register(aten.nll_loss2d_forward.default, strategies=_mean_loss_rule)
register(random_block_op, strategies=_random_rule, lower=_random_block, flops=_random_flops)  # each its own block
register(threefry_op, strategies=_replicated_rule, flops=_key_flops)  # a few words, whole on every rank
register(sharding_constraint_op, strategies=_constraint_rule, lower=_same_value)
register(manual.enter_op, lower=_same_value)  # strategies: the region's (`candidates`)
register(manual.exit_op, lower=_same_value)
register(manual.axis_index_op, lower=_axis_index)
register(manual.ppermute_op, lower=_ppermute)
register(aten.cat.default, strategies=_cat_rule)
# a recurrent layer, a CTC loss, a mixture of experts' experts: split along the dims each names
for _opaque in opaque.OPS:
    for _op in (_opaque.forward, _opaque.backward):
        register(_op, strategies=_split_along(_opaque.dims), flops=_opaque.flops)
register(aten.stack.default, strategies=_stack_rule)
register(aten.fill_.Scalar, strategies=_fill_rule)
register(aten.fill_.Tensor, strategies=_fill_rule)
register(aten.scatter_reduce.two, strategies=_scatter_reduce_rule)
register_by_name("transformers::grouped_mm_fallback", strategies=_grouped_mm_fallback_rule)
register_by_name("transformers::grouped_mm_fallback_backward", strategies=_grouped_mm_fallback_rule)
register(aten.unfold.default, strategies=_unfold_rule)
register(aten.as_strided.default, lower=_as_strided)  # (no rule: whole)
# element by element over tensors of one shape, which DTensor's pointwise rules leave out (complex
# numbers from their parts: RoPE's `freqs_cis`)
for _alike in (aten.hardshrink_backward.default, aten.softshrink_backward.default, aten.polar.default,
               aten.complex.default):
    register(_alike, strategies=_leading_dims_rule(0))
register(aten.unfold_backward.default, strategies=_unfold_rule, lower=_unfold_backward)
register(aten.linalg_solve_triangular.default, strategies=_solve_triangular_rule)
register(aten._cdist_forward.default, strategies=_cdist_rule)
register(aten._cdist_backward.default, strategies=_cdist_rule)
for _trailing, _pad in enumerate((aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
                                  aten.replication_pad3d_backward.default), start=1):
    register(_pad, strategies=_leading_dims_rule(_trailing))
# the backwards of poolings whose forwards DTensor splits by samples and channels, and they not
for _trailing, _pool in ((2, aten.avg_pool2d_backward.default), (3, aten.avg_pool3d_backward.default),
                         (3, aten.max_pool3d_with_indices_backward.default),
                         (3, aten._adaptive_avg_pool3d_backward.default), (2, aten.adaptive_max_pool2d_backward.default),
                         (3, aten.adaptive_max_pool3d_backward.default)):
    register(_pool, strategies=_leading_dims_rule(_trailing))
register(aten.cumsum.default, strategies=_cumsum_rule, lower=_cumsum)  # a scan along a split dim
for _dot in (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default):
    register(_dot, saved_by_remat=True)
# a product keeping its operands' other dims (`ndfunc::dot`: a linear layer), and a weight's gradient
for _dot in (dot.dot_op, dot.dot_leading_op):
    register(_dot, strategies=dots.rule, flops=dots.flops, lower=dots.lower, saved_by_remat=True)
