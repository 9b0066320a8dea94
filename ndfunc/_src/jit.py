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
import math
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate

from ndfunc._src import agreement, pipeline
from ndfunc._src.arguments import Arguments, Bounded, arg_index, output_placements
from ndfunc._src.forward import on_workers
from ndfunc._src.partition.planning.ops import decompositions
from ndfunc._src.partition.program import Program
from ndfunc._src.planner.cluster import Cluster, check_cluster
from ndfunc._src.sharding.mesh import AbstractMesh, Mesh, get_mesh
from ndfunc._src.sharding.shape_dtype import ShapeDtypeStruct
from ndfunc._src.stages import Lowered
from ndfunc._src.trace import trace
from ndfunc._src.transforms.base import check_transforms
from ndfunc._src.transforms.remat import remat_regions


def jit(fn: Callable | None = None, *, mesh: Mesh | None = None, in_shardings: Any = None,
        out_shardings: Any = None, static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (), transforms: Sequence[Any] = (), compile: bool | str = False,
        cluster: Cluster | None = None):
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
        transforms: passes over the program at the pipeline's hooks (`ndfunc._src.transforms.base`):
            `nf.fsdp(axis)`, `nf.ring_attention(axis)`, `nf.mixed_precision(...)`. Each is checked
            against the mesh: naming an axis it does not have is an error.
        compile: run each rank's local program through `torch.compile` (True: Inductor; a string:
            that torch.compile backend), which fuses its pointwise ops (the optimizer's update, casts,
            norms) into a few kernels: on a GPU, what takes a step to the speed of a compiled eager
            step. The program (partitioning, collectives, donation) is the same; only how its ops run
            changes. The first call compiles (seconds to minutes). Simulated ranks run op by op.
        cluster: the `ndfunc.plan.Cluster` the mesh runs on, its ranks row-major: the partitioner
            prices each collective on the link its axis crosses (NVLink within a node, the fabric
            where a group spans nodes) and a rank's work at the device's peak, as `nf.plan` does.
            None: this machine's defaults, one link for every axis.

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
                                 transforms=transforms, compile=compile, cluster=cluster)
    refused = getattr(fn, "ndfunc_not_jitted", None)  # a function that runs jitted programs of its own
    if refused is not None:
        raise TypeError(f"nf.jit: {refused}")
    transforms = check_transforms(transforms, getattr(fn, "__name__", "fn"))
    if isinstance(mesh, (Mesh, AbstractMesh)):
        for t in transforms:
            t.validate(mesh)
    if not isinstance(compile, (bool, str)):
        raise TypeError(f"nf.jit: compile= takes True (Inductor), False, or a torch.compile backend's name "
                        f"such as 'inductor'; got {compile!r}.")
    backend = ("inductor" if compile is True else compile) or None
    if cluster is not None:
        check_cluster(cluster, "nf.jit")
    return Jitted(fn, mesh, in_shardings, out_shardings, _ints(static_argnums), _ints(donate_argnums), transforms,
                  backend, cluster)


def _ints(x) -> tuple[int, ...]:
    return (x,) if isinstance(x, int) else tuple(x)


