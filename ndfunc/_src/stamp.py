"""Repeated regions, traced once and copied at every call.

A function marked with `torch.compiler.nested_compile_region` (PyTorch's word for "this region
repeats: compile it once") or with ndfunc's `regions.repeated` is, under `nf.jit`'s tracer, traced
once per signature into a template: its forward and, where an input is differentiated under a
`torch.func` grad, its backward (`torch.func.vjp`). The signature is:
- the arguments' structure;
- each tensor's shape, strides, offset, dtype, device and whether it is differentiated;
- the other arguments' types and values (floats by their bits);
- grad and inference mode, the default dtype, autocast's state and the function modes in force.
Every call then copies the template's forward nodes into the program, wired to the call's inputs,
as the tracer would have recorded them op by op: the same ops, named alike, with the same
annotations (`nf.remat`'s regions, the forward and backward marks). The function's Python is not
run and its ops are not dispatched again. A decoder layer traced once serves all 80 of a 70B
model's. Gradients flow through an `autograd.Function`. Its backward copies the template's
backward; where gradients come in strided otherwise, or not at all to some outputs, it copies a
backward traced for that (`_variant`). Inputs the region does not use get no gradient, and outputs
that no differentiated input reaches are not differentiable, as op by op. What its backward reads
is saved as autograd saves it, so a write in place in between is refused as op by op. Where one
region's gradient meets another's (a weight read by two calls), autograd may add them in another
order than op by op: the same values.

A marked function must be pure, as torch.compile's regions are: what it computes depends only on
its arguments and the state above, with no Python state read or written across calls. These are
traced op by op, as unmarked code is:
- a region that writes into an input, returns one, returns two outputs sharing memory, or reads a
  tensor it was not passed (a closure's);
- a region that returns an object optree cannot see into (other than a tensor, a plain value or a
  container of them), which may hold tensors;
- a call under `vmap`, `jvp` or a grad of a grad;
- a differentiated call under plain autograd, which may differentiate twice;
- a call given a tensor the trace did not make (a constant), or an unhashable argument;
- a region whose template fails to trace, which then raises its own error from its own line.
Outside `nf.jit`'s tracer the mark is what it is there (torch's: a plain call eager, one compiled
region under torch.compile; ndfunc's: a plain call).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.fx.traceback as fx_traceback
from torch.fx.node import map_arg

from ndfunc._src import regions, torch_compat, write_ops


# Annotations that name one call (`nf.remat`'s region ids): made inside a region, each copy draws
# its own, `PER_CALL[key](mark)`, as the call would have.
PER_CALL: dict[str, Callable[[Any], Any]] = {}
TENSOR = object()  # a template's tensor output among its output leaves (a layer may return None: Falcon's)

# Each copied node's meta[CALL]: (the template or backward variant it copies, 0 in its forward or
# 1 in its backward, the call, its place among the nodes copied), so that a call's nodes, forward
# and backward, are known as one repeat of its template's other calls (the partitioner plans a
# chain of alike calls once: `planning/repeats.py`).
CALL = "ndfunc_call"
_UIDS = itertools.count()
_CALLS = itertools.count()


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
    out_leaves: list[Any]  # the outputs' leaves, tensors as `TENSOR` (a None is a None the layer returned)
    out_spec: Any
    context: dict  # the annotations in force where it was traced
    traced_from: tuple = ()  # (fn, leaves, spec, where, grad): to trace it again for other gradient strides
    modes: tuple = ()  # the function modes in force where it was traced (in force again for a variant)
    differentiable: list = dataclasses.field(default_factory=list)  # per tensor output: made from a differentiated input
    saved: tuple = ((), ())  # which inputs and outputs its backward reads (as autograd saves them)
    variants: dict = dataclasses.field(default_factory=dict)  # gradient strides -> the backward traced for them
    pending: tuple | None = None  # the forward being copied: (its nodes, its call), for `setup_context`
    uid: int = dataclasses.field(default_factory=lambda: next(_UIDS))


class Stamps:
    """The templates of one trace, by region and signature."""

    def __init__(self) -> None:
        self.templates: dict = {}

    def call(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in where]
        tracer = torch_compat.current_tracer()
        # op by op: under vmap, jvp or a grad of a grad; outside a trace (`nf.eval_shape` of it, the
        # shape pass of a region around this one); on a tensor the trace did not make (a constant)
        transforms = torch_compat.func_transforms()
        if tracer is None or transforms not in ([], ["Grad"]):
            return fn(*args, **kwargs)
        nodes = [torch_compat.node_of(x, tracer) for x in tensors]
        if any(n is None for n in nodes):
            return fn(*args, **kwargs)
        grad = torch.is_grad_enabled()
        with torch._C.DisableTorchFunction():  # a tensor's properties, read past every function mode
            signatures = tuple(_signature(x, grad) for x in tensors)
        if grad and not transforms and any(s[-1] for s in signatures):
            return fn(*args, **kwargs)  # plain autograd may differentiate twice (create_graph): op by op
        try:
            key = (fn, spec, signatures, tuple(_constant(x) for x in leaves if not isinstance(x, torch.Tensor)),
                   _context())
            hash(key)
        except TypeError:  # an argument that is neither a tensor nor hashable: traced op by op
            return fn(*args, **kwargs)
        if key not in self.templates:
            try:
                self.templates[key] = _template(fn, leaves, spec, where, grad)
            except Exception:  # noqa: BLE001 - op by op, the call raises its own error, with its line
                self.templates[key] = None
        template = self.templates[key]
        if template is None:
            return fn(*args, **kwargs)
        if any(g is not None for g in template.grads):
            outs = _Stamped.apply(template, _annotations(), nodes, *tensors)
        else:
            outs = _forward(template, _annotations(), nodes, tracer)[0]
        outs = iter(outs)
        out_leaves = [next(outs) if x is TENSOR else x for x in template.out_leaves]
        return optree.tree_unflatten(template.out_spec, out_leaves)


def _signature(x: torch.Tensor, grad: bool) -> tuple:
    return (tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.device, _differentiated(x, grad))


def _differentiated(x: torch.Tensor, grad: bool) -> bool:
    return grad and bool(x.requires_grad) and (x.is_floating_point() or x.is_complex())


def _constant(x: Any) -> tuple:
    # by type (True, 1 and 1.0 are equal and may make different programs); floats by their bits
    # (0.0 == -0.0; nan != nan)
    return (float, x.hex()) if type(x) is float else (type(x), x)


def _context() -> tuple:
    """What else a region's program depends on: grad and inference mode, the default dtype,
    autocast's state on each device kind, the function modes in force."""
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(), autocast,
            tuple(type(m) for m in torch_compat.function_modes()))


