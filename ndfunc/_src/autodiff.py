"""`grad`, `value_and_grad` and `vmap` with JAX's conventions, over `torch.func`.

Differentiated arguments are pytrees of floating-point tensors, flattened with optree (ndfunc's
pytree library) and handed to `torch.func` as flat lists, so any structure ndfunc understands works
and gradients come back in the argument's structure. Return conventions are JAX's:
`value_and_grad(f)(x) -> (value, grads)`, with `has_aux=True` `((value, aux), grads)`;
`grad(f, has_aux=True)(x) -> (grads, aux)`. Under `make_fx` the forward and backward become one
functional graph with no autograd left in it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.fx.traceback as fx_traceback

from ndfunc._src.module import COMPUTE_DTYPE  # differentiated float arguments are cast to it
from ndfunc.tree import tree_flatten_with_path

ArgNums = int | tuple[int, ...]


FORWARD = "ndfunc_forward"  # the mark on the ops of a differentiated function, when traced
DIFFERENTIATED = "ndfunc_differentiated"  # the mark on its ops and on those of its backward
# contexts entered around each differentiation (`nf.remat`'s: torch.utils.checkpoint's calls as
# remat regions, which torch.func could not differentiate)
AROUND_GRAD: list[Callable[[], Any]] = []



def grad(fn: Callable[..., Any], argnums: ArgNums = 0, has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of a scalar-valued `fn` with respect to argument(s) `argnums`.

    Args:
        fn: returns a 0-dim floating-point tensor (the loss), or `(loss, aux)` with `has_aux`.
        argnums: the positional argument to differentiate, or a tuple of them.
        has_aux: `fn` returns `(loss, aux)`; `aux` is returned beside the gradients.

    Returns:
        A function of `fn`'s arguments returning the gradients (a tuple of them for a tuple
        `argnums`), each shaped like its argument; with `has_aux`, `(grads, aux)`.

    Example:
        >>> from ndfunc._src.autodiff import grad
        >>> loss = lambda params, x: ((params['w'] * x).sum() + params['b']) ** 2
        >>> grad(loss)({'w': torch.tensor([1.0, 2.0]), 'b': torch.tensor(0.5)}, torch.ones(2))
        {'w': tensor([7., 7.]), 'b': tensor(7.)}
    """
    value_and_grad_fn = value_and_grad(fn, argnums, has_aux)

    @functools.wraps(fn)
    def grad_fn(*args, **kwargs):
        out, grads = value_and_grad_fn(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return grad_fn


def value_and_grad(fn: Callable[..., Any], argnums: ArgNums = 0, has_aux: bool = False
                   ) -> Callable[..., Any]:
    """`fn`'s value and its gradient with respect to argument(s) `argnums`, in one pass.

    Args: as for `grad`.

    Returns:
        A function of `fn`'s arguments returning `(value, grads)`; with `has_aux`,
        `((value, aux), grads)`. Keyword arguments are passed through, never differentiated.

    Example:
        >>> from ndfunc._src.autodiff import value_and_grad
        >>> def loss(w, x):
        ...     y = w @ x
        ...     return (y ** 2).mean(), {'y': y}
        >>> (value, aux), (g_w, g_x) = value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        ...     torch.eye(2), torch.tensor([1.0, 3.0]))
        >>> value, aux['y'], g_w
        (tensor(5.), tensor([1., 3.]), tensor([[1., 3.],
                [3., 9.]]))
    """
    positions, single = _check_argnums(argnums)

    @functools.wraps(fn)
    def value_and_grad_fn(*args, **kwargs):
        indices = [_resolve(i, len(args), argnums) for i in positions]
        if len(set(indices)) != len(indices):
            raise ValueError(f"argnums {argnums} names an argument twice (negative indices count from "
                             f"the end of the {len(args)} arguments); list each once.")
        flat, specs = [], []
        for i in indices:
            flat.append(_differentiable_leaves(args[i], i))
            specs.append(optree.tree_structure(args[i]))
        if not any(flat):  # (torch.optim refuses an empty parameter list alike)
            kinds = ", ".join("None" if args[i] is None else f"a {type(args[i]).__name__}" for i in indices)
            which = (f"argument {indices[0]} ({kinds}), which holds" if len(indices) == 1
                     else f"arguments {tuple(indices)} ({kinds}), which hold")
            raise ValueError(
                f"the gradient of {_name(fn)} is taken with respect to {which} no tensor: nothing would train "
                f"(jax.grad would return the empty tree; torch.optim refuses an empty parameter list). A model "
                f"whose parameters are all frozen (requires_grad_(False)) gives nf.nn.functional's params empty; "
                f"unfreeze those to train, or call the function without a gradient.")
        aux_box: list = []

        others = [i for i in range(len(args)) if i not in indices]

        def flat_fn(*flat_args):
            # the arguments not differentiated come in as inputs too, not captured: torch.func lets a
            # function write into its inputs (BatchNorm's running statistics), not into what it captures
            *flat_args, rest, kw = flat_args
            new_args = list(args)
            for i, a in zip(others, rest):
                new_args[i] = a
            compute = COMPUTE_DTYPE.get()
            for i, spec, leaves in zip(indices, specs, flat_args):
                if compute is not None:  # nf.mixed_precision: compute in it; gradients come back as the leaves are
                    leaves = [x.to(compute) if x.is_floating_point() else x for x in leaves]
                new_args[i] = optree.tree_unflatten(spec, leaves)
            with fx_traceback.annotate({FORWARD: True}):  # nf.remat tells forward from backward by it
                out = fn(*new_args, **kw)
            if not has_aux:
                return _check_loss(out, fn)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    f"has_aux=True expects {_name(fn)} to return a pair (loss, aux), but it returned "
                    f"{_describe(out)}; return (loss, aux), or drop has_aux."
                )
            # torch.func passes back tensors only; other aux leaves (ints, strings) ride beside it.
            aux_leaves, aux_spec = optree.tree_flatten(out[1])
            aux_box.append((aux_leaves, aux_spec))
            return _check_loss(out[0], fn), [x for x in aux_leaves if isinstance(x, torch.Tensor)]

        with fx_traceback.annotate({DIFFERENTIATED: True}), contextlib.ExitStack() as around:
            # (DIFFERENTIATED: memory_analysis tells gradients by it)
            for context in AROUND_GRAD:
                around.enter_context(context())
            try:
                grads, out = torch.func.grad_and_value(flat_fn, argnums=tuple(range(len(indices))),
                                                       has_aux=has_aux)(*flat, [args[i] for i in others], kwargs)
            except RuntimeError as e:
                said = _what_to_do(fn, str(e))
                if said is None:
                    raise
                raise RuntimeError(said) from e
        grads = tuple(optree.tree_unflatten(spec, g) for spec, g in zip(specs, grads))
        grads = grads[0] if single else grads
        if not has_aux:
            return out, grads
        value, aux_tensors = out
        aux_leaves, aux_spec = aux_box[0]
        aux_tensors = iter(aux_tensors)
        aux_leaves = [next(aux_tensors) if isinstance(x, torch.Tensor) else x for x in aux_leaves]
        return (value, optree.tree_unflatten(aux_spec, aux_leaves)), grads

    return value_and_grad_fn


