"""From a traced step to a running one: `Lowered` (partition, lower, passes; read it) and
`Compiled` (run it on local blocks). `nf.jit` makes them, one per argument signature."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import optree
import torch
from torch.distributed._local_tensor import LocalTensor, local_tensor_mode
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ndfunc import manual
from ndfunc.donation import apply_donation, mark_donated
from ndfunc.partition import kernels
from ndfunc.partition import lower as lowering
from ndfunc.partition.analysis import as_text, cost_analysis
from ndfunc.partition.bucket import bucket_all_reduces
from ndfunc.partition.algorithms import backend_of, for_backend
from ndfunc.partition.inplace import fold_donated_copies, fold_scales, reuse_buffers
from ndfunc.partition.layout import Layout
from ndfunc.partition.program import Program
from ndfunc.partition.runner import direct
from ndfunc.partition.schedule import hoist_freeing_ops, issue_reductions_early, wait_in_turn
from ndfunc.partition.solve import partition
from ndfunc.partition.strategies import NoStrategy
from ndfunc.remat import rematerialize
from ndfunc.sharding.mesh import Mesh
from ndfunc.sharding.named_sharding import NamedSharding
from ndfunc.sharding.partition_spec import PartitionSpec
from ndfunc.trace import Traced
from ndfunc.tree import keystr, tree_broadcast_prefix

if TYPE_CHECKING:
    from ndfunc.jit import Jitted


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
        out_placements = _output_placements(name, traced, mesh, out_shardings)
        out_layouts = [None if p is None else _layout(p, axes) for p in out_placements]
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
                          in_layouts=in_layouts, out_layouts=out_layouts, donated=donated,
                          out_placements=out_placements)
        rematerialize(traced.graph)  # nf.remat regions, recomputed for backward
        for t in transforms:
            if hasattr(t, "traced"):
                t.traced(program)
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
        issue_reductions_early(program.local)
        while bucket_all_reduces(program.local):  # a merge can free the next (tp after dp)
            pass
        wait_in_turn(program.local)
        hoist_freeing_ops(program.local)
        apply_donation(program)
        fold_scales(program.local)
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
        self._donated = frozenset(program.donated)
        # the local program as it runs: each collective by the backend's fastest way
        # (ndfunc.partition.algorithms), big fp32 matmuls on CPU by the faster kernel where it
        # differs (ndfunc.partition.kernels), each op called directly (ndfunc.partition.runner)
        device_type = program.mesh.device_type if isinstance(program.mesh, Mesh) else None
        self.runs = kernels.choose(for_backend(program.local, backend_of), device_type)
        self._forward = direct(self.runs)
        # how each result is wrapped, worked out once: placements over the whole mesh, shape, stride
        self._specs = []
        if isinstance(program.mesh, Mesh):
            for (_, layout), spec, asked in zip(program.plan.outputs, program.traced.out_specs,
                                                program.out_placements):
                # as asked, size-1 axes included, so a result passes back in as it came out
                placements = list(asked) if asked is not None else [Replicate()] * len(program.mesh.axis_names)
                for axis, placement in zip(program.axes, layout):
                    placements[axis] = placement
                shape = torch.Size(spec.shape)
                meta = TensorMeta(shape, torch.empty(shape, device="meta").stride(), spec.dtype)
                self._specs.append(DTensorSpec(program.mesh.device_mesh, tuple(placements), tensor_meta=meta))

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
        mode = local_tensor_mode()
        if mode is not None:  # in simulation every input is per rank, so no op mixes the two kinds
            # (a donated one a copy per rank: one tensor for all would take every rank's write)
            locals_ = [x if isinstance(x, LocalTensor) else
                       mode.rank_map(lambda r, x=x, copy=i in self._donated: x.clone() if copy else x)
                       for i, x in enumerate(locals_)]
        device = locals_[0].device if locals_ else torch.device("cpu")
        with torch.no_grad():
            outs = list(self._forward(*locals_, self._coords_tensor(device)))
            for j in p.donation:  # a new tensor on the donated memory: the old object is retired
                outs[j] = outs[j].detach()
        del locals_
        mark_donated(p, prepared, optree.tree_leaves(original_args))
        if self._specs:  # no mesh: plain tensors, as they came
            # DTensor's constructor, not from_local: no autograd Function per result (nothing
            # here is differentiated), the layouts were settled when the program was built
            outs = [DTensor(o, spec, requires_grad=False) for o, spec in zip(outs, self._specs)]
        return p.traced.out_tree.unflatten(outs)


def _output_placements(name, traced: Traced, mesh: Mesh, out_shardings) -> list:
    """Per result leaf, the placements its out_sharding asks for (None: the partitioner's choice)."""
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
