"""Capture a step as one functional aten graph over global shapes.

`trace(fn, args)` runs `fn` under `make_fx` on fake tensors of each input's *global* shape (a
DTensor contributes its full shape, never its data): forward, backward (through `torch.func`) and
the optimizer update become one graph with no autograd left in it. Attention is one node whatever
the device (`ndfunc.attention` and its backward, `ndfunc._src.attention`), and `nf.with_sharding_constraint` stays one `ndfunc.sharding_constraint`
node, so later passes can find both. Nothing is allocated at global size: tracing a 100M-parameter
step costs what its graph costs.

One op is traced as two: a cross-entropy's (`nll_loss`) mean over the targets it does not ignore,
on float32 or float64 scores, becomes their sum over their count (or total weight). DTensor's
sharding rule for the mean averages each rank's own mean, which is the whole batch's only when
every rank ignores as many targets; as a sum and a count, both are summed over the ranks before
the division, so a sharded step's loss is the single device's. (Half-precision scores keep the op:
their sum could overflow before the division. The partitioner then brings the scores together for
it, since its sharded rule is that average; cast them to float32 first, as `models.llama` does.)
Scores of shape (N, C) without class weights go further: each target's score is picked as a sum
over the classes masked by `class == target`, and its gradient is written the same way, so the
scores can stay split over the classes (vocabulary-parallel, as Megatron's cross-entropy).

A tensor the step closes over is a constant of the program, the same on every rank. One made
under `nf.simulate` (a value per simulated rank) or one the step writes into is refused: pass it
as an argument instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import linecache
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn import _reduction

from ndfunc._src import attention, experts, regions, swaps, write_ops, writes
from ndfunc._src.attention import cpu_flash_as_attention
from ndfunc._src.constraints import decode_spec, sharding_constraint_op
from ndfunc._src.custom_gradients import accepting_old_functions
from ndfunc._src.runtime import simulation_paused
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.sharding.shape_dtype import ShapeDtypeStruct
from ndfunc._src.stamp import Stamps
from ndfunc._src.traced_as import TracedAs
from ndfunc._src.torch_compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    LocalTensor,
    TorchDispatchMode,
    known_fakes,
    lazy_graph_modules,
    traced_as_compiling,
)

_tracing: contextvars.ContextVar[bool] = contextvars.ContextVar("ndfunc_tracing", default=False)


def is_tracing() -> bool:
    """Whether code runs inside `trace` (values are global-shaped fakes, not per-rank data)."""
    return _tracing.get()


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a traced input or output is: global shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __repr__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclasses.dataclass(frozen=True)
class Traced:
    """A traced step: `graph_module(*input_leaves) -> output_leaves`, over global shapes.

    `in_tree`/`out_tree` rebuild the argument and result pytrees; `in_specs`/`out_specs` give each
    leaf's global shape and dtype; `input_paths` name each input leaf (`0.layers.1.attn.wq`: argument
    0's leaf), for error messages.
    """

    graph_module: torch.fx.GraphModule
    in_tree: optree.PyTreeSpec
    out_tree: optree.PyTreeSpec
    in_specs: tuple[TensorSpec, ...]
    out_specs: tuple[TensorSpec, ...]
    input_paths: tuple[str, ...]
    static_argnums: frozenset[int] = frozenset()

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    def constraints(self) -> list[tuple[torch.fx.Node, PartitionSpec]]:
        """Every `with_sharding_constraint` in the program, with its spec."""
        return [(n, decode_spec(n.args[1])) for n in self.graph.nodes
                if n.op == "call_function" and n.target is sharding_constraint_op]

    def __call__(self, *args, **kwargs):
        """Run the program on whole (unsharded) inputs, as `fn(*args, **kwargs)` would."""
        dynamic = tuple(None if i in self.static_argnums else a for i, a in enumerate(args))
        leaves = self.in_tree.flatten_up_to((dynamic, kwargs))
        return self.out_tree.unflatten(self.graph_module(*leaves))


def trace(fn: Callable, args: Sequence[Any], kwargs: dict | None = None, *, static_argnums: Sequence[int] = (),
          record_stack_traces: bool = False, decompositions: dict | None = None) -> Traced:
    """Trace `fn(*args, **kwargs)` into a `Traced` program over the global shapes of its tensors.

    Arguments at `static_argnums` are not traced (a config, a model description): they are baked
    into the program. Every other leaf must be a tensor (a DTensor counts by its global shape).
    `record_stack_traces` keeps each node's Python stack in `node.meta['stack_trace']` (slower).
    `decompositions`: ops traced as what they decompose into (`{op: fn}`, as `make_fx` takes them);
    the partitioner passes those of the ops it has no sharding rule for.

    Code that reads a tensor's value (`if x.sum() > 0`, `.item()`) or makes a shape from one
    (`x[x > 0]`, `torch.unique`) raises `DataDependentError` naming its line; an op that draws from
    torch's global random generator raises one too. Inside, `torch.compiler.is_compiling()` is True,
    as under torch.export, so libraries skip their value checks.
    """
    kwargs = dict(kwargs or {})
    static = {i % len(args) for i in static_argnums} if args else set()
    dynamic = tuple(None if i in static else a for i, a in enumerate(args))
    leaves_with_paths, in_tree = _flatten((dynamic, kwargs))
    in_specs = tuple(TensorSpec(tuple(x.shape), x.dtype) for _, x in leaves_with_paths)
    devices = [x.device for _, x in leaves_with_paths]
    paths = tuple(p for p, _ in leaves_with_paths)

    def flat_fn(*leaves):
        dyn_args, dyn_kwargs = in_tree.unflatten(leaves)
        call_args = [args[i] if i in static else dyn_args[i] for i in range(len(args))]
        out = fn(*call_args, **dyn_kwargs)
        out_leaves, out_tree = optree.tree_flatten(out)
        for i, leaf in enumerate(out_leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{getattr(fn, '__name__', 'the function')} returned a {type(leaf).__name__} "
                    f"({leaf!r}) at output leaf {i}; a traced step returns tensors only."
                )
        trees.append(out_tree)
        return out_leaves

    trees: list = []
    with simulation_paused():
        with (fake_mode := FakeTensorMode(allow_non_fake_inputs=True)):
            fakes = [torch.empty(s.shape, dtype=s.dtype, device=d) for s, d in zip(in_specs, devices)]
            known_fakes(fake_mode, fakes)
        token = _tracing.set(True)
        try:
            # annotations (nf.remat's regions) reach the nodes; the graph's Python code is written
            # only if the traced program is called or shown (the partitioner reads the graph);
            # ndfunc's replacements of library functions are in place only inside `swaps.swapped()`,
            # and the switches after it turn each on in this thread
            with (swaps.swapped(), fx_traceback.preserve_node_meta(), traced_as_compiling(), TracedAs(),
                  accepting_old_functions(), lazy_graph_modules(True), regions.routed(Stamps().call), experts.traced(),
                  attention.traced()):
                graph_module = make_fx(flat_fn, decomposition_table={**(decompositions or {}), **_DECOMPOSITIONS},
                                       tracing_mode="fake", record_stack_traces=record_stack_traces)(*fakes)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise DataDependentError(_data_dependent_message(getattr(fn, "__name__", "the step"), e)) from None
        except RuntimeError as e:
            if "got mixed torch.Tensor and DTensor" in str(e):  # (DTensor's refusal of a traced value beside it)
                where = where_called(traceback.extract_tb(e.__traceback__))
                raise TypeError(
                    f"{getattr(fn, '__name__', 'the step')} closes over a sharded tensor (a DTensor, as nf.device_put "
                    f"makes) {where}: a tensor a step closes over is a constant of the program, whole on every rank. "
                    f"Pass it to the step as an argument; its sharding comes with it (with nf.accumulate, after the "
                    f"batch: it reaches every micro-batch as it is).") from None
            if not any(said in str(e) for said in _READS_DATA):  # (an ATen kernel reading its argument's data)
                raise
            raise DataDependentError(_data_dependent_message(getattr(fn, "__name__", "the step"), e)) from None
        finally:
            _tracing.reset(token)
    name = getattr(fn, "__name__", "the step")
    def line_of(node: torch.fx.Node) -> str:  # the user's line making `node`'s op first: once more, traced
        with simulation_paused(), fake_mode, TracedAs():
            return first_calls(lambda: flat_fn(*fakes), [node.target]).get(node.target, "in the step")

    if (seeded := _seeded(graph_module)) is not None:
        raise DataDependentError(_seeded_message(name, seeded, line_of(seeded)))
    if (mixed := _mixed_dtypes(graph_module)) is not None:
        raise TypeError(_mixed_dtypes_message(name, mixed, line_of(mixed)))
    _check_constants(graph_module, name)
    _scalars_as_factories(graph_module)
    writes.as_functional(graph_module)
    cpu_flash_as_attention(graph_module)
    for node in graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.lift_fresh_copy.default):
        node.target = torch.ops.aten.clone.default  # a `torch.tensor([...])` literal: the constant, copied
    out_specs = tuple(TensorSpec(tuple(n.meta["val"].shape), n.meta["val"].dtype)
                      for n in graph_module.graph.find_nodes(op="output")[0].args[0])
    return Traced(graph_module, in_tree, trees[-1], in_specs, out_specs, paths, frozenset(static))


def _mean_as_sum_over_count(op):
    """`op` (an `nll_loss` forward) with reduction 'mean' as its 'sum' over its total weight (what
    the mean divides by, and what its backward reads); other reductions as they are. Scores of
    shape (N, C) with no class weights, summed or averaged, are picked as a masked sum (`_picks`)."""
    def decomposed(x, target, weight, reduction, ignore_index):
        if reduction not in _SUMMED or x.dtype not in (torch.float32, torch.float64):
            return NotImplemented
        if _picks(x, weight, op):
            summed = -torch.where(_hits(x, target, ignore_index), x, 0).sum()  # an ignored target matches no class
            weight_total = (target != ignore_index).sum().to(x.dtype)
        elif reduction == _reduction.get_enum("mean"):
            summed, weight_total = op(x, target, weight, _reduction.get_enum("sum"), ignore_index)
        else:
            return NotImplemented  # a sum the op makes as it is (and what the mean above calls)
        if reduction == _reduction.get_enum("mean"):
            return summed / weight_total, weight_total
        return summed, weight_total

    return decomposed


def _nll_backward(grad, x, target, weight, reduction, ignore_index, weight_total):
    """The gradient of `_mean_as_sum_over_count`'s masked sum: -grad (over the total weight, for
    the mean) at each target's class, 0 elsewhere."""
    op = torch.ops.aten.nll_loss_forward.default
    if reduction not in _SUMMED or x.dtype not in (torch.float32, torch.float64) or not _picks(x, weight, op):
        return NotImplemented
    scale = -grad / weight_total if reduction == _reduction.get_enum("mean") else -grad
    return torch.where(_hits(x, target, ignore_index), scale.to(x.dtype), 0)


