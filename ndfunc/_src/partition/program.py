"""The program record: what the passes from a traced step to a running one hand each other.

A `Program` is one signature's step on its way to running: the traced global graph, the mesh, the
layouts asked for at its boundary, the partitioner's `plan`, and the `local` program each rank
runs. Passes (`ndfunc._src.pipeline`) and transforms (`ndfunc._src.transforms.base`) take it and
return it.

Layouts: the partitioner works over the mesh axes of size > 1 only (a size-1 axis never needs a
collective), so every `Layout` in a program has one placement per *partitioned* axis, in mesh
order: `program.axis_names[i]` names entry `i`. The one mapping to and from the whole mesh's
placements (what DTensor holds, size-1 axes included) is `Program.layout_of` and
`Program.mesh_placements`; a `Comm` names its axes by name.

What a pass knows about a node beyond its op is kept in the node's metadata, and read and written
only through the functions below (no module spells a metadata key):

    comm(node) / set_comm(node, c)             a collective: a `Comm`, what it moves
    local_note(node) / note_local(node, ...)   (shape, dtype) of a local value before `meta['val']`
    shape_dtype(node)                          its `meta['val']`'s, else the note
    constraint_layout(node) / set_...          the layout a constraint or region boundary fixes
    is_manual(node) / mark_manual(node)        inside an `nf.shard_map` region: already per rank
    local_op(node) / set_local_op(node, ...)   a transform's own lowering of a node (the ring)
    kept_split(node) / keep_split(node, axis)  a transform keeps the node's keys split on an axis
    window(node) / set_window(node, w)         where a collective may start and be waited for
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Replicate
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ndfunc._src.partition.planning.layout import Layout, local_shape
from ndfunc._src.runtime import simulation_paused
from ndfunc._src.torch_compat import FakeTensorMode

KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "ppermute")


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective of a local program, as each rank sees it.

    `sent` is the shape of the tensor a rank hands the collective (as laid out for it: blocks for
    other ranks stacked on dim 0), `received` the shape it gets back; `bytes` is the size of the
    value the collective is about (the gathered whole, the reduced input), `moved` the bytes each
    rank sends (ring algorithms). `bucket` collectives of the partitioner's were merged into this
    one; `parameters` marks a bucket of one layer's parameter gathers (`nf.fsdp`).
    """

    kind: str
    axes: tuple[str, ...]
    sent: tuple[int, ...]
    received: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    group: str | None
    bytes: float
    moved: float
    bucket: int = 1
    parameters: bool = False

    def __post_init__(self):
        assert self.kind in KINDS, self.kind

    @property
    def sent_bytes(self) -> int:
        """The size of what a rank hands the collective."""
        return math.prod(self.sent) * self.dtype.itemsize

    def in_dtype(self, dtype: torch.dtype) -> "Comm":
        """The same collective, moving `dtype` instead (bytes scale with the element size)."""
        ratio = dtype.itemsize / self.dtype.itemsize
        return dataclasses.replace(self, dtype=dtype, bytes=self.bytes * ratio, moved=self.moved * ratio)

    def describe(self) -> str:
        """What `as_text` writes beside it."""
        text = f"{self.kind} over {self.axes}: {self.bytes} B, {self.moved:.0f} B sent per rank"
        return text + (f" (a bucket of {self.bucket})" if self.bucket > 1 else "")


def merged(comms: Sequence[Comm], sent: tuple[int, ...], received: tuple[int, ...], **changes) -> Comm:
    """One collective standing for `comms` (a bucket of `len(comms)`): their bytes added up,
    `sent` and `received` as laid end to end."""
    return dataclasses.replace(comms[0], sent=tuple(sent), received=tuple(received),
                               bytes=sum(c.bytes for c in comms), moved=sum(c.moved for c in comms),
                               bucket=len(comms), **changes)


