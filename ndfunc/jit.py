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
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from ndfunc import manual
from ndfunc.donation import apply_donation, mark_donated
from ndfunc.partition import lower as lowering
from ndfunc.partition.analysis import as_text, cost_analysis
from ndfunc.partition.bucket import bucket_all_reduces
from ndfunc.partition.inplace import fold_donated_copies, reuse_buffers
from ndfunc.partition.layout import Layout
from ndfunc.partition.program import Program
from ndfunc.partition.solve import partition
from ndfunc.partition.strategies import NoStrategy
from ndfunc.sharding.errors import ShardingError, where
from ndfunc.sharding.mesh import AbstractMesh, Mesh, get_mesh
from ndfunc.sharding.named_sharding import NamedSharding
from ndfunc.sharding.partition_spec import PartitionSpec
from ndfunc.trace import Traced, trace
from ndfunc.transfer import device_put, from_local, sharding_of
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
        mesh, prepared, key = self._prepare(args, kwargs)
        if key not in self._cache:
            self._cache[key] = self._lowered(mesh, prepared, key)
        return self._cache[key].compiled, prepared

    def _prepare(self, args, kwargs):
        """Resolve the mesh, lay every leaf out as the in_shardings say, and key the signature."""
        static = {i % len(args) for i in self.static_argnums} if args else set()
        mesh = self._find_mesh(args, kwargs)
        dynamic = tuple(None if i in static else a for i, a in enumerate(args))
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
            sharding = NamedSharding(mesh, spec) if isinstance(spec, PartitionSpec) else spec
            if mesh is not None and sharding.mesh != mesh:
                raise ShardingError(f"{where(name)}in_shardings uses {sharding.mesh!r}, but the function runs on "
                                    f"{mesh!r}; use one mesh for every argument.")
            try:
                sharding.check(tuple(x.shape), name)
            except ShardingError as e:
                raise type(e)(f"argument {e}") from None
            current = sharding_of(x)
            if current is None and sharding.is_fully_replicated:
                pass  # a plain tensor is the replicated global value already
            elif current is None or not current.is_equivalent_to(sharding, x.ndim):
                x = device_put(x, sharding)
        if isinstance(x, DTensor) and any(isinstance(p, _StridedShard) for p in x.placements):
            # programs hold plain nested splits only: an axis order other than the mesh's is
            # gathered on that axis first
            x = x.redistribute(x.device_mesh, [Replicate() if isinstance(p, _StridedShard) else p
                                               for p in x.placements])
        return x

    def _find_mesh(self, args, kwargs) -> Mesh | None:
        if self.mesh is not None:
            return self.mesh
        for s in optree.tree_leaves((self.in_shardings, self.out_shardings),
                                    is_leaf=lambda x: isinstance(x, (NamedSharding, PartitionSpec))):
            if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
                return s.mesh
        for x in optree.tree_leaves((args, kwargs)):
            if isinstance(x, DTensor):
                return sharding_of(x).mesh
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


def _partitioned_axes(mesh: Mesh) -> list[int]:
    return [i for i, n in enumerate(mesh.axis_sizes) if n > 1]


def _layout(placements, axes: list[int]) -> Layout:
    return tuple(placements[i] for i in axes)