_SUMMED = (_reduction.get_enum("mean"), _reduction.get_enum("sum"))


def _picks(x, weight, op) -> bool:
    """Whether a cross-entropy's target scores are picked as a masked sum: (N, C) scores without
    class weights. ATen's kernel reads the class of each target by index, and no sharding rule
    splits that over the classes; compared with every class and summed, the scores stay split
    where they are made, as Megatron's vocabulary-parallel cross-entropy keeps the logits (each
    rank picks the targets in its slice of the vocabulary, and one all-reduce of a scalar adds them)."""
    return op is torch.ops.aten.nll_loss_forward.default and weight is None and x.dim() == 2


def _hits(x, target, ignore_index):
    """(N, C): whether class c is sample n's target (and the target is not ignored)."""
    classes = torch.arange(x.shape[1], device=x.device)
    return (target.unsqueeze(1) == classes) & (target != ignore_index).unsqueeze(1)


_DECOMPOSITIONS = {op: _mean_as_sum_over_count(op)
                   for op in (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default)}
_DECOMPOSITIONS[torch.ops.aten.nll_loss_backward.default] = _nll_backward


class DataDependentError(TypeError):
    """A traced step needs a tensor's value (a branch, `.item()`, a shape made from values, a random
    draw from torch's generator), which tracing does not have: one program serves every value."""