def _what_to_do(fn, error: str) -> str | None:
    """torch.func's refusal of a differentiated function, said for a user of nf.value_and_grad: what
    was written and what to write instead; None for another error."""
    if "mutate a captured Tensor" in error:
        return (f"nf.value_and_grad: {_name(fn)} writes in place into a tensor it closes over (a module's "
                f"buffer: BatchNorm's running statistics in training mode). Pass such tensors as an argument "
                f"of the differentiated function, not differentiated: "
                f"nf.value_and_grad(lambda p, b: loss(apply(p, b, x)))(params, buffers).")
    if "saved tensor hooks" in error:
        return (f"nf.value_and_grad: {_name(fn)} uses saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks"
                f", save_on_cpu), which torch.func cannot differentiate. To recompute activations in backward "
                f"mark the function with nf.remat(fn) (or call it through torch.utils.checkpoint, which "
                f"nf.value_and_grad runs as nf.remat).")
    return None


def vmap(fn: Callable[..., Any], in_axes: int | None | tuple = 0, out_axes: Any = 0
         ) -> Callable[..., Any]:
    """Map `fn` over an axis of its inputs, `torch.func.vmap` with JAX's argument names.

    Args:
        fn: a function of tensors (pytrees of them).
        in_axes: the dim to map over in every positional argument (an int), `None` for an
            argument not mapped, or a tuple with one such entry (or a tree of them, a prefix of the
            argument) per positional argument. Keyword arguments are mapped over dim 0, as in JAX.
        out_axes: where the mapped dim goes in the outputs: an int, or a tree of them (a prefix of
            the output).

    Returns:
        The mapped function.

    Example:
        >>> from ndfunc._src.autodiff import vmap
        >>> dot = lambda a, b: (a * b).sum()
        >>> vmap(dot, in_axes=(0, None))(torch.ones(3, 2), torch.tensor([1.0, 2.0]))
        tensor([3., 3., 3.])
    """
    if not (in_axes is None or isinstance(in_axes, tuple) or
            (isinstance(in_axes, int) and not isinstance(in_axes, bool))):
        raise TypeError(
            f"vmap in_axes must be an int, None, or a tuple with one entry per positional argument, "
            f"got {type(in_axes).__name__} {in_axes!r}; for one argument write in_axes=(spec,)."
        )

    @functools.wraps(fn)
    def mapped(*args, **kwargs):
        if isinstance(in_axes, tuple) and len(in_axes) != len(args):
            raise ValueError(
                f"vmap in_axes has {len(in_axes)} entries, {in_axes!r}, but {_name(fn)} was called "
                f"with {len(args)} positional arguments; give one entry (an int, None, or a tree of "
                f"them) per positional argument."
            )
        if not kwargs:
            return torch.func.vmap(fn, in_dims=in_axes, out_dims=out_axes)(*args)
        in_dims = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
        call = lambda *a: fn(*a[:-1], **a[-1])
        return torch.func.vmap(call, in_dims=in_dims + (0,), out_dims=out_axes)(*args, kwargs)

    return mapped


