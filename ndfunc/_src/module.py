"""`nf.nn`: a `torch.nn.Module` as what ndfunc wants - a tree of parameters and buffers, a pure
apply - and its PartitionSpecs, from the module's own tensor-parallel plan.

    params, buffers, apply = nf.nn.functional(model)
    loss = apply(params, buffers, ids, labels=ids).loss        # torch.func.functional_call
    specs = nf.nn.partition_specs(model, mesh, tp="tp", fsdp="dp_shard")

A Hugging Face model carries its Megatron plan (`model.tp_plan`: `'model.layers.*.self_attn.q_proj':
'colwise'`, ...); `partition_specs` turns it into a spec per parameter over `tp`, by the module
each parameter belongs to: a `Linear`'s weight is `(out, in)`, so colwise splits dim 0 (and the
bias), rowwise dim 1; an `Embedding`'s `(num, dim)`, rowwise splits the rows; transformers'
`Conv1D` (GPT-2) is `(in, out)`, the other way round. `fsdp` then splits the largest dim that TP
leaves whole and the axis divides, as FSDP2 shards every parameter. ndfunc partitions the global
program, so any specs give the single device's results; the plan decides only what moves.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch

from ndfunc._src import repeated_layers
from ndfunc._src.config import AXES as PARALLEL_AXES
from ndfunc._src.constraints import with_logical_constraint
from ndfunc._src.sharding.mesh import AbstractMesh
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.sharding.rules import current_rules

# The dtype `nf.mixed_precision` computes in while a jitted step is traced (None: as they are):
# `autodiff` casts differentiated float arguments to it, and a module's apply its parameters,
# differentiated or not (`functional`)
COMPUTE_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("ndfunc_compute_dtype",
                                                                                    default=None)
_COLWISE = ("colwise", "colwise_rep", "colwise_gather_output", "local_colwise", "packed_colwise",
            "embedding_colwise")
_ROWWISE = ("rowwise", "rowwise_rep", "local_rowwise", "packed_rowwise", "rowwise_split_input", "embedding_rowwise")


def functional(module: torch.nn.Module) -> tuple[dict, dict, Callable[..., Any]]:
    """`(params, buffers, apply)` of `module`: its parameters and buffers by name (detached; tied
    parameters once, under their first name), and `apply(params, buffers, *args, **kwargs)`, the
    module called on those (`torch.func.functional_call`, ties kept).

    A parameter with `requires_grad=False` (a frozen vision tower, LoRA's base weights, Whisper's
    sinusoidal positions) is among the buffers: a constant of the step, given no gradient and no
    optimizer state, as torch's autograd and optimizers leave it. Under `nf.mixed_precision` every
    parameter, frozen or not, computes in its `param_dtype` in every call, differentiated or not
    (an eval step's too), and so do the call's float inputs, as FSDP2's policy casts in every
    forward (`cast_forward_inputs`). Pass the buffers
    as an argument of the step with `partition_specs(module, mesh, ..., of=buffers)` to lay them
    out (a frozen base split as FSDP2 splits it); closed over, each is whole on every rank.

    Under `nf.jit`, the layers of a `ModuleList` that are alike are traced once and copied per layer
    (`ndfunc._src.repeated_layers`), as a layer marked `torch.compiler.nested_compile_region` is. A
    module whose forward takes `use_cache` (a Hugging Face model) is called with `use_cache=False`
    unless the call says otherwise: a train step has no use for a KV cache, and layers that write one
    are traced op by op.

    Under `nf.sharding.axis_rules`, the hidden states a layer of a `ModuleList` takes and gives (its
    first argument and its first result, where they are (batch, sequence, features) of the call's
    batch: the first two dims of its first tensor of rank two or more, the tokens) are laid out as
    the rules lay out `('batch', 'seq', None)`: the residual stream between layers split as the batch
    is and whole in its width, as FSDP and Megatron keep it (and as the project's llama constrains
    it). Left free, the partitioner can find a plan that keeps each weight where it lies and moves
    the activations instead, which costs more once the transforms apply (transformers'
    `LlamaForCausalLM` of Llama 3 8B's dims on 1x8x2x4, under `nf.fsdp` and bf16: 4.0 GB moved a
    rank a step for two layers, against 2.1 GB)."""
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    buffers = {name: p.detach() for name, p in module.named_parameters() if not p.requires_grad}
    frozen = frozenset(buffers)
    buffers.update(module.named_buffers())
    caches = "use_cache" in inspect.signature(module.forward).parameters

    def apply(params: Mapping, buffers: Mapping, *args, **kwargs):
        if caches:
            kwargs.setdefault("use_cache", False)
        if (dtype := COMPUTE_DTYPE.get()) is not None:  # nf.mixed_precision: in every forward, as FSDP2 casts
            # (differentiated parameters come cast already: `.to` leaves them as they are)
            params = {k: v.to(dtype) if v.is_floating_point() else v for k, v in params.items()}
            if frozen:
                buffers = {k: v.to(dtype) if k in frozen and v.is_floating_point() else v for k, v in buffers.items()}
            # and its float inputs, as FSDP2's `cast_forward_inputs` does: an image, a feature vector
            args, kwargs = optree.tree_map(
                lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, (args, kwargs))
        with repeated_layers.routed(module), _residual_laid_out(module, args, kwargs):
            return torch.func.functional_call(module, (dict(params), dict(buffers)), args, kwargs)

    apply.__name__ = f"{type(module).__name__}.apply"
    return params, buffers, apply


_RESIDUAL = ("batch", "seq", None)  # the logical names of a layer's hidden states


def _residual_laid_out(module: torch.nn.Module, args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
    """While inside, under axis rules, each layer of `module`'s layer lists has the hidden states it
    takes and gives constrained to `_RESIDUAL` (`functional`), where they are the batch's: (batch,
    sequence) the first two dims of the call's first tensor of two or more (the token ids, or
    embeddings), so that a vision tower's (images, patches) are left as they are."""
    batch = next((tuple(x.shape[:2]) for x in optree.tree_leaves((args, kwargs))
                  if isinstance(x, torch.Tensor) and x.ndim >= 2), None)
    if current_rules() is None or batch is None:
        return contextlib.nullcontext()
    return repeated_layers.forwards_replaced([(layer, _at_the_boundaries(layer.forward, batch))
                                              for owner in repeated_layers.layer_lists(module) for layer in owner])


