"""`nf.jit`: trace a step once per signature, partition it, lower it, run one local program per rank.

    step = nf.jit(fn, mesh=mesh, in_shardings=..., out_shardings=..., donate_argnums=(0, 1))
    step(*args)                      # traces, partitions, lowers on the first call of a signature
    step.lower(*args).as_text()      # the local program, collectives with kind, axes and bytes
    step.lower(*args).cost_analysis()

A signature is the argument tree, each leaf's shape, dtype and sharding, and the static arguments;
a new one traces again, a seen one reuses its program. At run time a compiled step takes each
DTensor's local block once, runs the program (aten ops and functional collectives on plain or, in
simulation, per-rank tensors - no DTensor dispatch), and wraps the results as DTensors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from ndfunc.compile import Lowered
from ndfunc.sharding.errors import ShardingError, where
from ndfunc.sharding.mesh import AbstractMesh, Mesh, get_mesh
from ndfunc.sharding.named_sharding import NamedSharding
from ndfunc.sharding.partition_spec import PartitionSpec
from ndfunc.trace import trace
from ndfunc.transfer import device_put, sharding_of
from ndfunc.tree import keystr, tree_broadcast_prefix


def jit(fn: Callable | None = None, *, mesh: Mesh | None = None, in_shardings: Any = None,
        out_shardings: Any = None, static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (), transforms: Sequence[Any] = ()):
    """Compile `fn` (a pure function of tensor pytrees) into one local program per rank.

    Args:
        mesh: the Mesh to run on; else the one of a NamedSharding or DTensor argument, or
            `with mesh:` / `nf.set_mesh`.
        in_shardings: a prefix tree of the positional arguments' shardings (`NamedSharding` or `P`).
            A `None` leaf keeps the argument as it is (a plain tensor counts as replicated); a
            DTensor laid out otherwise is resharded (a copy), as `nf.device_put` would.
        out_shardings: a prefix tree of the results' shardings; `None` leaves the choice to the
            partitioner. Results are DTensors.
        static_argnums: arguments baked into the program (configs); they must be hashable.
        donate_argnums: arguments whose DTensor buffers the results may reuse. A donated argument
            is unusable afterwards (touching it raises).
        transforms: passes over the partitioned and lowered program (see `ndfunc.partition.program`).

    Example:
        >>> with nf.simulate(4):
        ...     mesh = nf.make_mesh(dp=4)
        ...     step = nf.jit(lambda w, x: (x @ w).sum(), mesh=mesh, in_shardings=(P(), P('dp')))
        ...     out = step(torch.ones(3, 2), torch.ones(8, 3))
        ...     float(nf.device_get(out))
        48.0
    """
    if fn is None:
        return functools.partial(jit, mesh=mesh, in_shardings=in_shardings, out_shardings=out_shardings,
                                 static_argnums=static_argnums, donate_argnums=donate_argnums,
                                 transforms=transforms)
    return Jitted(fn, mesh, in_shardings, out_shardings, _ints(static_argnums), _ints(donate_argnums),
                  tuple(transforms))


def _ints(x) -> tuple[int, ...]:
    return (x,) if isinstance(x, int) else tuple(x)


class Jitted:
    """A function compiled per signature. Call it, or `.lower(*args)` to inspect."""

    def __init__(self, fn, mesh, in_shardings, out_shardings, static_argnums, donate_argnums, transforms):
        functools.update_wrapper(self, fn)
        self.fn, self.mesh = fn, mesh
        self.in_shardings, self.out_shardings = in_shardings, out_shardings
        self.static_argnums, self.donate_argnums, self.transforms = static_argnums, donate_argnums, transforms
        self._cache: dict = {}
        self._resolved: dict = {}
        self._meshes: dict = {}
        self._seen: dict = {}  # arguments as they came (see _quick) -> (mesh, key): nothing to lay out
        self.trace_count = 0  # how many signatures were traced

    def __call__(self, *args, **kwargs):
        compiled, prepared = self._compiled(args, kwargs)
        return compiled._run(prepared, args)

    def lower(self, *args, **kwargs) -> "Lowered":
        """The traced, partitioned and lowered program for these arguments (cached: a later call
        with the same signature runs it)."""
        mesh, prepared, key = self._prepare(args, kwargs)
        if key not in self._cache:
            self._cache[key] = self._lowered(mesh, prepared, key)
        return self._cache[key]

    # --- steps ---------------------------------------------------------------------------------
    def _compiled(self, args, kwargs):
        quick, leaves = self._quick(args, kwargs)
        seen = self._seen.get(quick) if quick is not None else None
        if seen is not None:  # a step like the last: its leaves are laid out already
            mesh, key, _ = seen
            prepared = leaves
        else:
            mesh, prepared, key = self._prepare(args, kwargs)
            if quick is not None and all(p is x for p, x in zip(prepared, leaves)):
                # the meshes whose ids the key holds stay alive with it, so no other takes their id
                meshes = (get_mesh(), *(x.device_mesh for x in leaves if isinstance(x, DTensor)))
                self._seen[quick] = (mesh, key, meshes)
        if key not in self._cache:
            self._cache[key] = self._lowered(mesh, prepared, key)
        return self._cache[key].compiled, prepared

    def _split_static(self, args) -> tuple[set, tuple]:
        """(positions of the static arguments, the arguments with None in their place)."""
        static = {i % len(args) for i in self.static_argnums} if args else set()
        return static, tuple(None if i in static else a for i, a in enumerate(args))

    def _quick(self, args, kwargs):
        """(a key of the arguments as they come - tree, static values, each leaf's shape, dtype,
        device, placements and mesh, the mesh in context - and the leaves), or (None, None) if a
        leaf is not a tensor or a static value cannot be hashed. Arguments seen before with this
        key, that `_prepare` passed through unchanged, need no checking or laying out again."""
        static, dynamic = self._split_static(args)
        leaves, treespec = optree.tree_flatten((dynamic, kwargs))
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            return None, None
        layout = tuple((_leaf_key(x), id(x.device_mesh) if isinstance(x, DTensor) else None) for x in leaves)
        key = (treespec, tuple((i, args[i]) for i in sorted(static)), id(get_mesh()), layout)
        try:
            hash(key)
        except TypeError:
            return None, None
        return key, leaves

    def _prepare(self, args, kwargs):
        """Resolve the mesh, lay every leaf out as the in_shardings say, and key the signature."""
        static, dynamic = self._split_static(args)
        mesh = self._find_mesh(args, kwargs)
        specs = self.in_shardings
        if specs is None or isinstance(specs, (NamedSharding, PartitionSpec)):
            specs = tuple(specs for _ in args)
        elif not isinstance(specs, (tuple, list)) or len(specs) != len(args):
            raise ValueError(
                f"in_shardings for {self.__name__} has {len(specs) if isinstance(specs, (tuple, list)) else 1} "
                f"entries for {len(args)} positional arguments; give one sharding (or prefix tree) per "
                f"positional argument, or a single sharding for all."
            )
        specs = tuple(None if i in static else s for i, s in enumerate(specs))
        is_spec = lambda x: isinstance(x, (NamedSharding, PartitionSpec))  # noqa: E731
        leaf_specs = tree_broadcast_prefix(specs, dynamic, is_leaf=is_spec, prefix_name="in_shardings",
                                           full_name="the arguments")
        paths, leaves, treespec = optree.tree_flatten_with_path((dynamic, kwargs))
        spec_leaves = optree.tree_leaves((leaf_specs, optree.tree_map(lambda _: None, kwargs)),
                                         none_is_leaf=True)
        prepared = []
        for path, x, spec in zip(paths, leaves, spec_leaves):
            name = keystr(path[1:])
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"argument leaf {name!r} is a {type(x).__name__} ({x!r}); jitted arguments are "
                                f"tensors. Make it a tensor, or mark its argument static (static_argnums).")
            prepared.append(self._place(name, x, spec, mesh))
        statics = tuple((i, args[i]) for i in sorted(static))
        try:
            hash(statics)
        except TypeError:
            raise TypeError(f"static arguments of {self.__name__} must be hashable (a frozen dataclass, a "
                            f"tuple, a number); got {[type(a).__name__ for _, a in statics]}.") from None
        key = (treespec, statics, tuple(_leaf_key(x) for x in prepared))
        return mesh, prepared, key

    def _place(self, name: str, x: torch.Tensor, spec, mesh: Mesh | None) -> torch.Tensor:
        if spec is not None:
            sharding, placements = self._resolve(spec, mesh)
            if mesh is not None and sharding.mesh != mesh:
                raise ShardingError(f"{where(name)}in_shardings uses {sharding.mesh!r}, but the function runs on "
                                    f"{mesh!r}; use one mesh for every argument.")
            try:
                sharding.check(tuple(x.shape), name)
            except ShardingError as e:
                raise type(e)(f"argument {e}") from None
            if isinstance(x, DTensor):
                # the common case, every step: already laid out so (no Mesh rebuilt to find out)
                laid_out = x.device_mesh is getattr(sharding.mesh, "device_mesh", None) and tuple(x.placements) == placements
                if not laid_out and not sharding_of(x).is_equivalent_to(sharding, x.ndim):
                    x = device_put(x, sharding)
            elif not sharding.is_fully_replicated:  # a plain tensor is the replicated global value
                x = device_put(x, sharding)
        if isinstance(x, DTensor) and any(isinstance(p, _StridedShard) for p in x.placements):
            # programs hold plain nested splits only: an axis order other than the mesh's is
            # gathered on that axis first
            x = x.redistribute(x.device_mesh, [Replicate() if isinstance(p, _StridedShard) else p
                                               for p in x.placements])
        return x

    def _resolve(self, spec, mesh: Mesh | None) -> tuple[NamedSharding, tuple]:
        """`spec` as a NamedSharding on `mesh`, with its placements (once per spec and mesh)."""
        key = (id(mesh), spec)
        if key not in self._resolved:
            sharding = NamedSharding(mesh, spec) if isinstance(spec, PartitionSpec) else spec
            self._resolved[key] = (mesh, sharding, sharding.placements)  # holds mesh: its id stays its own
        return self._resolved[key][1:]

    def _find_mesh(self, args, kwargs) -> Mesh | None:
        if self.mesh is not None:
            return self.mesh
        for s in optree.tree_leaves((self.in_shardings, self.out_shardings),
                                    is_leaf=lambda x: isinstance(x, (NamedSharding, PartitionSpec))):
            if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
                return s.mesh
        for x in optree.tree_leaves((args, kwargs)):
            if isinstance(x, DTensor):  # its Mesh, built once per DeviceMesh
                known = self._meshes.get(id(x.device_mesh))
                if known is None or known.device_mesh is not x.device_mesh:
                    known = self._meshes[id(x.device_mesh)] = sharding_of(x).mesh
                return known
        mesh = get_mesh()
        if isinstance(mesh, Mesh):
            return mesh
        has_specs = any(isinstance(s, PartitionSpec) for s in optree.tree_leaves(
            (self.in_shardings, self.out_shardings), is_leaf=lambda x: isinstance(x, PartitionSpec)))
        if has_specs:
            raise ShardingError(
                f"nf.jit({self.__name__}) got PartitionSpecs but no mesh: pass mesh=nf.make_mesh(...), "
                f"call it under `with mesh:` (or nf.set_mesh(mesh)), or give NamedSharding(mesh, spec)."
            )
        return None

    def _lowered(self, mesh, prepared, key) -> "Lowered":
        self.trace_count += 1
        dynamic_tree = key[0]
        leaves = [x for x in prepared]
        (dyn_args, kwargs) = optree.tree_unflatten(dynamic_tree, leaves)
        static = dict(key[1])
        n_args = len(dyn_args)
        call_args = [static[i] if i in static else dyn_args[i] for i in range(n_args)]
        with contextlib.ExitStack() as stack:  # transforms that change what is traced (mixed precision)
            for t in self.transforms:
                if hasattr(t, "tracing"):
                    stack.enter_context(t.tracing())
            traced = trace(self.fn, call_args, kwargs, static_argnums=tuple(static))
        if mesh is None:
            mesh = _world_of_one()
        donated = [i for i in range(len(prepared)) if _arg_index(dynamic_tree, i) in self.donate_argnums]
        return Lowered.build(self, key, traced, mesh, prepared, donated)


def _arg_index(treespec, leaf_index: int):
    """Which positional argument the flat leaf `leaf_index` belongs to (None for kwargs)."""
    counts = [c.num_leaves for c in optree.treespec_children(optree.treespec_children(treespec)[0])]
    total = 0
    for i, c in enumerate(counts):
        total += c
        if leaf_index < total:
            return i
    return None


def _leaf_key(x: torch.Tensor) -> tuple:
    placements = tuple(x.placements) if isinstance(x, DTensor) else None
    return (tuple(x.shape), x.dtype, x.device.type, placements)


def _world_of_one() -> AbstractMesh:
    """No mesh anywhere: every rank runs the whole program (results are plain tensors)."""
    return AbstractMesh((("world", 1),))
