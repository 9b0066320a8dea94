"""Repeated regions, traced once and stamped at every call.

A function marked with `torch.compiler.nested_compile_region` (PyTorch's word for "this region
repeats: compile it once") is, under `nf.jit`'s tracer, traced once per signature (the structure
of its arguments, each tensor's shape, dtype, strides and whether it is differentiated, and the
values of the others) into a template: its forward and, where an input is differentiated, its
backward (`torch.func.vjp`). Every call then copies the template's nodes into the program, wired
to the call's inputs, as the tracer would have recorded them op by op: the same ops in the same
order, the same annotations (`nf.remat`'s region, forward and backward marks), without running
the function's Python or dispatching its ops again. A decoder layer traced once serves all 80 of
a 70B model's. Gradients flow through an `autograd.Function` whose backward copies the template's
backward.

A marked function must be pure, as torch.compile's regions are: what it computes depends only on
its arguments (tensors by shape and dtype, the others by value), with no Python state read or
written across calls. Traced op by op, as an unmarked function is: a region that writes into an
input, returns one, or reads a tensor it was not passed (a closure's); a call under `vmap`, `jvp`
or a `grad` of a `grad`; a call with an argument that is neither a tensor nor hashable. Outside
`nf.jit`'s tracer the mark is torch's (eager: a plain call; torch.compile: one compiled region).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.fx.traceback as fx_traceback
from torch.fx.node import map_arg

from ndfunc._src import torch_compat


# Annotations that name one call (`nf.remat`'s region ids): made inside a region, each copy draws
# its own, `PER_CALL[key](mark)`, as the call would have.
PER_CALL: dict[str, Callable[[Any], Any]] = {}


@dataclasses.dataclass(eq=False)
class Template:
    """One region traced over fresh inputs: its graph and the nodes each part of a call copies."""

    graph: torch.fx.Graph
    primals: list[torch.fx.Node]  # a placeholder per tensor argument
    tangents: list[torch.fx.Node]  # a placeholder per tensor output's gradient
    forward: list[torch.fx.Node]
    backward: list[torch.fx.Node]
    outs: list[torch.fx.Node]  # what each tensor output is
    grads: list[torch.fx.Node | None]  # each tensor argument's gradient (None: not differentiated)
    out_leaves: list[Any]  # the outputs' leaves, tensors as None
    out_spec: Any
    context: dict  # the annotations in force where it was traced
    pending: dict | None = None  # the forward being copied: its nodes, for `_Stamped.setup_context`


class Stamps:
    """The templates of one trace, by region and signature."""

    def __init__(self) -> None:
        self.templates: dict = {}

    def call(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in where]
        if not torch_compat.at_most_one_grad_transform():  # vmap, jvp, grad of grad: op by op
            return fn(*args, **kwargs)
        try:
            key = (fn, spec, tuple(_signature(x) for x in tensors),
                   tuple(_constant(x) for x in leaves if not isinstance(x, torch.Tensor)))
            hash(key)
        except TypeError:  # an argument that is neither a tensor nor hashable: traced op by op
            return fn(*args, **kwargs)
        if key not in self.templates:
            try:
                self.templates[key] = _template(fn, leaves, spec, where)
            except Exception:  # noqa: BLE001 - op by op, the call raises its own error, with its line
                self.templates[key] = None
        template = self.templates[key]
        if template is None:
            return fn(*args, **kwargs)
        if any(g is not None for g in template.grads) and torch.is_grad_enabled():
            outs = _Stamped.apply(template, _annotations(), *tensors)
        else:
            outs = _forward(template, _annotations(), tensors)[0]
        outs = iter(outs)
        out_leaves = [next(outs) if x is None else x for x in template.out_leaves]
        return optree.tree_unflatten(template.out_spec, out_leaves)


def _signature(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), tuple(x.stride()), x.dtype, x.device, _differentiated(x))


def _differentiated(x: torch.Tensor) -> bool:
    return bool(x.requires_grad) and (x.is_floating_point() or x.is_complex())


def _constant(x: Any) -> tuple:
    return type(x), x  # (True, 1 and 1.0 are equal, and may make different programs)


def _annotations() -> dict:
    return dict(fx_traceback.current_meta.get("custom") or {})


def _template(fn: Callable, leaves: list, spec: Any, where: list[int]) -> Template | None:
    """Trace `fn` over fresh stand-ins of the call's tensors: its forward, then its backward."""
    tensors = [leaves[i] for i in where]
    differentiated = [_differentiated(x) for x in tensors]

    def rebuild(inputs):
        full = list(leaves)
        for i, x in zip(where, inputs):
            full[i] = x
        args, kwargs = optree.tree_unflatten(spec, full)
        return fn(*args, **kwargs)

    with torch_compat.outside_the_trace():
        primals = [_like(x) for x in tensors]
        out = rebuild(primals)  # its outputs' shapes, for the gradients' stand-ins
        out_leaves, out_spec = optree.tree_flatten(out, none_is_leaf=True)
        out_tensors = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        if _aliases(out_tensors, primals):
            return None
        tangents = [_like(x) for x in out_tensors]
    mark: list[int] = []

    def joint(*flat):
        ins, cotangents = flat[:len(tensors)], flat[len(tensors):]

        def forward(*diff):
            it = iter(diff)
            out = rebuild([next(it) if d else x for x, d in zip(ins, differentiated)])
            return [x for x in optree.tree_leaves(out, none_is_leaf=True) if isinstance(x, torch.Tensor)]

        diff = [x for x, d in zip(ins, differentiated) if d]
        if not diff:
            outs = forward()
            mark.append(len(torch_compat.current_graph().nodes))
            return [*outs]
        outs, vjp = torch.func.vjp(forward, *diff)
        mark.append(len(torch_compat.current_graph().nodes))
        return [*outs, *vjp(list(cotangents))]

    graph = torch_compat.trace_nested(joint, [*primals, *tangents]).graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1].args[0]
    ops = [n for n in nodes if n.op not in ("placeholder", "output")]
    if any(n.op != "call_function" or _writes_input(n) for n in ops):
        return None  # it writes into an input, or reads a tensor that is not an argument (a closure's)
    if not all(isinstance(x, torch.fx.Node) for x in output):
        return None
    split = mark[0] - len(placeholders)
    grads: list = [None] * len(tensors)
    it = iter(output[len(out_tensors):])
    for i, d in enumerate(differentiated):
        if d:
            grads[i] = next(it)
    return Template(graph, placeholders[:len(tensors)], placeholders[len(tensors):], ops[:split], ops[split:],
                    list(output[:len(out_tensors)]), grads,
                    [None if isinstance(x, torch.Tensor) else x for x in out_leaves], out_spec, _annotations())


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=x.device,
                               requires_grad=False)