_LIBRARY = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)), os.path.dirname(optree.__file__))


def where_called(frames: list) -> str:
    """'at file:line (code)' for the innermost frame of code outside torch and ndfunc; when that is a
    library's (site-packages), ', called from' the innermost of the user's own."""
    def at(f) -> str:
        code = (f.line or linecache.getline(f.filename, f.lineno)).strip()
        return f"{f.filename}:{f.lineno} ({code})"

    outside = [f for f in frames if not f.filename.startswith(_LIBRARY) and not f.filename.startswith("<")]
    if not outside:
        return "in the step"
    own = [f for f in outside if "site-packages" not in f.filename and "dist-packages" not in f.filename]
    text = f"at {at(outside[-1])}"
    if own and own[-1] is not outside[-1]:
        text += f", called from {at(own[-1])}"
    return text


def first_calls(run: Callable[[], Any], ops: Sequence) -> dict:
    """`where_called` text of the first call of each of `ops` while `run()` runs (on fake tensors:
    inside a FakeTensorMode); a failure of `run` only ends the search."""
    wanted, found = set(ops), {}

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in wanted and func not in found:
                found[func] = where_called(traceback.extract_stack())
            return func(*args, **(kwargs or {}))

    try:
        with Watch():
            run()
    except Exception:  # noqa: BLE001 - the lines are a courtesy to an error or warning already decided
        pass
    return found