def _at_the_boundaries(forward: Callable, batch: tuple[int, int]) -> Callable:
    calling = []  # a layer traced once for all calls itself inside its region: constrained outside it only

    def hidden(x) -> bool:
        return isinstance(x, torch.Tensor) and x.ndim == 3 and x.is_floating_point() and tuple(x.shape[:2]) == batch

    def laid_out(*args, **kwargs):
        if calling:
            return forward(*args, **kwargs)
        if args and hidden(args[0]):
            args = (with_logical_constraint(args[0], _RESIDUAL), *args[1:])
        calling.append(True)
        try:
            out = forward(*args, **kwargs)
        finally:
            calling.pop()
        if hidden(out):
            return with_logical_constraint(out, _RESIDUAL)
        if type(out) is tuple and out and hidden(out[0]):  # (hidden states, attention weights, ...)
            return (with_logical_constraint(out[0], _RESIDUAL), *out[1:])
        return out
    return laid_out


def partition_specs(module: torch.nn.Module, mesh: AbstractMesh, *, tp: str | None = None,
                    fsdp: str | tuple[str, ...] | None = None,
                    plan: Mapping[str, str] | None = None,
                    of: Mapping[str, Any] | None = None) -> dict[str, PartitionSpec]:
    """A PartitionSpec per parameter `functional(module)` gives as params (those with
    `requires_grad`), or per name of `of` (its buffers: a frozen parameter laid out as the others,
    a buffer whole).

    `tp`: the mesh axis of the tensor-parallel plan, `plan` (module-path patterns from `module`, `*`
    one path component, to 'colwise' or 'rowwise' and transformers' variants of them), by default
    the module's own (`tp_plan`, or transformers' `_tp_plan`), or where it carries none (a PEFT
    wrapper) those of the models inside it, each read from where it sits; a parameter the plan
    does not name stays whole over `tp`. A layer the plan names that PEFT's
    LoRA wraps is split as the plan says (its `base_layer`), and so are its adapters, so that the
    low-rank path's result is split as the layer's: colwise splits `lora_B`'s outputs, rowwise
    `lora_A`'s inputs; the other stays whole. `fsdp`: the axis (or axes, major to minor, as
    torchtitan's FSDP over `('dp_shard', 'cp')`) every parameter is also split over, along its
    largest dim that `tp` leaves whole and the axes' ranks divide (none: whole). One of
    `ParallelConfig`'s axes that `mesh` does not have splits nothing, so the same call serves every
    layout; any other name the mesh lacks is an error.
    """
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    named = [tp] + (list(fsdp) if isinstance(fsdp, (tuple, list)) else [fsdp])
    unknown = [a for a in named if a is not None and a not in sizes and a not in PARALLEL_AXES]
    if unknown:
        raise ValueError(f"partition_specs: mesh axis {unknown[0]!r} is neither one of this mesh's "
                         f"{list(mesh.axis_names)} nor one of ParallelConfig's {list(PARALLEL_AXES)} (which a mesh "
                         f"without them leaves unsplit); name an axis of the mesh.")
    tp = tp if tp in sizes else None
    fsdp_axes = tuple(axis for axis in named[1:] if axis in sizes)  # (major to minor)
    fsdp = fsdp_axes[0] if len(fsdp_axes) == 1 else fsdp_axes or None
    if plan is None and tp is not None:
        plan = _carried_plan(module)
    rules = [(re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + r"\Z"), style)
             for pattern, style in (plan or {}).items()]
    kinds = {name: sub for name, sub in module.named_modules()}
    shards = math.prod(sizes[axis] for axis in fsdp_axes)
    names = [name for name, p in module.named_parameters() if p.requires_grad] if of is None else list(of)
    specs = {name: PartitionSpec() for name in names}  # (a buffer: whole)
    for name, p in module.named_parameters():
        if name not in specs:
            continue
        owner, _, leaf = name.rpartition(".")
        spec: list = [None] * p.ndim
        style, role = _tp_style(owner, rules) if tp is not None else (None, None)
        if style is not None:
            dim = _tp_dim(kinds.get(owner), leaf, style, p.ndim) if role is None else _lora_dim(role, leaf, style)
            if dim is not None and p.shape[dim] % sizes[tp] == 0:
                spec[dim] = tp
        if shards > 1:
            free = [d for d in range(p.ndim) if spec[d] is None and p.shape[d] % shards == 0]
            if free:
                spec[max(free, key=lambda d: (p.shape[d], -d))] = fsdp
        specs[name] = PartitionSpec(*spec)
    return specs


