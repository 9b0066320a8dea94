"""A model's repeated layers as regions, found without a mark.

A Hugging Face model keeps its decoder layers in an `nn.ModuleList` and calls them in a loop; no
layer is marked with `torch.compiler.nested_compile_region`, so op by op its step's trace grows with
every layer. While `nf.nn.functional`'s apply runs under `nf.jit`'s tracer (`routed`), each layer of a
list whose layers are alike is called as one region function shared by those layers, with the layer's
parameters and buffers as arguments (`torch.func.functional_call`): traced once per signature and
copied at every call (`ndfunc._src.stamp`), as a marked layer is.

Layers are alike when they have the same module types, the same parameter and buffer names, shapes
and dtypes, and the same other attributes, equal (numbers, strings, dtypes) or the same object (a
config), with one exception: an int attribute that every layer of the list holds differently (an
index: transformers' `layer_idx`, read to write a KV cache) is left out, and is hidden while the shared
template is traced, so that reading it fails the template and the layers are traced op by op. A layer
is also traced op by op where the region would not be the call:
- a non-tensor argument that is not a plain value (None, a number, a string, a dtype, a device, or a
  tuple, list or dict of these): a KV cache object, which the layer writes into;
- a hook on the layer or on anything in it (or a global module hook), which the copies would not run;
- a layer whose `forward` was replaced on the instance (accelerate's hooks).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import optree
import torch

from ndfunc._src import regions, torch_compat

_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}  # torch's own bookkeeping on every module


class _PerLayer:
    """What an attribute that every layer holds differently reads as while the shared template is
    traced: any use of it fails the trace, so the layers are traced op by op."""

    def __init__(self, name: str):
        self.name = name

    def _refuse(self, *args, **kwargs):
        raise TypeError(f"{self.name} differs in every layer and is not read by a layer traced once for all")

    __index__ = __int__ = __float__ = __bool__ = __hash__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __format__ = __str__ = _refuse


class _Alike:
    """The layers of one list that are alike, and the region function they share."""

    def __init__(self, layers: list[torch.nn.Module], hidden: list[tuple[str, str]]):
        self.layers, self.hidden = layers, hidden
        self.current: torch.nn.Module | None = None  # the layer being called (op by op, it runs itself)
        self.inside = False  # the region's own call of a layer: its forward as it is
        self.tracing = False
        self.fn = functools.partial(_region, self)
        self.fn.ndfunc_template_context = self.template  # entered by `stamp` while it traces the template

    @contextlib.contextmanager
    def template(self) -> Iterator[None]:
        """The first layer, its per-layer attributes hidden: the template is traced on it."""
        layer = self.layers[0]
        kept = [(layer.get_submodule(path), name) for path, name in self.hidden]
        kept = [(sub, name, vars(sub)[name]) for sub, name in kept]
        self.tracing = True
        try:
            for sub, name, _ in kept:
                vars(sub)[name] = _PerLayer(f"{type(sub).__name__}.{name}")
            yield
        finally:
            for sub, name, value in kept:
                vars(sub)[name] = value
            self.tracing = False


def _region(alike: _Alike, tensors: dict, *args, **kwargs):
    """A layer of `alike` called on `tensors` (its parameters and buffers by name)."""
    layer = alike.layers[0] if alike.tracing else alike.current
    alike.inside, was = True, alike.inside
    try:
        return torch.func.functional_call(layer, tensors, args, kwargs)
    finally:
        alike.inside = was


@contextlib.contextmanager
def routed(module: torch.nn.Module) -> Iterator[None]:
    """While inside, under `nf.jit`'s tracer, each of `module`'s layers that are alike is called as
    their shared region (outside a trace: nothing changes)."""
    call = regions.current_call()
    if call is None:
        yield
        return
    with forwards_replaced([(layer, _routed_forward(alike, layer, type(layer).forward.__get__(layer)))
                            for alike in _alike_layers(module) for layer in alike.layers]):
        yield


_OWN = object()  # a layer's forward is its class's


@contextlib.contextmanager
def forwards_replaced(replaced: list[tuple[torch.nn.Module, Callable]]) -> Iterator[None]:
    """While inside, each layer's `forward` is the one given; after, the one it had (its class's,
    or one set on it: `nf.remat`'s, or another `forwards_replaced`'s)."""
    before = [(layer, vars(layer).get("forward", _OWN)) for layer, _ in replaced]
    for layer, forward in replaced:
        vars(layer)["forward"] = forward
    try:
        yield
    finally:
        for layer, forward in reversed(before):
            if forward is _OWN:
                vars(layer).pop("forward", None)
            else:
                vars(layer)["forward"] = forward


def layer_lists(module: torch.nn.Module) -> Iterator[torch.nn.ModuleList]:
    """`module`'s `ModuleList`s of two or more: where a model keeps its layers."""
    return (owner for owner in module.modules() if isinstance(owner, torch.nn.ModuleList) and len(owner) > 1)


