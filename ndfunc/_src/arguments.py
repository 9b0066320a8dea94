"""How a jitted function's arguments become a program's inputs: the mesh found, each leaf laid out
as `in_shardings` say, and the signature that keys the program cache.

`Arguments` is what `nf.jit` and the `Compiled` stage share: a `Compiled` lays out the arguments
it is called with the same way, without reaching back into the `Jitted` that made it.
"""

from __future__ import annotations

import collections
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate

from ndfunc._src.sharding.errors import ShardingError, where
from ndfunc._src.sharding.mesh import AbstractMesh, Mesh, get_mesh
from ndfunc._src.sharding.named_sharding import NamedSharding
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.sharding.shape_dtype import ShapeDtypeStruct
from ndfunc._src.torch_compat import StridedShard
from ndfunc._src.transfer import device_put, sharding_of
from ndfunc.tree import keystr, tree_broadcast_prefix

CACHE_SIZE = 64  # meshes and specs remembered per function; more are recomputed, not kept alive


class Bounded(collections.OrderedDict):
    """A dict that forgets its least recently stored entries beyond `maxsize`."""

    def __init__(self, maxsize: int = CACHE_SIZE):
        super().__init__()
        self.maxsize = maxsize

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.maxsize:
            self.popitem(last=False)


class Arguments:
    """The argument side of a jitted function: `prepare(args, kwargs) -> (mesh, leaves, key)`."""

    def __init__(self, name: str, mesh: Mesh | None, in_shardings: Any, out_shardings: Any,
                 static_argnums: tuple[int, ...]):
        self.name, self.mesh = name, mesh
        self.in_shardings, self.out_shardings, self.static_argnums = in_shardings, out_shardings, static_argnums
        # keyed by id (meshes are not hashed by value on every call); each entry holds what its ids
        # name, so no other object takes an id while it is remembered
        self._resolved: Bounded = Bounded()
        self._meshes: Bounded = Bounded()

    def split_static(self, args) -> tuple[set, tuple]:
        """(positions of the static arguments, the arguments with None in their place)."""
        static = {i % len(args) for i in self.static_argnums} if args else set()
        return static, tuple(None if i in static else a for i, a in enumerate(args))

    def quick(self, args, kwargs):
        """(a key of the arguments as they come - tree, static values, each leaf's shape, dtype,
        device, placements and mesh, the mesh in context - and the leaves), or (None, None) if a
        leaf is not a tensor or a static value cannot be hashed. Arguments seen before with this
        key, that `_prepare` passed through unchanged, need no checking or laying out again."""
        static, dynamic = self.split_static(args)
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

    def prepare(self, args, kwargs):
        """Resolve the mesh, lay every leaf out as the in_shardings say, and key the signature."""
        static, dynamic = self.split_static(args)
        mesh = self.find_mesh(args, kwargs)
        specs = self.in_shardings
        if isinstance(specs, str) or (isinstance(specs, (tuple, list)) and any(isinstance(s, str) for s in specs)):
            got = specs if isinstance(specs, str) else next(s for s in specs if isinstance(s, str))
            raise TypeError(f"in_shardings for {self.name} holds the string {got!r} where a PartitionSpec belongs; "
                            f"write P({got!r}) (from ndfunc.sharding import P), or a NamedSharding.")
        if specs is None or isinstance(specs, (NamedSharding, PartitionSpec)):
            specs = tuple(specs for _ in args)
        elif not isinstance(specs, (tuple, list)) or len(specs) != len(args):
            raise ValueError(
                f"in_shardings for {self.name} has {len(specs) if isinstance(specs, (tuple, list)) else 1} "
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
            if isinstance(x, torch.Tensor) and isinstance(mesh, AbstractMesh) and mesh.size > 1:
                # an abstract mesh has no ranks to hold blocks: the tensor is planned for, as its stand-in
                x = ShapeDtypeStruct(tuple(x.shape), x.dtype, device=x.device,
                                     sharding=sharding_of(x) if isinstance(x, DTensor) else None)
            if isinstance(x, ShapeDtypeStruct):
                prepared.append(self._place_stand_in(name, x, spec, mesh))
                continue
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"argument leaf {name!r} is a {type(x).__name__} ({x!r}); jitted arguments are "
                                f"tensors (or nf.ShapeDtypeStruct stand-ins, to lower). Make it a tensor, or mark "
                                f"its argument static (static_argnums).")
            prepared.append(self._place(name, x, spec, mesh))
        statics = tuple((i, args[i]) for i in sorted(static))
        try:
            hash(statics)
        except TypeError:
            raise TypeError(f"static arguments of {self.name} must be hashable (a frozen dataclass, a "
                            f"tuple, a number); got {[type(a).__name__ for _, a in statics]}.") from None
        key = (treespec, statics, tuple(_leaf_key(x) for x in prepared))
        return mesh, prepared, key

    def _place(self, name: str, x: torch.Tensor, spec, mesh: Mesh | None) -> torch.Tensor:
        if spec is not None:
            sharding, placements = self._resolve(spec, mesh)
            _check(name, sharding, tuple(x.shape), mesh, "in_shardings uses")
            if isinstance(x, DTensor):
                # the common case, every step: already laid out so (no Mesh rebuilt to find out)
                laid_out = x.device_mesh is getattr(sharding.mesh, "device_mesh", None) and tuple(x.placements) == placements
                if not laid_out and not sharding_of(x).is_equivalent_to(sharding, x.ndim):
                    x = device_put(x, sharding)
            elif not sharding.is_fully_replicated:  # a plain tensor is the replicated global value
                x = device_put(x, sharding)
        if isinstance(x, DTensor) and any(isinstance(p, StridedShard) for p in x.placements):
            # programs hold plain nested splits only: an axis order other than the mesh's is
            # gathered on that axis first
            x = x.redistribute(x.device_mesh, [Replicate() if isinstance(p, StridedShard) else p
                                               for p in x.placements])
        return x

    def _place_stand_in(self, name: str, x: ShapeDtypeStruct, spec, mesh) -> ShapeDtypeStruct:
        """A stand-in laid out as `spec` says (else as it says itself): on the step's mesh."""
        sharding = self._resolve(spec, mesh)[0] if spec is not None else x.sharding
        if sharding is None:
            return x
        _check(name, sharding, tuple(x.shape), mesh, "the stand-in is laid out on")
        return x.with_sharding(sharding)

    def _resolve(self, spec, mesh: Mesh | None) -> tuple[NamedSharding, tuple]:
        """`spec` as a NamedSharding on `mesh`, with its placements (once per spec and mesh)."""
        key = (id(mesh), spec)
        if key not in self._resolved:
            sharding = NamedSharding(mesh, spec) if isinstance(spec, PartitionSpec) else spec
            self._resolved[key] = (mesh, sharding, sharding.placements)  # holds mesh: its id stays its own
        return self._resolved[key][1:]

    def find_mesh(self, args, kwargs) -> Mesh | AbstractMesh | None:
        if self.mesh is not None:
            return self.mesh
        named = [s for s in optree.tree_leaves((self.in_shardings, self.out_shardings),
                                               is_leaf=lambda x: isinstance(x, (NamedSharding, PartitionSpec)))
                 if isinstance(s, NamedSharding)]
        for s in named:
            if isinstance(s.mesh, Mesh):
                return s.mesh
        leaves = optree.tree_leaves((args, kwargs))
        stand_ins = [x for x in leaves if isinstance(x, ShapeDtypeStruct)]
        for x in stand_ins:
            if x.sharding is not None:
                return x.sharding.mesh
        dtensors = [x for x in leaves if isinstance(x, DTensor)]
        if named and (stand_ins or not dtensors):
            return named[0].mesh  # an AbstractMesh: planned, not run
        if dtensors:  # the first's Mesh, built once per DeviceMesh
            device_mesh = dtensors[0].device_mesh
            known = self._meshes.get(id(device_mesh))
            if known is None or known.device_mesh is not device_mesh:
                known = self._meshes[id(device_mesh)] = sharding_of(dtensors[0]).mesh
            return known
        mesh = get_mesh()
        if isinstance(mesh, Mesh) or (isinstance(mesh, AbstractMesh) and stand_ins):
            return mesh
        has_specs = any(isinstance(s, PartitionSpec) for s in optree.tree_leaves(
            (self.in_shardings, self.out_shardings), is_leaf=lambda x: isinstance(x, PartitionSpec)))
        if has_specs:
            raise ShardingError(
                f"nf.jit({self.name}) got PartitionSpecs but no mesh: pass mesh=nf.make_mesh(...), "
                f"call it under `with mesh:` (or nf.set_mesh(mesh)), or give NamedSharding(mesh, spec)."
            )
        return None