@dataclasses.dataclass
class Lowered:
    """A traced, partitioned and lowered step: inspect it, or `.compile()` it."""

    name: str
    program: Program
    jitted: Jitted
    key: Any

    @staticmethod
    def build(jitted: Jitted, key, traced: Traced, mesh: Mesh, prepared, donated) -> "Lowered":
        name, out_shardings, transforms = jitted.__name__, jitted.out_shardings, jitted.transforms
        axes = _partitioned_axes(mesh)
        sizes = tuple(mesh.axis_sizes[i] for i in axes)
        in_layouts = []
        for x in prepared:
            placements = tuple(x.placements) if isinstance(x, DTensor) else (Replicate(),) * len(mesh.axis_names)
            in_layouts.append(_layout(placements, axes))
        out_layouts = _output_layouts(name, traced, mesh, out_shardings, axes)
        for node, spec in traced.constraints():
            val = node.meta["val"]
            sharding = NamedSharding(mesh, spec)
            sharding.check(tuple(val.shape), f"with_sharding_constraint in {name}")
            node.meta["ndfunc_layout"] = _layout(sharding.placements, axes)
        if manual.mark_regions(traced.graph):
            for node in traced.graph.find_nodes(op="call_function", target=manual.enter_op) + \
                    traced.graph.find_nodes(op="call_function", target=manual.exit_op):
                node.meta["ndfunc_layout"] = _layout(NamedSharding(mesh, manual.spec_of(node)).placements, axes)
        program = Program(name=name, traced=traced, mesh=mesh, axes=tuple(axes), sizes=sizes,
                          in_layouts=in_layouts, out_layouts=out_layouts, donated=donated)
        try:
            program.plan = partition(traced.graph, sizes, in_layouts, out_layouts)
        except NoStrategy as e:
            raise _no_strategy_error(jitted, key, e) from None
        for t in transforms:
            if hasattr(t, "partitioned"):
                t.partitioned(program)
        group_names = [mesh.device_mesh.get_group(i).group_name for i in axes] if axes else []
        program.local = lowering.lower(traced.graph, program.plan, [mesh.axis_names[i] for i in axes], group_names,
                                       dict(zip(mesh.axis_names, mesh.axis_sizes)))
        bucket_all_reduces(program.local)
        apply_donation(program)
        fold_donated_copies(program.local)
        reuse_buffers(program.local)
        for t in transforms:
            if hasattr(t, "lowered"):
                program.ensure_meta()
                t.lowered(program)
                program._meta_ready = False  # the pass may have changed the program
        return Lowered(name, program, jitted, key)

    def as_text(self) -> str:
        """The local program each rank runs; collectives show kind, mesh axes and bytes."""
        return as_text(self.program)

    def cost_analysis(self) -> dict:
        """Per rank: `flops`, `comm_bytes` (moved, total and per kind), `collectives` (count per
        kind), `peak_memory_bytes` (from liveness in the local program, inputs included)."""
        return cost_analysis(self.program)

    def compile(self) -> "Compiled":
        return self.compiled

    @functools.cached_property
    def compiled(self) -> "Compiled":
        return Compiled(self.program, self.jitted, self.key)


class Compiled:
    """A lowered step ready to run: `compiled(*args)` with the signature it was lowered for."""

    def __init__(self, program: Program, jitted: Jitted, key):
        self.program, self._jitted, self._key = program, jitted, key
        self._coords = None

    def __call__(self, *args, **kwargs):
        _, prepared, key = self._jitted._prepare(args, kwargs)
        if key != self._key:
            raise TypeError(
                f"this Compiled {self.program.name} was lowered for other arguments (shapes, dtypes, "
                f"shardings or static values differ); call the nf.jit function, which compiles per signature."
            )
        return self._run(prepared, args)

    def _coords_tensor(self, device) -> torch.Tensor:
        if self._coords is None:
            mesh, axes = self.program.mesh, self.program.axes
            from torch.distributed._local_tensor import local_tensor_mode

            mode = local_tensor_mode()
            if mode is not None:
                self._coords = mode.rank_map(lambda r: torch.tensor([mesh.coordinate(r)[i] for i in axes],
                                                                    dtype=torch.int64, device=device))
            else:
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_initialized() else 0
                self._coords = torch.tensor([mesh.coordinate(rank)[i] for i in axes] if axes else [],
                                            dtype=torch.int64, device=device)
        return self._coords

    def _run(self, prepared: list, original_args: tuple):
        p = self.program
        locals_ = [x._local_tensor if isinstance(x, DTensor) else x for x in prepared]
        from torch.distributed._local_tensor import local_tensor_mode

        mode = local_tensor_mode()
        if mode is not None:  # in simulation every input is per rank, so no op mixes the two kinds
            locals_ = [x if isinstance(x, LocalTensor) else mode.rank_map(lambda r, x=x: x) for x in locals_]
        device = locals_[0].device if locals_ else torch.device("cpu")
        with torch.no_grad():
            outs = list(p.local(*locals_, self._coords_tensor(device)))
            for j in p.donation:  # a new tensor on the donated memory: the old object is retired
                outs[j] = outs[j].detach()
        del locals_
        mark_donated(p, prepared, optree.tree_leaves(original_args))
        results = [self._wrap(o, i) for i, o in enumerate(outs)]
        return p.traced.out_tree.unflatten(results)

    def _wrap(self, local: torch.Tensor, i: int) -> DTensor | torch.Tensor:
        p = self.program
        if not isinstance(p.mesh, Mesh):
            return local
        layout = p.plan.outputs[i][1]
        placements = [Replicate()] * len(p.mesh.axis_names)
        for axis, placement in zip(p.axes, layout):
            placements[axis] = placement
        return from_local(local, p.mesh.device_mesh, placements, p.traced.out_specs[i].shape)