def _routed_forward(alike: _Alike, layer: torch.nn.Module, forward):
    def routed_forward(*args, **kwargs):
        call = regions.current_call()
        if call is None or alike.inside or torch_compat.runs_hooks(layer) or not _plain(args, kwargs):
            return forward(*args, **kwargs)
        alike.current = layer
        tensors = {**dict(layer.named_parameters(remove_duplicate=False)),
                   **dict(layer.named_buffers(remove_duplicate=False))}
        return call(alike.fn, (tensors, *args), kwargs)
    return routed_forward


def _alike_layers(module: torch.nn.Module) -> list[_Alike]:
    found = []
    for owner in layer_lists(module):
        layers = [layer for layer in owner if "forward" not in vars(layer)]
        hidden = _per_layer(layers)
        groups: dict = {}
        for layer in layers:
            groups.setdefault(_structure(layer, hidden), []).append(layer)
        found += [_Alike(group, sorted(hidden)) for group in groups.values() if len(group) > 1]
    return found


def _per_layer(layers: list[torch.nn.Module]) -> set[tuple[str, str]]:
    """(submodule path, attribute) of the int attributes every layer holds differently."""
    if len(layers) < 2:
        return set()
    values: dict = {}
    for layer in layers:
        for path, sub in layer.named_modules(remove_duplicate=False):
            for name, value in vars(sub).items():
                if type(value) is int and name not in _INTERNALS:
                    values.setdefault((path, name), []).append(value)
    return {at for at, seen in values.items() if len(seen) == len(layers) and len(set(seen)) == len(seen)}


def _structure(layer: torch.nn.Module, hidden: set, depth: int = 0) -> tuple:
    """What makes two layers the same program: types, tensors' names, shapes and dtypes, the other
    attributes (`_key`), less `hidden`."""
    parts = []
    for path, sub in layer.named_modules(remove_duplicate=False):
        tensors = tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in
                        (*sub._parameters.items(), *sub._buffers.items()) if t is not None)
        attrs = tuple(sorted((name, _key(value, depth)) for name, value in vars(sub).items()
                             if name not in _INTERNALS and (path, name) not in hidden))
        parts.append((path, type(sub), tensors, attrs))
    return tuple(parts)


def _key(value, depth: int) -> tuple:
    """An attribute as `_structure` compares it: plain values by value; tuples, lists and dicts by
    what they hold; a module held outside the module tree (transformers' kernel functions) by its
    structure; anything else by identity."""
    if isinstance(value, regions.PLAIN):
        return (type(value), repr(value))
    if depth < 4:
        if type(value) in (tuple, list):
            return (type(value), tuple(_key(x, depth + 1) for x in value))
        if type(value) is dict and all(isinstance(k, str) for k in value):
            return (dict, tuple(sorted((k, _key(v, depth + 1)) for k, v in value.items())))
        if isinstance(value, torch.nn.Module):
            return ("module", _structure(value, set(), depth + 1))
    return ("object", id(value))


def _plain(args: tuple, kwargs: dict) -> bool:
    """Whether every non-tensor argument is a plain value (no cache object to write into)."""
    return all(isinstance(x, (torch.Tensor, *regions.PLAIN)) for x in optree.tree_leaves((args, kwargs), none_is_leaf=True))

