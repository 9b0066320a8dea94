"""From a traced step to the program each rank runs: every pass, in order, in `PASSES`.

Each pass is a function `Program -> Program` (`ndfunc._src.partition.program`). The first `LOWERED`
passes make what `Lowered` shows: the partitioned local program (`program.local`), its layouts
chosen, collectives inserted, transforms applied, then scheduled and its memory reused. The rest
make what runs on this backend and device (`program.runs`, a rewritten copy: what `Compiled`
shows). Transforms (`ndfunc._src.transforms.base`) run at their hooks here, nowhere else; the memory
passes come after every transform, so what a transform adds reuses buffers too.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ndfunc._src import collective_cost, donation, manual
from ndfunc._src.partition import lower as lowering
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.backends import cpu_kernels as kernels
from ndfunc._src.partition.backends import gloo as algorithms
from ndfunc._src.partition.passes import bucket, hoist, inplace, schedule, shared
from ndfunc._src.partition.planning import redistribute, solve
from ndfunc._src.partition.program import Program
from ndfunc._src.runtime import simulation_paused
from ndfunc._src.sharding.errors import ShardingWarning, user_stacklevel
from ndfunc._src.sharding.mesh import Mesh
from ndfunc._src.sharding.named_sharding import NamedSharding
from ndfunc._src.torch_compat import FakeTensorMode, flattened, unset_fake_temporarily
from ndfunc._src.trace import first_calls
from ndfunc._src.transforms.base import Transform

Pass = Callable[[Program], Program]
ABSTRACT_GROUP = "abstract:"  # the prefix of an abstract mesh axis's group name


def _on_local(rewrite: Callable[[torch.fx.GraphModule], Any], doc: str) -> Pass:
    """A pass that rewrites the local program in place with `rewrite`; `doc` says what it does."""
    def run(p: Program) -> Program:
        rewrite(p.local)
        return p

    run.__name__, run.__qualname__, run.__doc__ = rewrite.__name__, rewrite.__name__, doc
    return run


# --- before lowering: the global program -----------------------------------------------------------

def fix_layouts(p: Program) -> Program:
    """The layouts that sharding constraints and shard_map boundaries fix, on this mesh; regions marked."""
    for node, spec in p.traced.constraints():
        sharding = NamedSharding(p.mesh, spec)
        sharding.check(tuple(node.meta["val"].shape), f"with_sharding_constraint in {p.name}")
        prog.set_constraint_layout(node, p.layout_of(sharding.placements))
    graph = p.traced.graph
    if _mark_regions(graph):
        for node in graph.find_nodes(op="call_function", target=manual.enter_op) + \
                graph.find_nodes(op="call_function", target=manual.exit_op):
            prog.set_constraint_layout(node, p.layout_of(NamedSharding(p.mesh, manual.spec_of(node)).placements))
    return p


def transforms_traced(p: Program) -> Program:
    """Each transform's `traced` hook, on the global program (nf.remat's regions first)."""
    for t in p.transforms:
        t.traced(p)
    return p


def partition(p: Program) -> Program:
    """One strategy per node, chosen for the whole graph by what its collectives and ops take on
    the program's cluster, or this machine (`solve`); an op with no sharding rule runs whole, and
    the program warns once, naming it (`ShardingWarning`)."""
    on = collective_cost.machine(dict(zip(p.mesh.axis_names, p.mesh.axis_sizes)), p.cluster)
    p.plan = solve.partition(p.traced.graph, p.sizes, p.in_layouts, p.out_layouts,
                             redistribute.Prices.of(on, p.axis_names, p.sizes))
    whole = list(dict.fromkeys(n.target for n in p.plan.whole))
    if whole:
        warnings.warn(_runs_whole_message(p, whole), ShardingWarning, stacklevel=user_stacklevel())
    return p


def transforms_partitioned(p: Program) -> Program:
    """Each transform's `partitioned` hook: strategies chosen, nothing lowered yet."""
    for t in p.transforms:
        t.partitioned(p)
    return p


def lower(p: Program) -> Program:
    """The local program: each op on local blocks, each layout change as its collectives."""
    mesh = p.mesh
    group_names, group_of = process_groups(mesh, p.axes)
    p.local = lowering.lower(p.traced.graph, p.plan, p.axis_names, group_names, group_of,
                             dict(zip(mesh.axis_names, mesh.axis_sizes)))
    return p


def process_groups(mesh, axes) -> tuple[list[str], Callable[[tuple[str, ...]], str]]:
    """The names of the process groups a program over `mesh` runs on: one per axis of `axes`
    (indices), and axis names (mesh order) -> their group flattened, made by the first program
    that needs it, on every rank. An abstract mesh has no process group: the program names its
    axes, to be read, not run."""
    if isinstance(mesh, Mesh):
        @functools.cache  # slicing a DeviceMesh builds its rank tensors again (per rank, simulated)
        def group_of(names: tuple[str, ...]) -> str:
            with unset_fake_temporarily():
                return flattened(mesh.device_mesh[names]).get_group().group_name
        return [mesh.device_mesh.get_group(i).group_name for i in axes], group_of
    return [f"{ABSTRACT_GROUP}{mesh.axis_names[i]}" for i in axes], lambda names: ABSTRACT_GROUP + ",".join(names)


# --- the local program -----------------------------------------------------------------------------

share_repeated_moves = _on_local(
    shared.share_repeated_moves, "Views that repeat one another, and their layout changes, made once (`shared`).")

schedule_collectives = _on_local(
    schedule.schedule, "Each collective started and waited for as its window allows (`schedule`).")


def bucket_all_reduces(p: Program) -> Program:
    """Neighbouring all-reduces over one group become one, as DDP's buckets (`bucket`)."""
    while bucket.bucket_all_reduces(p.local):  # a merge can free the next (tp after dp)
        pass
    return p