def _output_layouts(name, traced: Traced, mesh: Mesh, out_shardings, axes) -> list:
    is_spec = lambda x: isinstance(x, (NamedSharding, PartitionSpec))  # noqa: E731
    outs = traced.out_tree.unflatten(list(traced.out_specs))
    leaf_specs = tree_broadcast_prefix(out_shardings, outs, is_leaf=lambda x: is_spec(x) or x is None,
                                       prefix_name="out_shardings", full_name=f"{name}'s results")
    paths, specs, _ = optree.tree_flatten_with_path(leaf_specs, none_is_leaf=True)
    layouts = []
    for path, spec, out in zip(paths, specs, traced.out_specs):
        if spec is None:
            layouts.append(None)
            continue
        sharding = NamedSharding(mesh, spec) if isinstance(spec, PartitionSpec) else spec
        sharding.check(out.shape, f"result {keystr(path)}" if path else "result")
        layouts.append(_layout(sharding.placements, axes))
    return layouts


def _no_strategy_error(jitted: Jitted, key, e: NoStrategy) -> Exception:
    op = e.args[0]
    line = _user_line(jitted, key, op)
    return NotImplementedError(
        f"{jitted.__name__}: DTensor has no sharding rule for {op}{line}. Replicate its inputs with "
        f"nf.with_sharding_constraint(x, P()) (it then runs whole on every rank), or compute it inside "
        f"nf.shard_map, where you place the data yourself."
    )


def _user_line(jitted: Jitted, key, op) -> str:
    """', made at file:line (code)' for the first call of `op` from the user's code: the function
    run once more on fake tensors, watched op by op."""
    import linecache
    import os
    import traceback

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._local_tensor import local_tensor_mode
    from torch.utils._python_dispatch import TorchDispatchMode

    library = (os.path.dirname(torch.__file__), os.path.dirname(__file__), os.path.dirname(optree.__file__))
    found: list = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is op and not found:
                frames = [f for f in traceback.extract_stack() if not f.filename.startswith(library)
                          and "site-packages" not in f.filename and not f.filename.startswith("<")]
                found.extend(frames[-1:])
            return func(*args, **(kwargs or {}))

    treespec, statics, leaves = key
    simulated = local_tensor_mode()
    try:
        with simulated.disable() if simulated is not None else contextlib.nullcontext():
            with FakeTensorMode():
                fakes = [torch.empty(s, dtype=d) for s, d, _, _ in leaves]
                dyn_args, kwargs = optree.tree_unflatten(treespec, fakes)
                static = dict(statics)
                with Watch():
                    jitted.fn(*[static[i] if i in static else a for i, a in enumerate(dyn_args)], **kwargs)
    except Exception:  # noqa: BLE001 - the line is a courtesy; the error is the op
        pass
    if not found:
        return ""
    f = found[0]
    code = (f.line or linecache.getline(f.filename, f.lineno)).strip()
    return f", made at {f.filename}:{f.lineno} ({code})"