def received_shape(kind: str, sent: Sequence[int], n: int) -> tuple[int, ...]:
    """What a rank gets back from a collective over `n` ranks that it hands a tensor of `sent`."""
    sent = tuple(sent)
    if kind == "all_gather":
        return (sent[0] * n, *sent[1:])
    if kind == "reduce_scatter":
        return (sent[0] // n, *sent[1:])
    return sent


# --- node metadata, through these functions only -------------------------------------------------

_COMM, _LOCAL, _LAYOUT, _MANUAL, _LOCAL_OP, _SPLIT, _WINDOW, _MARKS = (
    "ndfunc_comm", "ndfunc_local", "ndfunc_layout", "ndfunc_manual", "ndfunc_local_op", "ndfunc_kept_split",
    "ndfunc_window", "ndfunc_marks")


def comm(node: torch.fx.Node) -> Comm | None:
    """What the collective `node` moves; None if it is no collective of the program's."""
    return node.meta.get(_COMM)


def set_comm(node: torch.fx.Node, c: Comm) -> None:
    node.meta[_COMM] = c


def collectives(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, Comm]]:
    """Every collective of the local program `gm`, in program order."""
    return [(n, n.meta[_COMM]) for n in gm.graph.nodes if _COMM in n.meta]


def shape_dtype(node: torch.fx.Node) -> tuple | None:
    """(shape, dtype) of a node's tensor result, from its metadata or the lowering's note (for
    passes that run before metadata is filled)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape), val.dtype
    return local_note(node)


def local_note(node: torch.fx.Node) -> tuple | None:
    """(shape, dtype) the lowering noted for a local value, for passes that run before `meta['val']`."""
    return node.meta.get(_LOCAL)


def note_local(node: torch.fx.Node, shape: Sequence[int], dtype: torch.dtype) -> torch.fx.Node:
    node.meta[_LOCAL] = (tuple(shape), dtype)
    return node


def marks(node: torch.fx.Node) -> dict | None:
    """The annotations (`torch.fx.traceback.annotate`: forward, differentiated) of the traced op a
    local node was lowered from; None for what the partitioner and the passes added (collectives,
    their waits and reshapes)."""
    return node.meta.get(_MARKS)


def carry_marks(node: torch.fx.Node, traced: torch.fx.Node) -> None:
    node.meta[_MARKS] = traced.meta.get("custom") or {}


def constraint_layout(node: torch.fx.Node) -> Layout | None:
    """The layout a sharding constraint, or a shard_map boundary, fixes for its value."""
    return node.meta.get(_LAYOUT)


def set_constraint_layout(node: torch.fx.Node, layout: Layout) -> None:
    node.meta[_LAYOUT] = layout


def is_manual(node: torch.fx.Node) -> bool:
    """Whether the node is inside an `nf.shard_map` region (its values are per rank already)."""
    return bool(node.meta.get(_MANUAL))


def mark_manual(node: torch.fx.Node) -> None:
    node.meta[_MANUAL] = True


@dataclasses.dataclass(frozen=True)
class LoweringContext:
    """What a transform's own lowering of a node (`set_local_op`) may use of the local program
    being written: `coords` (the node holding this rank's position on each partitioned axis),
    the partitioned axes' names and sizes."""

    coords: torch.fx.Node
    axis_names: tuple[str, ...]
    sizes: tuple[int, ...]


# (context, node, strategy, op, args, kwargs) -> (op, args, kwargs, Comm or None)
LocalOp = Callable[[LoweringContext, torch.fx.Node, Any, Any, tuple, dict], tuple]


def local_op(node: torch.fx.Node) -> LocalOp | None:
    """A transform's own lowering of `node`, if one was set."""
    return node.meta.get(_LOCAL_OP)


def set_local_op(node: torch.fx.Node, lowering: LocalOp) -> None:
    node.meta[_LOCAL_OP] = lowering


def kept_split(node: torch.fx.Node) -> Any:
    """What a transform asked of the node's strategies (the ring's mark), or None."""
    return node.meta.get(_SPLIT)


def keep_split(node: torch.fx.Node, mark: Any) -> None:
    """Ask the partitioner to keep `node`'s keys and values split as `mark` says (hashable, with
    `live`: the partitioned axis; it keys the strategy cache)."""
    node.meta[_SPLIT] = mark


def window(node: torch.fx.Node) -> Any:
    """The `schedule.Window` declared for the collective `node` (where it may start and be waited
    for), or None: its kind's."""
    return node.meta.get(_WINDOW)


def set_window(node: torch.fx.Node, w: Any) -> None:
    node.meta[_WINDOW] = w


# --- the program ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Program:
    """One signature's step, from tracing to running.

    Made with `traced`, `mesh`, the boundary layouts, `donated` and `transforms`; then filled in
    order by the pipeline (`ndfunc._src.pipeline.PASSES`): `plan` by partitioning, `local` by lowering
    (then rewritten by passes and transforms), `donation` by the donation pass, `runs` by the
    backend passes.
    """

    name: str
    traced: Any  # ndfunc._src.trace.Traced: the global program
    mesh: Any  # ndfunc Mesh or AbstractMesh
    axes: tuple[int, ...]  # the mesh axes partitioned over (those of size > 1), by position
    sizes: tuple[int, ...]  # their sizes
    in_layouts: list[Layout]
    out_layouts: list[Layout | None]  # as requested (None: the partitioner's choice)
    donated: list[int]  # flat input leaves whose buffers outputs may reuse
    out_placements: list = dataclasses.field(default_factory=list)  # per result: asked, whole mesh, or None
    transforms: tuple = ()  # ndfunc._src.transforms.base.Transform, applied at the pipeline's hooks
    retrace: Callable[[], Any] | None = None  # the user's function again, on fake tensors (errors name its line)
    cluster: Any = None  # ndfunc.plan.Cluster the partitioner prices collectives on (None: this machine)
    plan: Any = None  # ndfunc._src.partition.planning.solve.Plan
    local: torch.fx.GraphModule | None = None  # what each rank runs, as partitioned (Lowered shows it)
    donation: dict = dataclasses.field(default_factory=dict)  # output leaf -> input leaf it reuses
    runs: torch.fx.GraphModule | None = None  # `local` as this backend and device run it (Compiled shows it)
    _meta_ready: bool = False

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The partitioned axes' names: entry `i` of every layout in the program is `axis_names[i]`'s."""
        return tuple(self.mesh.axis_names[i] for i in self.axes)

    def axis_position(self, name: str) -> int | None:
        """Where mesh axis `name` is in a layout; None for a size-1 (or absent) axis."""
        names = self.axis_names
        return names.index(name) if name in names else None

    def layout_of(self, placements: Sequence) -> Layout:
        """A whole-mesh placement list (DTensor's) as a layout of the partitioned axes."""
        return tuple(placements[i] for i in self.axes)

    def mesh_placements(self, layout: Layout, asked: Sequence | None = None) -> tuple:
        """A layout as whole-mesh placements; size-1 axes as `asked` (else replicated)."""
        placements = list(asked) if asked is not None else [Replicate()] * len(self.mesh.axis_names)
        for axis, placement in zip(self.axes, layout):
            placements[axis] = placement
        return tuple(placements)

    def ensure_meta(self, changed: bool = False) -> None:
        """Fill `meta['val']` of the local program (fake tensors at local shapes), once, or again
        if the program `changed` since. Running needs none of it; reading the program (text,
        costs, transforms) does."""
        if changed or not self._meta_ready:
            propagate_meta(self.local, self.local_inputs())
            self._meta_ready = True

    def local_inputs(self) -> list:
        """(local shape, dtype, device) of each local program input, `coords` last."""
        out = []
        device = torch.device("cpu")
        for spec, lay, node in zip(self.traced.in_specs, self.in_layouts, self._placeholders()):
            device = node.meta["val"].device
            out.append((local_shape(spec.shape, lay, self.sizes), spec.dtype, device))
        out.append(((len(self.sizes),), torch.int64, device))
        return out

    def _placeholders(self):
        return [n for n in self.traced.graph.nodes if n.op == "placeholder"]


def propagate_meta(gm: torch.fx.GraphModule, inputs: Sequence[tuple[tuple[int, ...], torch.dtype, torch.device]]) -> None:
    """Fill `meta['val']` of a local program with fake tensors of the local shapes `inputs`.

    Again on a program filled before, only what changed is run: a node whose op and arguments are
    the ones its `val` was found from (the same objects: a pass that rewires a node gives it new
    arguments), and whose inputs' shapes, dtypes and strides are as then, keeps its `val`. A pass
    that adds a few collectives to a 70B program then costs what they do, not another run of
    every op."""
    with simulation_paused():
        mode = gm.meta.get(_FAKE_MODE)
        if mode is None:
            mode = gm.meta[_FAKE_MODE] = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fakes = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in inputs]
        _Propagation(gm, mode).propagate_dont_convert_inputs(*fakes)


_FAKE_MODE = "ndfunc_fake_mode"  # gm.meta: the mode every `val` of the program was made in
_FOUND_FROM = "ndfunc_val_from"  # node.meta: (op, args, kwargs) its `val` was found from


class _Propagation(FakeTensorProp):
    """`FakeTensorProp` that keeps the `val` of a node nothing it reads has changed for."""

    def __init__(self, gm: torch.fx.GraphModule, mode):
        super().__init__(gm, mode)
        self.changed: set = set()  # nodes whose `val` is not what it was
        self.made: dict = {}  # (op, arguments' metadata) -> the `val` it made

    def run_node(self, n: torch.fx.Node) -> Any:
        old = n.meta.get("val")
        found_from = n.meta.get(_FOUND_FROM)
        if (n.op not in ("placeholder", "output") and old is not None and found_from is not None
                and found_from[0] is n.target and found_from[1] is n.args and found_from[2] is n.kwargs
                and not any(a in self.changed for a in n.all_input_nodes)):
            return old
        # the layers of a model repeat their ops on values like the last layer's: each is run once
        key = _op_key(n) if n.op == "call_function" else None
        known = self.made.get(key) if key is not None else None
        if known is not None:
            n.meta["val"] = result = known
        else:
            result = super().run_node(n)
            if key is not None and _plain(n.meta.get("val")):
                self.made[key] = n.meta["val"]
        n.meta[_FOUND_FROM] = (n.target, n.args, n.kwargs)
        if not _same_meta(old, n.meta.get("val")):
            self.changed.add(n)
        return result


def _op_key(n: torch.fx.Node) -> tuple | None:
    """What an op's result metadata depends on: the op, its inputs' metadata and its other
    arguments (typed: 2 and 2.0 promote differently); None where an argument cannot be keyed."""
    def key(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor) or a.op == "get_attr":
                raise _Unkeyed
            return (v.shape, v.dtype, v.stride(), v.device)
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, *map(key, a))
        if isinstance(a, dict):
            return tuple((k, key(x)) for k, x in a.items())
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return (type(a).__name__, a)
        raise _Unkeyed
    try:
        return (n.target, key(n.args), key(n.kwargs))
    except _Unkeyed:
        return None


class _Unkeyed(Exception):
    pass


def _plain(val) -> bool:
    """A result of fixed-size tensors (no symbolic sizes), which any op like it would make."""
    if isinstance(val, torch.Tensor):
        return not any(isinstance(d, torch.SymInt) for d in (*val.shape, *val.stride()))
    if isinstance(val, (tuple, list)):
        return bool(val) and all(map(_plain, val))
    return False


def _same_meta(a, b) -> bool:
    """Whether two `val`s describe the same values (shape, dtype, strides, device), fake or not."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and a.device == b.device
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same_meta, a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and a == b