hoist_freeing_ops = _on_local(
    hoist.hoist_freeing_ops, "Ops that free more memory than they take run as early as they can (`hoist`).")


def transforms_lowered(p: Program) -> Program:
    """Each transform's `lowered` hook, on the local program, its metadata filled first."""
    for t in p.transforms:
        if type(t).lowered is Transform.lowered:
            continue  # no hook: no metadata to fill for it
        p.ensure_meta()
        t.lowered(p)
        p._meta_ready = False  # the hook may have changed the program
    return p


def donate(p: Program) -> Program:
    """Results written into the buffers of donated arguments, after their last reads (`donation`)."""
    donation.apply_donation(p)
    return p


fold_scales = _on_local(
    inplace.fold_scales, "A scale of a value made for it alone folds into the op that makes it (`inplace`).")

fold_donated_copies = _on_local(
    inplace.fold_donated_copies, "A result copied into a donated buffer is computed there instead (`inplace`).")


reuse_buffers = _on_local(
    inplace.reuse_buffers, "Elementwise ops write into an input that dies there (`add` -> `add_`) (`inplace`).")


def schedule_within_peak(p: Program) -> Program:
    """Collectives whose window holds them in flight as long as the peak allows, placed (`schedule`)."""
    if schedule.needs_peak(p.local):
        p.ensure_meta(changed=True)  # the sizes of what transforms made, for the memory account
        schedule.schedule(p.local, peak=True)
    return p


# --- what runs here --------------------------------------------------------------------------------

def backend_collectives(p: Program) -> Program:
    """`program.runs`: collectives as this backend runs them fastest (gloo: all-to-alls) (`algorithms`)."""
    p.runs = algorithms.for_backend(p.local, algorithms.backend_of) if p.axes else p.local
    return p


def cpu_kernels(p: Program) -> Program:
    """Big fp32 matmuls of a CPU program by the faster kernel where it differs (`kernels`)."""
    # where the blocks are (an accelerator's if any is), else the mesh's: CUDA blocks on simulated
    # ranks, or with no mesh, make a CUDA program
    devices = {device.type for _, _, device in p.local_inputs()} - {"cpu"}
    device_type = min(devices) if devices else p.mesh.device_type if isinstance(p.mesh, Mesh) else None
    p.runs = kernels.choose(p.runs, device_type)
    return p


PASSES: tuple[Pass, ...] = (
    fix_layouts,
    transforms_traced,
    partition,
    transforms_partitioned,
    lower,
    share_repeated_moves,
    schedule_collectives,
    bucket_all_reduces,
    schedule_collectives,
    hoist_freeing_ops,
    transforms_lowered,
    donate,
    fold_scales,
    fold_donated_copies,
    reuse_buffers,
    schedule_within_peak,
    # -- Lowered: the partitioned program above; Compiled: what runs, below --
    backend_collectives,
    cpu_kernels,
)
LOWERED = PASSES.index(backend_collectives)


def backend_passes(compiled: bool) -> tuple[Pass, ...]:
    """The passes after `Lowered`, for a program run op by op or through torch.compile
    (`compiled`): Inductor chooses its own CPU kernels, and lowers no oneDNN op of ours."""
    return tuple(step for step in PASSES[LOWERED:] if not (compiled and step is cpu_kernels))


def run(p: Program, passes=PASSES) -> Program:
    """`p` through `passes`, in order."""
    with young_collections_only():
        for step in passes:
            p = step(p)
    return p


@contextlib.contextmanager
def young_collections_only():
    """Python's cyclic collector scans its young generations only, while a program is built.

    Building one makes millions of objects that live as long as it does (graph nodes, their
    metadata, candidate strategies), and the collector walks every object in a full collection,
    which it runs each time the survivors have grown by a quarter: lowering the 70B shape's 80
    layers spent 11 of its 13 s of collection in 20 full ones. Young collections still free the
    short-lived cycles; full ones resume as they were set afterwards. (PyTorch's distributed
    `get_state_dict` pauses the collector outright for the same reason.) The thresholds are
    process-wide: a program built in another thread meanwhile is built under them too."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, max(old, 2**30))
    try:
        yield
    finally:
        gc.set_threshold(young, middle, old)


# --- helpers ---------------------------------------------------------------------------------------

def _mark_regions(graph: torch.fx.Graph) -> bool:
    """Mark every node inside an `nf.shard_map` region as manual; whether there is any."""
    any_region = False
    for node in graph.nodes:
        if node.op != "call_function" or node.target is manual.exit_op:
            continue
        if node.target in (manual.enter_op, manual.axis_index_op) or any(map(prog.is_manual, node.all_input_nodes)):
            prog.mark_manual(node)
            any_region = True
    return any_region


def _runs_whole_message(p: Program, whole: list) -> str:
    lines = _user_lines(p, whole)
    each = "; ".join(f"{op}{lines.get(op, '')}" for op in whole)
    return (
        f"{p.name}: no sharding rule for {each}. Each runs whole on every rank: its inputs gathered where "
        f"they are sharded, its results replicated (the plan prices the gathers). To keep the work "
        f"sharded, write it with ops that have rules, run it per block inside nf.shard_map, or add a rule "
        f"(the op registry: docs/architecture.md)."
    )


def _user_lines(p: Program, ops_: list) -> dict:
    """', made at file:line (code)' for the first call of each of `ops_` from the user's code (the
    innermost frame outside torch, ndfunc and optree; in a library, with the user's line that called
    it): the function run once more on fake tensors (`p.retrace`), watched op by op."""
    if p.retrace is None:
        return {}
    with simulation_paused():
        with FakeTensorMode():
            return {op: f", made {where}" for op, where in first_calls(p.retrace, ops_).items()}
