"""`nf.shard_map`: run a function per rank on local blocks, with `nf.lax` collectives inside.

As `jax.shard_map(f, mesh=..., in_specs=..., out_specs=...)`: each input is laid out by its spec
and `f` sees only this rank's block; `f`'s results are this rank's blocks of outputs laid out by
`out_specs`. An output spec that leaves out a mesh axis says the result is the same on every rank
of that axis (a psum or pmean made it so); as JAX's `check_vma`, a result that varies along such
an axis (made from an input split over it, and not reduced over it) is refused (`varying`), and
`check_vma=False` leaves it the caller's promise. Gradients flow through: the collectives are differentiable, an input whole
along an axis gets the sum of its cotangents over that axis (data parallelism's gradient
all-reduce), and an output whole along an axis shares its cotangent among its holders. Gradients
reach arguments passed as DTensors; a plain tensor argument is taken as data.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ndfunc._src import manual, varying
from ndfunc._src.sharding.errors import ShardingError
from ndfunc._src.sharding.mesh import Mesh, get_mesh
from ndfunc._src.sharding.named_sharding import NamedSharding
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.trace import is_tracing
from ndfunc._src.transfer import device_put, from_local
from ndfunc.lax import _enter_input, _leave_output, _manual_axes, _replicated_axes
from ndfunc.tree import tree_broadcast_prefix, tree_map_with_path


def shard_map(fn: Callable, mesh: Mesh | None = None, *, in_specs: Any, out_specs: Any,
              check_vma: bool = True) -> Callable:
    """Map `fn` over the blocks of its arguments, one call per rank.

    Args:
        fn: takes and returns pytrees of tensors (this rank's blocks).
        mesh: the mesh; by default the one set by `with mesh:` / `nf.set_mesh`.
        in_specs: a prefix tree of `P` over the positional arguments (a tuple, one per argument).
        out_specs: a prefix tree of `P` over the result.
        check_vma: refuse a result that varies along an axis its out_spec leaves out (JAX's check).

    Example:
        >>> with nf.simulate(4):
        ...     mesh = nf.make_mesh(tp=4)
        ...     total = nf.shard_map(lambda x: nf.lax.psum(x.sum(), 'tp'), mesh, in_specs=(P('tp'),), out_specs=P())
        ...     nf.device_get(total(torch.arange(8.0)))
        tensor(28.)
    """

    @functools.wraps(fn)
    def mapped(*args):
        mapped_mesh = mesh if mesh is not None else get_mesh()
        if not isinstance(mapped_mesh, Mesh):
            raise ShardingError(
                "nf.shard_map needs a mesh of ranks: pass mesh=nf.make_mesh(...), or call inside `with mesh:`."
            )
        specs = tree_broadcast_prefix(tuple(in_specs) if isinstance(in_specs, list) else in_specs, args,
                                      prefix_name="in_specs", full_name="arguments")
        locals_ = tree_map_with_path(lambda path, x, spec: _to_local(mapped_mesh, path, x, spec), args, specs)
        with _manual_axes(mapped_mesh), varying.Tracked() if check_vma else contextlib.nullcontext():
            out = fn(*locals_)
        out_spec_tree = tree_broadcast_prefix(out_specs, out, prefix_name="out_specs", full_name="results")
        checked = fn if check_vma else None
        return tree_map_with_path(lambda path, y, spec: _from_local(mapped_mesh, path, y, spec, checked), out,
                                  out_spec_tree)

    return mapped


def _spec(path: str, spec: Any, what: str) -> PartitionSpec:
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{what} at {path or 'the root'!r} is {spec!r}; expected a P(...) (P() for a value every rank holds whole).")
    return spec


def _check_vma(mesh: Mesh, path: str, y: torch.Tensor, spec: PartitionSpec, fn: Callable) -> None:
    along = sorted(varying.axes_of(y) & set(_replicated_axes(mesh, spec)))
    if along:
        raise ShardingError(
            f"nf.shard_map({getattr(fn, '__name__', 'fn')}): out_specs {spec!r} at {path or 'the root'!r} says the "
            f"result is the same on every rank along {along}, but it varies along them (it comes from an input split "
            f"over them, or from axis_index, psum_scatter, ppermute or all_to_all over them, and nothing reduced it "
            f"there). Reduce it over them (nf.lax.psum, pmean, pmax or all_gather), name them in out_specs, or pass "
            f"check_vma=False where it is the same on every rank by a route ndfunc does not follow.")


def _to_local(mesh: Mesh, path: str, x: Any, spec: Any) -> torch.Tensor:
    sharding = NamedSharding(mesh, _spec(path, spec, "in_specs"))
    split = [a for a in sharding.spec.axes if mesh.axis_size(a) > 1]
    return varying.varies(_local(mesh, path, x, sharding), split)


def _local(mesh: Mesh, path: str, x: Any, sharding: NamedSharding) -> torch.Tensor:
    if is_tracing():  # inside nf.jit: a global value becomes this rank's block in the program
        sharding.check(tuple(x.shape), path)
        return _enter_input(manual.enter(x, sharding.spec, sharding.shard_shape(tuple(x.shape))), mesh, sharding.spec)
    if isinstance(x, DTensor):
        # DTensor's redistribute (a no-op when x is laid out so already) keeps x's autograd history;
        # device_put would hand back detached values.
        x = x.redistribute(mesh.device_mesh, sharding.placements)
    else:
        x = device_put(x, sharding)  # a plain tensor: a global value, taken as data (not differentiated)
    return _enter_input(x.to_local(), mesh, sharding.spec)


def _from_local(mesh: Mesh, path: str, y: Any, spec: Any, checked: Callable | None) -> DTensor:
    """`y`, this rank's block of a result laid out by `spec`; `checked`: the mapped function, whose
    results are held to their specs (`_check_vma`)."""
    sharding = NamedSharding(mesh, _spec(path, spec, "out_specs"))
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"shard_map's function returned a {type(y).__name__} at {path or 'the root'!r}; it must return tensors.")
    if checked is not None:
        _check_vma(mesh, path, y, sharding.spec, checked)
    if len(sharding.spec) > y.ndim:
        raise ShardingError(f"out_specs {sharding.spec!r} at {path or 'the root'!r} has more entries than the result's {y.ndim} dims.")
    shape = torch.Size(n * sharding.num_blocks(d) for d, n in enumerate(y.shape))
    if is_tracing():
        return manual.exit(_leave_output(y, mesh, sharding.spec), sharding.spec, shape)
    return from_local(_leave_output(y, mesh, sharding.spec), mesh.device_mesh, sharding.placements, shape)


__all__ = ["shard_map"]