class Jitted:
    """A function compiled per signature. Call it, or `.lower(*args)` to inspect."""

    __ndfunc_twin__ = True  # under nf.processes: sent to the workers once, each keeping its programs

    def __init__(self, fn, mesh, in_shardings, out_shardings, static_argnums, donate_argnums, transforms,
                 backend=None, cluster=None):
        functools.update_wrapper(self, fn)
        self.backend = backend  # torch.compile's backend for the local program, or None: op by op
        self.cluster = cluster  # what the partitioner prices collectives on (None: this machine)
        self.fn, self.mesh = fn, mesh
        self.in_shardings, self.out_shardings = in_shardings, out_shardings
        self.static_argnums, self.donate_argnums, self.transforms = static_argnums, donate_argnums, transforms
        self.arguments = Arguments(self.__name__, mesh, in_shardings, out_shardings, static_argnums)
        self._cache: dict = {}  # signature -> Lowered
        self._agreed: set = set()  # signatures every rank was found to run alike
        # arguments as they came (see Arguments.quick) -> (mesh, key, what the key's ids name):
        # nothing to lay out
        self._seen: Bounded = Bounded()
        self.trace_count = 0  # how many signatures were traced

    def __reduce__(self):  # as built: its programs are made again where it lands (nf.processes' workers)
        return (Jitted, (self.fn, self.mesh, self.in_shardings, self.out_shardings, self.static_argnums,
                         self.donate_argnums, self.transforms, self.backend, self.cluster))

    @on_workers(asynchronous=True, donates=lambda self, *args, **kwargs: [
        args[i] for i in self.donate_argnums if -len(args) <= i < len(args)])
    def __call__(self, *args, **kwargs):
        compiled, prepared = self._compiled(args, kwargs)
        return compiled._run(prepared, args)

    @on_workers
    def lower(self, *args, **kwargs) -> Lowered:
        """The traced, partitioned and lowered program for these arguments (cached: a later call
        with the same signature runs it)."""
        self._check_donated(args)
        mesh, prepared, key = self.arguments.prepare(args, kwargs)
        if key not in self._cache:
            self._cache[key] = self._lowered(mesh, prepared, key)
        return self._cache[key]

    def _check_donated(self, args) -> None:
        wrong = [i for i in self.donate_argnums if not -len(args) <= i < len(args)]
        if wrong:
            raise ValueError(f"donate_argnums {tuple(self.donate_argnums)} for {self.__name__}: it was called with "
                             f"{len(args)} positional argument(s), so {wrong[0]} names none; donate the positions of "
                             f"arguments it takes (0 to {len(args) - 1}).")

    def _compiled(self, args, kwargs):
        quick, leaves = self.arguments.quick(args, kwargs)
        seen = self._seen.get(quick) if quick is not None else None
        if seen is not None:  # a step like the last: its leaves are laid out already
            mesh, key, _ = seen
            prepared = leaves
        else:
            self._check_donated(args)
            mesh, prepared, key = self.arguments.prepare(args, kwargs)
            # (a stand-in is never a step's remembered leaf: `quick` takes tensors only, and a
            # tensor on an abstract mesh is prepared as a stand-in, so this is not asked per step)
            if any(isinstance(x, ShapeDtypeStruct) for x in prepared):
                raise TypeError(f"{self.__name__} was called with nf.ShapeDtypeStruct stand-ins (or on an abstract "
                                f"mesh), which have shapes but no data: lower them to read the plan "
                                f"({self.__name__}.lower(*args).cost_analysis() / .memory_analysis()), and call it "
                                f"with tensors to run it.")
            if quick is not None and all(p is x for p, x in zip(prepared, leaves)):
                # the meshes whose ids the key holds stay alive with it, so no other takes their id
                meshes = (get_mesh(), *(x.device_mesh for x in leaves if isinstance(x, DTensor)))
                self._seen[quick] = (mesh, key, meshes)
        if key not in self._cache:
            self._cache[key] = self._lowered(mesh, prepared, key)
        lowered = self._cache[key]
        if key not in self._agreed:  # before it first runs over real ranks: the same program on each
            agreement.check(self.__name__, lowered.program, key[1])
            self._agreed.add(key)
        return lowered.compiled, prepared

    def _lowered(self, mesh, prepared, key) -> Lowered:
        if mesh is None:
            mesh = _world_of_one()
        for t in self.transforms:
            t.validate(mesh)
        if self.cluster is not None and math.prod(mesh.axis_sizes) != self.cluster.num_gpus:
            raise ValueError(f"nf.jit: {self.__name__}'s mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))} has "
                             f"{math.prod(mesh.axis_sizes)} ranks; its cluster has {self.cluster.num_gpus} GPUs. Give "
                             f"nf.jit the cluster the mesh runs on (Cluster.of(gpu, num_gpus)).")
        self.trace_count += 1
        treespec, statics, _ = key
        dyn_args, kwargs = optree.tree_unflatten(treespec, list(prepared))
        static = dict(statics)
        call_args = [static[i] if i in static else dyn_args[i] for i in range(len(dyn_args))]
        with pipeline.young_collections_only():
            with contextlib.ExitStack() as stack:  # transforms that change what is traced (mixed precision)
                for t in self.transforms:
                    stack.enter_context(t.tracing())
                traced = trace(self.fn, call_args, kwargs, static_argnums=tuple(static),
                               decompositions=decompositions())
            donated = [i for i in range(len(prepared)) if arg_index(treespec, i) in self.donate_argnums]
            program = _program(self.__name__, traced, mesh, prepared, self.out_shardings, donated=donated,
                               transforms=(remat_regions(), *self.transforms), retrace=self._retrace(key),
                               cluster=self.cluster)
            program = pipeline.run(program, pipeline.PASSES[:pipeline.LOWERED])
        return Lowered(self.__name__, program, self.arguments, key, self.backend)

    def _retrace(self, key) -> Callable[[], Any]:
        """The function called again on fake tensors of this signature (inside a FakeTensorMode)."""
        treespec, statics, leaves = key

        def retrace():
            fakes = [torch.empty(s, dtype=d, device=t) for s, d, t, _ in leaves]
            dyn_args, kwargs = optree.tree_unflatten(treespec, fakes)
            static = dict(statics)
            self.fn(*[static[i] if i in static else a for i, a in enumerate(dyn_args)], **kwargs)

        return retrace


def _program(name: str, traced, mesh, prepared: list, out_shardings, **fields) -> Program:
    """The program record of a traced step: its mesh's partitioned axes and its boundary layouts."""
    axes = tuple(i for i, n in enumerate(mesh.axis_sizes) if n > 1)
    program = Program(name=name, traced=traced, mesh=mesh, axes=axes, sizes=tuple(mesh.axis_sizes[i] for i in axes),
                      in_layouts=[], out_layouts=[], **fields)
    for x in prepared:
        if isinstance(x, ShapeDtypeStruct) and x.sharding is not None:
            placements = tuple(x.sharding.placements)
        elif isinstance(x, DTensor):
            placements = tuple(x.placements)
        else:
            placements = (Replicate(),) * len(mesh.axis_names)
        program.in_layouts.append(program.layout_of(placements))
    program.out_placements = output_placements(name, traced, mesh, out_shardings)
    program.out_layouts = [None if p is None else program.layout_of(p) for p in program.out_placements]
    return program


def _world_of_one() -> AbstractMesh:
    """No mesh anywhere: every rank runs the whole program (results are plain tensors)."""
    return AbstractMesh((("world", 1),))