def _aliases(outs: list, ins: list) -> bool:
    storages = {x.untyped_storage()._cdata for x in ins}
    return any(x.untyped_storage()._cdata in storages for x in outs)


def _writes_input(node: torch.fx.Node) -> bool:
    """Whether `node` writes into one of the region's inputs (or a view of one)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    for i, arg in enumerate(schema.arguments):
        written = arg.alias_info is not None and arg.alias_info.is_write
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        while written and isinstance(value, torch.fx.Node):
            if value.op == "placeholder":
                return True
            view = getattr(value.target, "_schema", None)
            value = value.args[0] if view is not None and view.arguments and view.arguments[0].alias_info else None
    return False


def _copy(nodes: list, env: dict, graph: torch.fx.Graph, now: dict, then: dict) -> None:
    """Copy `nodes` into `graph` after what is there, their arguments read through `env`; each copy's
    annotations are those in force `now` with those the region made itself (beyond `then`'s)."""
    fresh: dict = {}
    for n in nodes:
        new = graph.create_node(n.op, n.target, map_arg(n.args, env.__getitem__), map_arg(n.kwargs, env.__getitem__),
                                name=_name(graph, n.target))
        new.meta = dict(n.meta)
        own = {k: _renumbered(k, v, fresh) for k, v in (n.meta.get("custom") or {}).items()
               if k not in then or then[k] != v}
        if now or own:
            new.meta["custom"] = {**now, **own}
        else:
            new.meta.pop("custom", None)
        env[n] = new


def _name(graph: torch.fx.Graph, target: Any) -> str | None:
    """The name `make_fx` gives a node of `target` (an op's packet name: `add`, `add_1`, ...)."""
    packet = getattr(target, "overloadpacket", None)
    return None if packet is None else graph._target_to_str(packet.__name__)


def _renumbered(key: str, mark: Any, fresh: dict) -> Any:
    if key not in PER_CALL:
        return mark
    if (key, mark) not in fresh:
        fresh[key, mark] = PER_CALL[key](mark)
    return fresh[key, mark]


def _forward(template: Template, now: dict, tensors) -> tuple[list, dict]:
    tracer = torch_compat.current_tracer()
    env = {p: torch_compat.node_of(x, tracer) for p, x in zip(template.primals, tensors)}
    _copy(template.forward, env, tracer.graph, now, template.context)
    return [torch_compat.tracked(_like_node(o), env[o], tracer) for o in template.outs], env


def _like_node(node: torch.fx.Node) -> torch.Tensor:
    return torch_compat.fake_like(node.meta["val"])


class _Stamped(torch.autograd.Function):
    """A region's template copied into the program; its backward copies the template's backward."""

    @staticmethod
    def forward(template: Template, now: dict, *tensors):
        outs, env = _forward(template, now, tensors)
        template.pending = env
        return tuple(outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # (under torch.func, the transform's own Function and the one it applies both call this)
        ctx.template, ctx.env = inputs[0], inputs[0].pending
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *cotangents):
        template, env = ctx.template, dict(ctx.env)
        tracer = torch_compat.current_tracer()
        for t, g in zip(template.tangents, cotangents):
            env[t] = torch_compat.node_of(g, tracer) if g is not None else _zeros(t, tracer)
        _copy(template.backward, env, tracer.graph, _annotations(), template.context)
        grads = [None if g is None else torch_compat.tracked(_like_node(g), env[g], tracer) for g in template.grads]
        return None, None, *grads


def _zeros(like: torch.fx.Node, tracer) -> torch.fx.Node:
    val = like.meta["val"]
    node = tracer.graph.call_function(torch.ops.aten.zeros.default, (list(val.shape),),
                                      {"dtype": val.dtype, "device": val.device})
    node.meta = {"val": val}
    return node