# what a fake tensor says when a kernel reads its data directly (`tensor_split`'s tensor indices),
# and what a tensor under torch.func's transforms says
_READS_DATA = ("data is not allocated yet", "Cannot access data pointer of Tensor that doesn't have storage",
               "tolist() shouldn't be called on a tensor with unallocated storage")  # (under torch.func's grad)


def _data_dependent_message(name: str, e: Exception) -> str:
    where = where_called(traceback.extract_tb(e.__traceback__))
    if not isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) and "tolist()" in str(e):
        e = DataDependentOutputException("`.tolist()`")  # (`_READS_DATA`: what it says under torch.func's grad)
    op = getattr(e, "func", None)
    if not isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):  # (`_READS_DATA`: unnamed)
        what = ("reads a tensor's value (an op given a tensor where it reads numbers: `torch.tensor_split` or "
                "`torch.narrow` with tensor indices)")
        instead = ("indices as Python ints (static_argnums for those the program depends on), or torch.where / "
                   "masks for a choice made per element")
    elif isinstance(e, DataDependentOutputException):
        what = (f"reads a tensor's value ({op}: `.item()`, `float(x)`, `int(x)`, `bool(x)` or `if x:` on a "
                f"tensor)")
        instead = ("torch.where(cond, a, b) for a choice made per element; a static argument "
                   "(static_argnums) for a setting the program may depend on; or compute the value outside the "
                   "step and pass it in")
    elif op is not None and "_ctc_loss" in str(op):
        what = f"makes a shape from a tensor's values ({op}: targets concatenated in one dim, bounded by their lengths)"
        instead = ("pass F.ctc_loss the targets padded to (samples, longest target), with their lengths: that "
                   "form is traced, split by the samples")
    else:
        what = f"makes a shape from a tensor's values ({op}: `x[mask]`, `nonzero`, `unique`, `masked_select`)"
        instead = ("torch.where(mask, x, 0) keeps the shape (then reduce: `(x * mask).sum()`); or compute it "
                   "outside the step and pass it in")
    return (f"{name} {what} {where}. A traced step sees shapes and dtypes, not values: nf.jit makes one program "
            f"for every value of its inputs, so Python cannot branch on a value or make a shape from one. "
            f"Instead: {instead}.")


def _seeded(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The first op of `gm` that draws from torch's global random generator (attention and dropout
    with a probability of 0, or out of training, draw nothing)."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or (
                torch.Tag.nondeterministic_seeded not in n.target.tags):
            continue
        given = {a.name: n.args[i] if i < len(n.args) else n.kwargs.get(a.name, a.default_value)
                 for i, a in enumerate(n.target._schema.arguments)}
        if given.get("dropout_p", given.get("p")) == 0 or given.get("train") is False:
            continue
        return n
    return None


def _seeded_message(name: str, node: torch.fx.Node, where: str) -> str:
    return (f"{name} draws random numbers from torch's global generator ({node.target}) {where}. A "
            f"traced step holds no generator state, and each rank would draw its own numbers for a value meant "
            f"to be one. Draw them from a key passed to the step (nf.random: `nf.random.bernoulli(key, shape, "
            f"p=p)`, `nf.random.normal(key, shape)`), or turn it off (dropout: `model.eval()` or a dropout "
            f"probability of 0 in the model's config).")