def _annotations() -> dict:
    return dict(fx_traceback.current_meta.get("custom") or {})


def _template(fn: Callable, leaves: list, spec: Any, where: list[int], grad: bool,
              tangent_strides: tuple | None = None) -> Template | None:
    """Trace `fn` over fresh stand-ins of the call's tensors: its forward, then its backward (with
    gradients coming in strided as `tangent_strides` say; default: as the outputs are). A function
    with an `ndfunc_template_context` is traced inside it (`repeated_layers`: what differs per layer
    hidden)."""
    context = getattr(fn, "ndfunc_template_context", contextlib.nullcontext)
    with context():
        return _traced_template(fn, leaves, spec, where, grad, tangent_strides)


def _traced_template(fn: Callable, leaves: list, spec: Any, where: list[int], grad: bool,
                     tangent_strides: tuple | None) -> Template | None:
    tensors = [leaves[i] for i in where]
    differentiated = [_differentiated(x, grad) for x in tensors]

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
        if not all(isinstance(x, (torch.Tensor, *regions.PLAIN)) for x in out_leaves):
            return None  # an output optree cannot see into (an object holding tensors): op by op
        out_tensors = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        storages = [x.untyped_storage()._cdata for x in out_tensors]
        if len(set(storages)) < len(storages) or set(storages) & {x.untyped_storage()._cdata for x in primals}:
            return None  # two outputs that share memory, or an output that is an input: op by op
        strides = tangent_strides or [tuple(x.stride()) for x in out_tensors]
        kept = [i for i, stride in enumerate(strides) if stride is not None]  # outputs a gradient comes to
        tangents = [_like(out_tensors[i], strides[i]) for i in kept]
    mark: list[int] = []

    def joint(*flat):
        ins, cotangents = flat[:len(tensors)], flat[len(tensors):]

        def forward(*diff):
            it = iter(diff)
            out = rebuild([next(it) if d else x for x, d in zip(ins, differentiated)])
            return [x for x in optree.tree_leaves(out, none_is_leaf=True) if isinstance(x, torch.Tensor)]

        def differentiated_outputs(*diff):
            outs = forward(*diff)
            return [outs[i] for i in kept], outs

        diff = [x for x, d in zip(ins, differentiated) if d]
        if not diff or not kept:  # no gradient to go anywhere: the forward alone
            outs = forward(*diff)
            mark.append(len(torch_compat.current_graph().nodes))
            return outs
        _, vjp, outs = torch.func.vjp(differentiated_outputs, *diff, has_aux=True)
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
    primal_nodes, tangent_nodes = placeholders[:len(tensors)], placeholders[len(tensors):]
    from_tangents = _reached(tangent_nodes)
    grads: list = [None] * len(tensors)
    dropped = []
    it = iter(output[len(out_tensors):])
    for i, d in enumerate(differentiated):
        if d and (g := next(it, None)) is not None:
            if g in from_tangents:
                grads[i] = g
            else:  # not reached by a gradient (an input it does not use): zeros; none at all op by op
                dropped.append(g)
    outs = list(output[:len(out_tensors)])
    from_differentiated = _reached([p for p, d in zip(primal_nodes, differentiated) if d])
    backward = _without(ops[split:], dropped, keep=set(outs) | set(grads))
    read = {a for n in backward for a in n.all_input_nodes}
    return Template(graph, primal_nodes, tangent_nodes, ops[:split], backward, outs, grads,
                    [TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves], out_spec, _annotations(),
                    traced_from=(fn, leaves, spec, where, grad), modes=tuple(torch_compat.function_modes()),
                    differentiable=[o in from_differentiated for o in outs],
                    saved=([i for i, p in enumerate(primal_nodes) if p in read], [i for i, o in enumerate(outs) if o in read]))