def _check(name: str, sharding: NamedSharding, shape: tuple, mesh, whose: str) -> None:
    """Refuse a sharding on another mesh than the step's, or one that does not fit `shape`."""
    if mesh is not None and sharding.mesh != mesh:
        raise ShardingError(f"{where(name)}{whose} {sharding.mesh!r}, but the function runs on {mesh!r}; use one "
                            f"mesh for every argument.")
    try:
        sharding.check(shape, name)
    except ShardingError as e:
        raise type(e)(f"argument {e}") from None


def arg_index(treespec, leaf_index: int):
    """Which positional argument the flat leaf `leaf_index` belongs to (None for kwargs)."""
    counts = [c.num_leaves for c in optree.treespec_children(optree.treespec_children(treespec)[0])]
    total = 0
    for i, c in enumerate(counts):
        total += c
        if leaf_index < total:
            return i
    return None


def _leaf_key(x: torch.Tensor) -> tuple:
    """A leaf's part of the signature. A DTensor replicated on every axis keys as a plain tensor
    (the replicated global value) does: the program is the same, so a step whose replicated results
    feed its next call is not traced again."""
    placements = tuple(x.placements) if isinstance(x, DTensor) else None
    if isinstance(x, ShapeDtypeStruct):
        placements = None if x.sharding is None else tuple(x.sharding.placements)
    if placements is not None and all(isinstance(p, Replicate) for p in placements):
        placements = None
    return (tuple(x.shape), x.dtype, x.device.type, placements)


def output_placements(name: str, traced, mesh, out_shardings) -> list:
    """Per result leaf of the traced step, the whole-mesh placements its out_sharding asks for
    (None: the partitioner's choice)."""
    is_spec = lambda x: isinstance(x, (NamedSharding, PartitionSpec))  # noqa: E731
    outs = traced.out_tree.unflatten(list(traced.out_specs))
    leaf_specs = tree_broadcast_prefix(out_shardings, outs, is_leaf=lambda x: is_spec(x) or x is None,
                                       prefix_name="out_shardings", full_name=f"{name}'s results")
    paths, specs, _ = optree.tree_flatten_with_path(leaf_specs, none_is_leaf=True)
    placements = []
    for path, spec, out in zip(paths, specs, traced.out_specs):
        if spec is None:
            placements.append(None)
            continue
        sharding = NamedSharding(mesh, spec) if isinstance(spec, PartitionSpec) else spec
        sharding.check(out.shape, f"result {keystr(path)}" if path else "result")
        placements.append(tuple(sharding.placements))
    return placements