def _carried_plan(module: torch.nn.Module) -> dict[str, str]:
    """The TP plan `module` carries; where it carries none (a PEFT wrapper), those its submodules
    carry, each pattern prefixed by where its module sits (an outer one first: it wins where both
    name a module)."""
    own = _own_plan(module)
    if own:
        return dict(own)
    plan: dict[str, str] = {}
    for path, sub in module.named_modules():
        for pattern, style in (_own_plan(sub) or {}).items():
            plan.setdefault(f"{path}.{pattern}" if path else pattern, style)
    return plan


def _own_plan(module: torch.nn.Module) -> Mapping | None:
    """`module.tp_plan` (or transformers' `_tp_plan`) as the module itself defines it, a property
    read: not a plan another object's `__getattr__` forwards (PEFT's wrappers hand back the inner
    model's, whose patterns start below them)."""
    for name in ("tp_plan", "_tp_plan"):
        try:
            found = inspect.getattr_static(module, name)
        except AttributeError:
            continue
        if isinstance(found, property):
            found = getattr(module, name)
        if isinstance(found, Mapping) and found:
            return found
    return None


def _tp_style(owner: str, rules: list) -> tuple[str | None, str | None]:
    """The plan's style for the module at path `owner`, and its role in a PEFT LoRA wrapper of
    the module the plan names (None: it is that module): 'base' (`base_layer`), 'lora_A' or
    'lora_B' (`lora_A.<adapter>`)."""
    style = next((s for rx, s in rules if rx.match(owner)), None)
    if style is not None:
        return style, None
    parts = owner.split(".")
    for role, depth in (("base", 1), ("lora_A", 2), ("lora_B", 2)):
        if len(parts) > depth and parts[-depth] == ("base_layer" if role == "base" else role):
            wrapped = ".".join(parts[:-depth])
            style = next((s for rx, s in rules if rx.match(wrapped)), None)
            if style is not None:
                return style, None if role == "base" else role
    return None, None


def _lora_dim(role: str, leaf: str, style: str) -> int | None:
    """The dim of a LoRA adapter's `leaf` that the wrapped layer's TP style splits: colwise the
    outputs of `lora_B` (r -> out), rowwise the inputs of `lora_A` (in -> r); whole otherwise (the
    rank r is small: its partial sums are what a rowwise layer reduces)."""
    if leaf != "weight":
        return None
    if style in _COLWISE:
        return 0 if role == "lora_B" else None
    return 1 if role == "lora_A" and style in _ROWWISE else None


def _tp_dim(owner: torch.nn.Module | None, leaf: str, style: str, ndim: int) -> int | None:
    """The dim of parameter `leaf` of `owner` that TP style `style` splits (None: it stays whole)."""
    colwise = style in _COLWISE
    if not colwise and style not in _ROWWISE:
        return None  # replicate, sequence_parallel, MoE routers and experts: whole over tp
    if isinstance(owner, torch.nn.Embedding):
        return (1 if colwise else 0) if leaf == "weight" else None
    if type(owner).__name__ == "Conv1D":  # transformers' (in, out) linear (GPT-2)
        return (ndim - 1 if colwise else 0) if leaf == "weight" else (0 if colwise else None)
    if leaf == "bias":  # (out,): colwise splits it with the outputs; rowwise adds it whole
        return 0 if colwise else None
    return 0 if colwise else (1 if ndim > 1 else None)