# products whose kernels take one floating dtype for every operand (a fake tensor does not check)
_ONE_DTYPE = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default,
    torch.ops.aten.addbmm.default, torch.ops.aten.mv.default, torch.ops.aten.dot.default,
    torch.ops.aten.convolution.default})


def _float_dtypes(node: torch.fx.Node) -> list[torch.dtype]:
    """The dtypes of `node`'s floating tensor operands, in order."""
    vals = [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
    return [v.dtype for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _mixed_dtypes(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The first product of `gm` (`_ONE_DTYPE`) given floating operands of different dtypes, which
    its kernel refuses when the step runs."""
    return next((n for n in gm.graph.nodes
                 if n.op == "call_function" and n.target in _ONE_DTYPE and len(set(_float_dtypes(n))) > 1), None)


def _mixed_dtypes_message(name: str, node: torch.fx.Node, where: str) -> str:
    dtypes = [str(d).removeprefix("torch.") for d in _float_dtypes(node)]
    return (f"{name} multiplies {' and '.join(dtypes)} operands ({node.target}) {where}: torch's kernels take "
            f"one dtype, and every rank would raise as the step ran. Under nf.mixed_precision the arguments "
            f"nf.grad differentiates (the parameters) come in its param_dtype: cast the others to match "
            f"(`x.to(w.dtype)`), or call the model through nf.nn.functional, whose apply casts its float inputs.")


def _check_constants(gm: torch.fx.GraphModule, name: str) -> None:
    """Refuse the tensors a step closes over that cannot be constants of the program."""
    from ndfunc._src.buffers import buffer_roots

    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        if isinstance(value, LocalTensor):
            raise TypeError(
                f"{name} closes over a tensor made under nf.simulate: it holds a value per simulated rank, "
                f"and a tensor a step closes over is a constant, the same on every rank. Pass it to the "
                f"step as an argument (with the sharding its values have).")
    root = buffer_roots(gm.graph.nodes)
    for node in gm.graph.nodes:
        if node.op == "call_function" and write_ops.written(node.target) and root[node].op == "get_attr":
            raise TypeError(
                f"{name} writes in place ({node.target}) into a tensor it closes over (shape "
                f"{list(node.meta['val'].shape)}); tracing has applied that write to it once. A traced "
                f"step is a function of its arguments: pass the tensor as an argument and return its new "
                f"value (donate_argnums lets the result reuse its memory).")


def _scalars_as_factories(gm: torch.fx.GraphModule) -> None:
    """A 0-d tensor the step made from a Python number (`torch.tensor(3)`) is captured as a
    constant; make it a `scalar_tensor` op, which every rank runs like any other factory. Larger
    constants stay attributes of the graph. Several nodes may read one constant (Gemma's embedding
    scale, read by its forward and its backward): the attribute goes once none is left."""
    done = set()
    for node in list(gm.graph.find_nodes(op="get_attr")):
        value = getattr(gm, node.target, None)
        if not isinstance(value, torch.Tensor) or value.ndim != 0:
            continue
        with gm.graph.inserting_before(node):
            made = gm.graph.call_function(torch.ops.aten.scalar_tensor.default, (value.item(),),
                                          {"dtype": value.dtype, "device": value.device})
        made.meta.update(node.meta)
        for user in list(node.users):
            if user.target is torch.ops.aten.lift_fresh_copy.default:  # already a fresh tensor
                user.replace_all_uses_with(made)
                gm.graph.erase_node(user)
        node.replace_all_uses_with(made)
        gm.graph.erase_node(node)
        done.add(node.target)
    for target in done:
        delattr(gm, target)
    gm.recompile()


def _flatten(tree) -> tuple[list[tuple[str, torch.Tensor]], optree.PyTreeSpec]:
    from ndfunc.tree import keystr

    paths, leaves, treespec = optree.tree_flatten_with_path(tree)
    out = []
    for path, leaf in zip(paths, leaves):
        name = keystr(path[1:])  # (0, i, ...) for argument i, (1, key, ...) for a keyword
        if not isinstance(leaf, (torch.Tensor, ShapeDtypeStruct)):
            raise TypeError(
                f"argument leaf {name!r} is a {type(leaf).__name__} ({leaf!r}); traced arguments are "
                f"tensors. Make it a tensor, or mark its argument static (static_argnums)."
            )
        out.append((name, leaf))
    return out, treespec