def _like(x: torch.Tensor, stride: tuple | None = None) -> torch.Tensor:
    return torch.empty_strided(tuple(x.shape), tuple(x.stride()) if stride is None else stride, dtype=x.dtype,
                               device=x.device, requires_grad=False)


def _without(nodes: list, dropped: list, keep: set) -> list:
    """`nodes` less `dropped` and what only they read (the zeros `vjp` makes for an unused input)."""
    gone, stack = set(), [n for n in dropped if n not in keep]
    while stack:
        n = stack.pop()
        if n in gone or n in keep or any(u not in gone and u.op != "output" for u in n.users):
            continue
        gone.add(n)
        stack.extend(a for a in n.all_input_nodes if a.op != "placeholder")
    return [n for n in nodes if n not in gone]


def _reached(starts: list) -> set:
    """The nodes computed from any of `starts` (them included)."""
    reached, stack = set(starts), list(starts)
    while stack:
        for user in stack.pop().users:
            if user not in reached:
                reached.add(user)
                stack.append(user)
    return reached


def _writes_input(node: torch.fx.Node) -> bool:
    """Whether `node` writes into one of the region's inputs (or a view of one)."""
    for value in write_ops.written_values(node):
        while isinstance(value, torch.fx.Node):
            if value.op == "placeholder":
                return True
            view = getattr(value.target, "_schema", None)
            value = value.args[0] if view is not None and view.arguments and view.arguments[0].alias_info else None
    return False


def _copy(nodes: list, env: dict, graph: torch.fx.Graph, now: dict, then: dict, call: tuple) -> None:
    """Copy `nodes` into `graph` after what is there, their arguments read through `env`; each copy's
    annotations are those in force `now` with those the region made itself (beyond `then`'s), and
    its `CALL` mark `call` (template, part, call) with its place."""
    fresh: dict = {}
    for place, n in enumerate(nodes):
        new = torch_compat.new_node(graph, n.op, n.target, map_arg(n.args, env.__getitem__), map_arg(n.kwargs, env.__getitem__),
                       name=_name(graph, n.target))
        new.meta.update(n.meta)  # (into its own fresh dict: assigning `meta` costs fx a table update)
        own = {k: _renumbered(k, v, fresh) for k, v in (n.meta.get("custom") or {}).items()
               if k not in then or then[k] != v}
        if now or own:
            new.meta["custom"] = {**now, **own}
        else:
            new.meta.pop("custom", None)
        new.meta[CALL] = (*call, place)
        env[n] = new


def _name(graph: torch.fx.Graph, target: Any) -> str | None:
    """The name `make_fx` gives a node of `target` (an op's packet name: `add`, `add_1`, ...)."""
    if target in _NAMES:
        return _NAMES[target]
    packet = getattr(target, "overloadpacket", None)
    name = _NAMES[target] = None if packet is None else graph._target_to_str(packet.__name__)
    return name