def _check_argnums(argnums: Any) -> tuple[tuple[int, ...], bool]:
    if isinstance(argnums, int) and not isinstance(argnums, bool):
        return (argnums,), True
    if (isinstance(argnums, tuple) and argnums and
            all(isinstance(i, int) and not isinstance(i, bool) for i in argnums)):
        if len(set(argnums)) != len(argnums):
            raise ValueError(f"argnums {argnums} names an argument twice; list each once.")
        return argnums, False
    raise TypeError(
        f"argnums must be an int or a non-empty tuple of ints (positional argument indices), got "
        f"{argnums!r}; e.g. argnums=0 or argnums=(0, 1)."
    )


def _resolve(i: int, num_args: int, argnums: ArgNums) -> int:
    if not -num_args <= i < num_args:
        raise ValueError(
            f"argnums={argnums!r} refers to positional argument {i}, but the function was called "
            f"with {num_args} positional arguments; differentiated arguments must be passed "
            f"positionally."
        )
    return i % num_args


def _differentiable_leaves(tree: Any, index: int) -> list[torch.Tensor]:
    leaves = tree_flatten_with_path(tree)[0]
    for path, leaf in leaves:
        where = f"argument {index}" + (f" at {path!r}" if path else "")
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"gradients are taken with respect to tensors, but {where} is a "
                f"{type(leaf).__name__} ({leaf!r}); make it a tensor, or move it to an argument "
                f"not in argnums."
            )
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"gradients are taken with respect to floating-point tensors, but {where} is a "
                f"{leaf.dtype} tensor; convert it (.float()) or move it to an argument not in argnums."
            )
    return [leaf for _, leaf in leaves]


def _check_loss(value: Any, fn: Callable) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"grad expects {_name(fn)} to return a scalar loss tensor, but it returned "
            f"{_describe(value)}; return a 0-dim tensor (with has_aux=True, a pair (loss, aux))."
        )
    if value.dim() != 0:
        raise ValueError(
            f"grad expects {_name(fn)} to return a scalar loss (a tensor of shape ()), but it "
            f"returned a tensor of shape {tuple(value.shape)}; reduce it first (loss.mean() or "
            f"loss.sum()), or use torch.func.jacrev for the Jacobian."
        )
    if not (value.is_floating_point() or value.is_complex()):
        raise TypeError(
            f"grad expects {_name(fn)} to return a floating-point loss, but it returned a "
            f"{value.dtype} tensor; integer values have no gradient."
        )
    return value


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"
