"""Donation: results written into the buffers of donated arguments, and donated arguments retired.

In the local program each result that matches a donated input's local shape and dtype (in order,
as JAX pairs them) is copied into that input's buffer right after the input's last use, and later
readers read the buffer, so the new value's temporary dies at once: a step's peak holds one copy of the parameters and optimizer
state, not two. Afterwards the donated tensor would silently show the new values, so it is
retired (DTensor or plain): touching it raises; the results are new objects on the same memory.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ndfunc._src.buffers import readers
from ndfunc._src.partition.planning.layout import local_shape

aten = torch.ops.aten


def apply_donation(program) -> None:
    """Rewrite `program.local` so results reuse donated input buffers; fill `program.donation`."""
    if not program.donated:
        return
    graph = program.local.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][:-1]  # coords last
    output = graph.find_nodes(op="output")[0]
    results = list(output.args[0])
    free = list(program.donated)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for j, ((v, lay), spec) in enumerate(zip(program.plan.outputs, program.traced.out_specs)):
        want = (local_shape(spec.shape, lay, program.sizes), spec.dtype)
        match = next((i for i in free if (local_shape(program.traced.in_specs[i].shape, program.in_layouts[i],
                                                       program.sizes), program.traced.in_specs[i].dtype) == want), None)
        result = results[j]
        if match is None or result.op == "placeholder":
            continue
        free.remove(match)
        buffer = placeholders[match]
        last = max([order[result]] + [order[u] for u in readers(buffer)])
        anchor = list(graph.nodes)[last]
        with graph.inserting_after(anchor):
            copy = graph.call_function(aten.copy_.default, (buffer, result))
        order = {n: i for i, n in enumerate(graph.nodes)}
        # later readers read the donated buffer, so the temporary dies at the copy
        result.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy and u.op != "output"
                                     and order[u] > order[copy])
        results[j] = copy
        program.donation[j] = match
    output.args = (results,)
    graph.lint()
    program.local.recompile()


class DonatedDTensor(DTensor):
    """A DTensor whose buffer a jitted call took over."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__repr__, torch.Tensor.__format__):
            return "<donated DTensor>"
        raise RuntimeError(_message())

    def to_local(self, *a, **k):
        raise RuntimeError(_message())

    def full_tensor(self, *a, **k):
        raise RuntimeError(_message())

    def redistribute(self, *a, **k):
        raise RuntimeError(_message())

    def __repr__(self) -> str:
        return "<donated DTensor: its buffer holds a jitted call's result>"


class DonatedTensor(torch.Tensor):
    """A plain tensor whose memory a jitted call took over."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__repr__, torch.Tensor.__format__):
            return "<donated tensor>"
        raise RuntimeError(_message("tensor"))

    def __repr__(self) -> str:
        return "<donated tensor: its memory holds a jitted call's result>"


def _message(what: str = "DTensor") -> str:
    return (f"this {what} was donated to an nf.jit call (donate_argnums) and its buffer now holds that "
            f"call's results; use the value the call returned instead, or stop donating the argument.")


def mark_donated(program, prepared: list, original_leaves: list) -> None:
    """Retire the caller's donated DTensors whose buffers a result now uses."""
    originals = {id(x) for x in original_leaves}
    for i in program.donation.values():
        x = prepared[i]
        if id(x) in originals:  # not a copy made to lay the argument out
            x.__class__ = _donated_class(type(x))


_CLASSES: dict = {DTensor: DonatedDTensor, torch.Tensor: DonatedTensor}


def _donated_class(cls: type) -> type:
    """The retired form of `cls` (a subclass, so the object's layout fits: e.g. a simulated
    rank's LocalTensor)."""
    if cls not in _CLASSES:
        base = DonatedDTensor if issubclass(cls, DTensor) else DonatedTensor
        _CLASSES[cls] = type(f"Donated{cls.__name__}", (cls,), {
            "__torch_function__": base.__torch_function__, "__repr__": base.__repr__,
            **({k: getattr(base, k) for k in ("to_local", "full_tensor", "redistribute")} if base is DonatedDTensor else {}),
        })
    return _CLASSES[cls]
