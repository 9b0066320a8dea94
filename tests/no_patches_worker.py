"""Imports torch and the transformers modules ndfunc swaps functions of, notes their objects, then
imports ndfunc and traces a train step that goes through every swap; prints (as JSON) what changed
at each point. A process of its own: the test process imported ndfunc long before.

    python tests/no_patches_worker.py
"""

import functools
import importlib
import json
import sys
import types
import warnings

import torch
import torch.distributed.tensor._ops.utils as dtensor_utils
import torch.utils.checkpoint
import transformers.integrations.moe as moe
import transformers.integrations.sdpa_attention as sdpa

_ABSENT = "absent"  # a class's attribute its own dict does not hold (found on a base)


def named() -> dict[str, tuple[object, str]]:
    """Each object ndfunc swaps: (what holds it, its name)."""
    apply = torch.autograd.Function.__dict__["apply"]
    return {
        "torch.autograd.Function.apply": (torch.autograd.Function, "apply"),
        "torch.autograd.Function.apply's code": (apply.__func__, "__code__"),
        "torch.Tensor.requires_grad_": (torch.Tensor, "requires_grad_"),
        "torch.utils.checkpoint.CheckpointFunction": (torch.utils.checkpoint, "CheckpointFunction"),
        "torch.utils.checkpoint._checkpoint_without_reentrant_generator": (
            torch.utils.checkpoint, "_checkpoint_without_reentrant_generator"),
        "torch._check_tensor_all_with": (torch, "_check_tensor_all_with"),
        "invoke_subgraph_placeholder": (importlib.import_module("torch._higher_order_ops.invoke_subgraph"),
                                        "invoke_subgraph_placeholder"),
        "DTensor's redistribute_cost": (dtensor_utils, "redistribute_cost"),
        "transformers' use_gqa_in_sdpa": (sdpa, "use_gqa_in_sdpa"),
        "transformers' ExpertsInterface.get_interface": (moe.ExpertsInterface, "get_interface"),
    }


def read(holder: object, name: str) -> object:
    return holder.__dict__.get(name, _ABSENT) if isinstance(holder, type) else getattr(holder, name)


def snapshot() -> dict[str, dict[str, tuple[int, int]]]:
    """Every function and class in torch's and transformers' modules, and every method of their
    classes: (its id, its code's id)."""
    seen = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (deprecated module attributes warn when read)
        for name, module in list(sys.modules.items()):
            if not isinstance(module, types.ModuleType) or not (name == "torch" or name.startswith(
                    ("torch.", "transformers"))):
                continue
            found = dict(vars(module))
            seen[name] = {k: _ids(v) for k, v in found.items() if callable(v)}
            for v in found.values():
                if isinstance(v, type) and v.__module__ == name:
                    seen[f"{name}:{v.__qualname__}"] = {k: _ids(a) for k, a in vars(v).items() if _function(a)}
    return seen


def _function(x: object) -> bool:
    """A function, a class, or a method's descriptor (not a count or a cache: those change as they are used)."""
    return callable(x) or isinstance(x, (staticmethod, classmethod, property))


def _ids(x: object) -> tuple[int, int]:
    return id(x), id(getattr(getattr(x, "__func__", x), "__code__", None))


def changed(before: dict, after: dict) -> list[str]:
    """What `after` replaced or dropped of `before` (and, in a class, added: it shadows a base's)."""
    found = []
    for key, values in before.items():
        now = after.get(key, {})
        found += [f"{key} {k}" for k, v in values.items() if now.get(k) != v]
        if ":" in key:
            found += [f"{key} {k} (added)" for k in now.keys() - values.keys()]
    return found


class OldStyleGelu(torch.autograd.Function):  # BLOOM's GeLUFunction: forward(ctx, x), no setup_context
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return grad * (s + 1.702 * x * s * (1 - s))


gelu = OldStyleGelu.apply  # bound at a module's import, before ndfunc is imported


def main() -> None:
    assert "ndfunc" not in sys.modules
    where = named()
    own = {name: read(*w) for name, w in where.items()}
    before = snapshot()
    result = {}

    import ndfunc as nf
    from ndfunc._src import swaps
    from ndfunc.sharding import P

    result["changed by importing ndfunc"] = changed(before, snapshot())
    known = {(id(holder), name) for holder, name in where.values()}
    result["swaps the test does not know"] = [f"{s.owner}.{s.name}" for s in swaps.registered()
                                              if (id(s.target()), s.name) not in known]

    def implementation(module, hidden, index, weights):
        return hidden

    def loss(w, x):
        result["swapped while traced"] = {name: read(*w_) is not own[name] for name, w_ in where.items()}
        result["use_gqa_in_sdpa while traced"] = sdpa.use_gqa_in_sdpa(mask, x, x)
        found = moe.ALL_EXPERTS_FUNCTIONS.get_interface("eager", implementation)
        result["experts called as one op while traced"] = isinstance(found, functools.partial)
        torch._check_tensor_all(x.sum() > 0)  # a hint: its value is not read
        h = torch.utils.checkpoint.checkpoint(lambda a: gelu(a @ w), x, use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(gelu, h, use_reentrant=False)
        return h.square().mean()

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 4, generator=g), torch.randn(8, 4, generator=g)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)  # (with a mask, transformers repeats grouped heads)
    leaf = w.clone().requires_grad_()
    want = (h := gelu(gelu(x @ leaf)).square().mean(), torch.autograd.grad(h, leaf)[0])
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                      out_shardings=(P(), P()))
        got = nf.device_get(step(w, x))
        try:
            nf.jit(lambda x: x[x > 0].sum(), mesh=nf.make_mesh(dp=2), in_shardings=P("dp"))(x)
        except nf.DataDependentError:
            result["not their own after a step that raised"] = [n for n, w_ in where.items() if read(*w_) is not own[n]]
    result["the step's loss and gradient are torch's"] = all(torch.allclose(a, b) for a, b in zip(got, want))
    result["not their own after the step"] = [name for name, w_ in where.items() if read(*w_) is not own[name]]
    result["changed after the step"] = changed(before, snapshot())
    result["use_gqa_in_sdpa after"] = sdpa.use_gqa_in_sdpa(mask, x, x)
    try:
        torch.func.grad(lambda w: gelu(x @ w).sum())(w)
    except RuntimeError as e:
        result["torch.func's own refusal after"] = "must override the setup_context staticmethod" in str(e)
    result["is_compiling after"] = torch.compiler.is_compiling()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