_NAMES: dict = {}  # target -> `_name` (found once: a program copies tens of thousands of nodes)


def _renumbered(key: str, mark: Any, fresh: dict) -> Any:
    if key not in PER_CALL:
        return mark
    if (key, mark) not in fresh:
        fresh[key, mark] = PER_CALL[key](mark)
    return fresh[key, mark]


def _forward(template: Template, now: dict, nodes: list, tracer) -> tuple[list, dict, int]:
    env, call = dict(zip(template.primals, nodes)), next(_CALLS)
    _copy(template.forward, env, tracer.graph, now, template.context, (template.uid, 0, call))
    return [torch_compat.tracked(_like_node(o), env[o], tracer) for o in template.outs], env, call


def _like_node(node: torch.fx.Node) -> torch.Tensor:
    return torch_compat.fake_like(node.meta["val"])


class _Stamped(torch.autograd.Function):
    """A region's template copied into the program; its backward copies the template's backward."""

    @staticmethod
    def forward(template: Template, now: dict, nodes: list, *tensors):
        outs, env, call = _forward(template, now, nodes, torch_compat.current_tracer())
        template.pending = env, call
        return tuple(outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        # (under torch.func, the transform's own Function and the one it applies both call this)
        template = inputs[0]
        ctx.template, (ctx.env, ctx.call) = template, template.pending
        ctx.mark_non_differentiable(*[o for o, d in zip(output, template.differentiable) if not d])
        ctx.set_materialize_grads(False)
        # saved as op-by-op tracing's autograd saves them: written in place after, backward refuses
        ins, outs = template.saved
        ctx.save_for_backward(*[inputs[3 + i] for i in ins], *[output[i] for i in outs])

    @staticmethod
    def backward(ctx, *cotangents):  # (under one torch.func grad level only: its copies record no graph)
        ctx.saved_tensors  # noqa: B018 - autograd's check that nothing saved was written since
        template, env = ctx.template, dict(ctx.env)
        tracer = torch_compat.current_tracer()
        strides = tuple(None if g is None else tuple(g.stride()) for g in cotangents)
        variant = _variant(template, strides)
        if variant is not template:  # its forward's nodes are this call's copies of the template's
            env.update((v, env[t]) for v, t in zip(variant.primals + variant.forward, template.primals + template.forward))
        incoming = {}
        for t, g in zip(variant.tangents, [g for g in cotangents if g is not None]):
            env[t] = torch_compat.node_of(g, tracer)
            incoming[t] = g
        _copy(variant.backward, env, tracer.graph, _annotations(), variant.context, (variant.uid, 1, ctx.call))
        made = set(variant.backward)
        grads = []
        for g in variant.grads:
            if g is None:
                grads.append(None)
            elif incoming.get(g) is not None:
                grads.append(incoming[g])  # the gradient coming in, passed on as it is
            else:  # a node this backward made: what it makes; one made before: a tensor of it
                grads.append(torch_compat.tracked(_like_node(g), env[g], tracer, own=g in made))
        return None, None, None, *grads


def _variant(template: Template, strides: tuple) -> Template:
    """The template whose backward takes gradients strided as `strides` (None: no gradient comes to
    that output): itself where every output gets one strided as it is, else the region traced again
    for them (its forward the same, op for op: its nodes stand for the template's by position)."""
    if strides == tuple(tuple(o.meta["val"].stride()) for o in template.outs):
        return template
    if strides not in template.variants:
        fn, leaves, spec, where, grad = template.traced_from
        with contextlib.ExitStack() as modes:
            # traced again inside autograd's backward, where the modes that saw the forward (the
            # tracer's: SDPA as ndfunc.attention) are off while their own handler runs
            in_force = torch_compat.function_modes()
            for mode in template.modes:
                if not any(m is mode for m in in_force):
                    modes.enter_context(mode)
            variant = _template(fn, leaves, spec, where, grad, strides)
        if variant is None or [n.target for n in variant.forward] != [n.target for n in template.forward]:
            raise RuntimeError(f"{getattr(fn, '__name__', fn)}: its backward for gradients strided {strides} "
                               "traced to another forward; mark it only if it computes the same ops each time.")
        template.variants[strides] = variant
    return template.variants[strides]
