"""`nf.fsdp`: when FSDP's gathers happen, as a pass over the lowered program.

The partitioner already turns a parameter stored sharded over an axis into an all-gather before
its use and its gradient into a reduce-scatter. What it does not decide is *when*: its program
gathers each parameter once and keeps the whole of it alive from the forward use to the backward
one, so every layer's gathered weights are held at once. This pass makes that FSDP2's schedule,
for every gather of a stored shard as sent (through views and copies, `nf.mixed_precision`'s cast,
which the partitioner places before the gather as FSDP2 does, and an all-to-all that moves the
shard to another dim), over this transform's axes and over any others the parameter is split over
too (`nf.fsdp('dp_shard')` under rules that shard over `('dp_shard', 'cp')`: one chain):

- reshard after forward: a gathered parameter whose uses fall in two groups, with other layers'
  parameters gathered in between (a layer's forward, then, much later, its backward), is gathered
  again just before the second group, so the first copy dies after forward (with prefetch, not
  the last block: its backward gather would be issued where its forward ends);
- prefetch: a layer's all-gathers start where the layer `prefetch` places earlier first reads
  its gathered parameters (each waited for at its own first use), so the transfers overlap that
  layer's compute; a chain's gathers (over tp, then dp_shard: a weight the partitioner runs whole
  over both) a layer apart, the last there, each one before it a layer earlier;
- reduce_dtype: gradients are reduce-scattered in that dtype (cast before, cast back after);
- buckets: the gathers of one layer's parameters (those whose paths agree up to the last list
  index, `layers.3.`, as FSDP2 wraps each block) issued one after another become one all-gather
  of their shards laid end to end; the gradient reduce-scatters of one layer's backward (between
  where backward first reads two layers' gathered parameters) one reduce-scatter; up to
  `bucket_bytes` each. A collective's fixed cost is paid once per layer, not once per parameter;
- reductions in flight: each bucketed reduce-scatter may be waited for as late as the step's peak
  memory allows (placed after the memory passes, so the peak it keeps is the one that runs).

This pass moves no start and no wait itself: it declares each gather's and reduce-scatter's
`schedule.Window` (where it may start, where it is waited for) and asks the collective scheduler,
`ndfunc._src.partition.passes.schedule`, to place them.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator

import torch

from ndfunc._src import cast_ops, view_ops
from ndfunc._src.partition import program as prog
from ndfunc._src.partition.passes import bucket, schedule
from ndfunc._src.partition.passes.schedule import Start, Wait, Window
from ndfunc._src.transforms.base import Transform
from ndfunc._src.transforms.reduce import reduce_in

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_LAYER_STARTS = "ndfunc_fsdp_layer_starts"  # this pass's own mark: where a kept layer's backward starts


@dataclasses.dataclass(frozen=True)
class fsdp(Transform):  # noqa: N801 - a transform is named like the function it stands for
    """FSDP's gather schedule for parameters stored sharded over `axis` (a name or a tuple).

    Use: `nf.jit(train_step, mesh=mesh, in_shardings=..., transforms=[nf.fsdp('dp_shard')])`.
    """

    axis: str | tuple[str, ...]
    reshard_after_forward: bool = True
    prefetch: int = 1
    reduce_dtype: torch.dtype | None = None
    bucket_bytes: int = 8 * 2**20  # gathers (and gradient reduce-scatters) issued together, up to this many bytes

    def __post_init__(self):
        if not (isinstance(self.axis, str) or (isinstance(self.axis, tuple) and self.axis
                                               and all(isinstance(a, str) for a in self.axis))):
            raise TypeError(f"nf.fsdp: axis is a mesh axis name or a tuple of them (e.g. 'dp_shard' or "
                            f"('dp_shard', 'cp')), got {self.axis!r}.")
        if self.prefetch < 0:
            raise ValueError(f"nf.fsdp: prefetch is a number of layers >= 0, got {self.prefetch}.")

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)

    def axes_used(self) -> tuple[str, ...]:
        return self.axes

    def _gathers(self, gm) -> list:
        """The program's gathers of parameters stored sharded over this transform's axes, over
        other axes too (`nf.fsdp('dp_shard')` where the rules shard over `('dp_shard', 'cp')`):
        each is one chain, gathered again whole."""
        return [g for g in _parameter_gathers(gm) if set(g.comm.axes) & set(self.axes)]

    def lowered(self, program) -> None:
        gm = program.local
        gathers = self._gathers(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        module = _modules(placeholders, program.traced.input_paths)
        kept_gathered = []  # (where a layer's backward reads a parameter it did not gather again, layer)
        if self.reshard_after_forward:
            # decide per parameter first, then insert only the gathers that free something
            index = {n: i for i, n in enumerate(gm.graph.nodes)}
            firsts = _first_reads(gathers, index, module)
            cuts = [(g, cut) for g in gathers if (cut := _second_use(g, index, firsts, g.layer(module))) is not None]
            if self.prefetch > 0:
                worth = _frees_something(gm, cuts, index, module, self._gathers(gm), self.prefetch)
            else:
                worth = [True] * len(cuts)
            for (g, cut), regather in zip(cuts, worth):
                if regather:
                    _regather(gm, g, cut, index)
                else:
                    kept_gathered.append((cut, g.layer(module)))
            _mark_layer_starts(kept_gathered, index)
        if self.prefetch > 0:
            _prefetch(gm, self._gathers(gm), self.prefetch, module, also=kept_gathered)
            schedule.schedule(gm)
        if self.reduce_dtype is not None:
            reduce_in(gm, self.reduce_dtype, self.axes, kinds=(c10d.reduce_scatter_tensor.default,))
        if self.bucket_bytes:
            _bucket_gathers(gm, self._gathers(gm), self.bucket_bytes, module)
            _bucket_reduce_scatters(gm, self.axes, self.bucket_bytes)
            for rs in _reduce_scatters_over(gm, self.axes):  # in flight as long as the peak allows
                prog.set_window(rs, dataclasses.replace(schedule.window_of(rs), wait=Wait.PEAK))
            schedule.schedule(gm)  # the buckets are new collectives
        gm.graph.lint()
        gm.recompile()


@dataclasses.dataclass
class _Gather:
    start: torch.fx.Node  # all_gather_into_tensor
    chain: list  # start .. value: the nodes that make the gathered value
    value: torch.fx.Node  # what the program reads

    def layer(self, module: dict) -> str | None:
        """The layer (`_modules`) of the parameter gathered."""
        return module.get(_source(self.start.args[0]))

    @property
    def comm(self) -> prog.Comm:
        """The first gather's; over several axes (`('dp_shard', 'cp')`), their axes together."""
        starts = [n for n in self.chain if n.target is c10d.all_gather_into_tensor.default]
        return dataclasses.replace(prog.comm(self.start), axes=tuple(a for s in starts for a in prog.comm(s).axes))


def _parameter_gathers(gm: torch.fx.GraphModule) -> list[_Gather]:
    """All-gathers of program inputs (through views), with the nodes that finish them (a gather
    over several axes is one per axis, each reading the last, through the views and copies that
    lay it out for the next: one chain)."""
    found = []
    for start in gm.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default):
        if _source(start.args[0]).op != "placeholder" or prog.comm(start) is None:
            continue
        chain = [start]
        value = _finish(start, chain)
        while True:
            laid_out, user = [], _only_user(value)
            while user is not None and user.target in view_ops.SAME_ELEMENTS:
                laid_out.append(user)
                user = _only_user(user)
            if user is None or user.target is not c10d.all_gather_into_tensor.default or prog.comm(user) is None:
                break
            chain += [*laid_out, user]  # the gather over the next axis
            value = _finish(user, chain)
        found.append(_Gather(start, chain, value))
    return found


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


_OFF_DIM_0 = (aten.view.default, aten.permute.default, aten.clone.default, aten.view.default)


def _finish(gather: torch.fx.Node, chain: list) -> torch.fx.Node:
    """Follow `gather` to the whole value: its wait, then (a gather off dim 0) the blocks put
    along their dim as the lowering writes it (`_OFF_DIM_0`: a view, a permute, the copy, a view);
    append them to `chain` and return the last."""
    value = _only_user(gather)
    assert value is not None and value.target is c10d.wait_tensor.default, value
    chain.append(value)
    follow, user = [], value
    for op in _OFF_DIM_0:
        user = _only_user(user)
        if user is None or user.target is not op:
            return value
        follow.append(user)
    chain += follow
    return follow[-1]


def _first_reads(gathers: list[_Gather], index: dict, module: dict) -> list[tuple]:
    """(where the program first reads it, its layer) of each gathered parameter, in program order."""
    return sorted((index[min(g.value.users, key=index.__getitem__)], g.layer(module)) for g in gathers if g.value.users)


def _second_use(g: _Gather, index: dict, firsts: list[tuple], layer: str | None) -> torch.fx.Node | None:
    """The first use of `g`'s gathered value that follows another layer's first use (its
    backward, after the later layers' forward), where a gather again would serve the rest; None:
    one group of uses. `index`: the program order; `firsts`: (first use, layer) of each parameter
    gather; `layer`: g's."""
    uses = sorted(g.value.users, key=index.__getitem__)
    if len(uses) < 2:
        return None
    # split where other layers' parameters are first used in between: forward, then backward
    cut, first = None, operator.itemgetter(0)
    for a, b in zip(uses, uses[1:]):
        lo, hi = (bisect.bisect_right(firsts, index[a], key=first), bisect.bisect_left(firsts, index[b], key=first))
        if any(other != layer for _, other in firsts[lo:hi]):
            cut = b
            break
    return cut


def _regather(gm, g: _Gather, cut: torch.fx.Node, index: dict) -> None:
    """Gather `g` again just before `cut`: its uses from there on read the new copy (copies of
    `g.chain`, and of what makes the parameter as sent for this gather alone: a shard cast for the
    gather is cast again, as FSDP2 does, not kept from forward to backward). `index`: the program
    order before any copy."""
    later = [u for u in g.value.users if index[u] >= index[cut]]
    sent = _views_of_source(g.start.args[0])
    shared = [i for i, n in enumerate(sent) if len(n.users) > 1]  # alive anyway: read from there on
    sent = sent[shared[-1] + 1:] if shared else sent
    env: dict = {}
    with gm.graph.inserting_before(cut):
        for n in [*sent, *g.chain]:
            env[n] = gm.graph.node_copy(n, lambda a: env.get(a, a))
    for u in later:
        u.replace_input_with(g.value, env[g.value])


def _frees_something(gm, cuts: list, index: dict, module: dict, gathers: list, k: int) -> list[bool]:
    """Per (gather, second use) of `cuts`: whether gathering it again there, prefetched `k` layers
    ahead, frees anything - whether some other layer's parameters are first read between its last
    forward use and where that gather would be issued. The last block's would not be: with
    prefetch its backward gather is issued at the head, where its forward ends (torchtitan leaves
    it gathered); without prefetch every one frees. Decided on the program as it is, before
    anything is inserted: the layers as `_prefetch` would see them with every gather again."""
    layer = {id(g): g.layer(module) for g in gathers}
    # first reads in program order: each gather's, and each second use's (a gather again)
    entries = [(min(g.value.users, key=index.__getitem__), layer[id(g)]) for g in gathers if g.value.users]
    cut_layers = [g.layer(module) for g, _ in cuts]  # (asked once: each walks the parameter's views)
    entries += [(cut, mine) for (_, cut), mine in zip(cuts, cut_layers)]
    anchors = {}  # second use -> the first read where its layer's gathers would be issued
    for i, run in enumerate(runs := _runs(entries, index)):
        for read, _ in run:
            anchors[read] = runs[max(i - k, 0)][0][0]
    firsts = _all_first_reads(gm, index, module) + [(index[cut], mine) for (_, cut), mine in zip(cuts, cut_layers)]
    worth = []
    for (g, cut), mine in zip(cuts, cut_layers):
        issued = anchors[cut] if index[anchors[cut]] < index[cut] else cut
        freed = max(index[u] for u in g.value.users if index[u] < index[cut])
        worth.append(any(other != mine and freed < i < index[issued] for i, other in firsts))
    return worth


def _all_first_reads(gm, index: dict, module: dict) -> list[tuple]:
    """(first read, layer) of every gathered parameter, over any axes."""
    return _first_reads(_parameter_gathers(gm), index, module)


def _runs(entries: list[tuple], index: dict) -> list[list[tuple]]:
    """(first read, layer) entries in program order, in runs of one layer: a block's forward, and
    later (gathered again) its backward."""
    runs: list[list[tuple]] = []
    for read, layer in sorted(entries, key=lambda e: index[e[0]]):
        if runs and layer == runs[-1][0][1]:
            runs[-1].append((read, layer))
        else:
            runs.append([(read, layer)])
    return runs


def _mark_layer_starts(kept: list[tuple], index: dict) -> None:
    """Where the backward of each layer kept gathered starts (its first read there), as a
    gather's wait would say: reduce-scatter buckets end there."""
    first: dict = {}
    for read, layer in kept:
        if layer not in first or index[read] < index[first[layer]]:
            first[layer] = read
    for read in first.values():
        read.meta[_LAYER_STARTS] = True


def _prefetch(gm, gathers: list[_Gather], k: int, module: dict, also: list[tuple] = ()) -> None:
    """Let each layer's gathers start where the layer `k` places earlier first reads its gathered
    parameters, each waited for where its own layer reads it (`schedule` moves them). A layer here
    is a run of gathers of one module's parameters, in the order the program first reads them: a
    block's forward, and later (resharded) its backward. `also`: (first read, layer) of backward
    runs that read a parameter kept gathered, which count as runs too."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = [(min(g.value.users, key=index.__getitem__), g.layer(module), g) for g in gathers if g.value.users]
    first += [(read, layer, None) for read, layer in also]
    layers: list[list[tuple]] = []  # (first read, gather or None) of each layer
    for read, name, g in sorted(first, key=lambda f: index[f[0]]):
        if layers and name == layers[-1][0][2]:
            layers[-1].append((read, g, name))
        else:
            layers.append([(read, g, name)])
    for i, layer in enumerate(layers):
        for _, g, _ in layer:
            if g is None:
                continue
            # a gather over several axes (a weight stored split over dp_shard and gathered over tp
            # too, or over dp_shard and cp) is a pipeline of stages, each reading the last: the
            # last starts where layer i - k is first read, each one before it a layer earlier, so
            # that stage's wait (before the next stage starts) finds it done. The first k layers'
            # start, in order, where the first is first read.
            stages = [n for n in g.chain if n.target is c10d.all_gather_into_tensor.default]
            for s, stage in enumerate(stages):
                anchor = layers[max(i - k - (len(stages) - 1 - s), 0)][0][0]
                prog.set_window(stage, Window(Start.EARLY, Wait.READ, after=anchor))


def _modules(placeholders: list, paths: list[str]) -> dict:
    """The layer each parameter belongs to, as FSDP2 wraps them: its path up to the last list
    index (`0.layers.3`); beside a list of blocks, the root of its argument (`0`: the embedding,
    the final norm and the head); in an argument with no list of blocks (`{'w0': .., 'w1': ..}`),
    the parameter on its own."""
    cuts = [max((i for i, p in enumerate(path.split(".")[1:], 1) if p.isdigit()), default=0) for path in paths]
    blocks = {path.split(".")[0] for path, cut in zip(paths, cuts) if cut}
    return {ph: ".".join(path.split(".")[:cut + 1]) if cut or path.split(".")[0] in blocks else path
            for ph, path, cut in zip(placeholders, paths, cuts)}


def _views_of_source(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The views, copies, casts and all-to-alls from `_source(node)` to `node`, in program order."""
    chain = []
    while node.op == "call_function" and (node.target in view_ops.SAME_ELEMENTS or _is_cast(node)
                                          or _is_all_to_all(node)):
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def _is_all_to_all(node: torch.fx.Node) -> bool:
    """An all-to-all, or its wait: a stored shard moved to another dim on the way to its gather
    (a weight the partitioner splits over one axis by columns, over another by rows), which keeps
    its size."""
    if node.target is c10d.wait_tensor.default:
        node = node.args[0]
    return node.target is c10d.all_to_all_single.default


def _is_cast(node: torch.fx.Node) -> bool:
    """A change of dtype only: `nf.mixed_precision`'s cast of a stored parameter, which the
    partitioner places before its gather (the gather then moves half the bytes), as FSDP2 does."""
    return cast_ops.dtype_only(node)


def _source(node: torch.fx.Node) -> torch.fx.Node:
    """What `node` is a view, copy, cast or all-to-all of (a parameter, read through an einsum's
    permutes, cast to the compute dtype, moved to another dim)."""
    views = _views_of_source(node)
    return views[0].args[0] if views else node


def _bucket_gathers(gm, gathers: list[_Gather], cap: int, module: dict) -> None:
    """Gathers of one layer's parameters issued one after another (same group and dtype) become
    one: issued where the first was (prefetch placed it), its pieces cut out where the first was
    waited for."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    members = []
    for g in gathers:
        if not g.value.users:
            continue
        made = [index[a] for a in g.start.all_input_nodes if _source(a).op != "placeholder"]
        members.append(bucket.Member(
            g.start, g.chain[1], (g.start.args[1], g.start.args[2], prog.comm(g.start).dtype, g.layer(module)),
            max(made, default=-1), index[g.chain[1]], g.comm.bytes, tuple(_views_of_source(g.start.args[0]))))
    for b in bucket.plan(members, cap, index, at_first=True):
        # a layer's parameters: _bucket_reduce_scatters' boundary
        bucket.merge(gm, b, bucket.ALL_GATHER, nodes, index, at_first=True, parameters=True)


def _bucket_reduce_scatters(gm, axes: tuple[str, ...], cap: int) -> None:
    """Reduce-scatters over `axes` (same group and dtype) of one layer's backward become one,
    issued right after the last input is made, its results cut out where first read (the
    scheduler places its wait). Over several axes, one group at
    a time, in the order the program reduces over them: a reduction over the second reads the
    first's results, which bucketing moves."""
    found = _reduce_scatters_over(gm, axes)
    for name in dict.fromkeys(rs.args[3] for rs in found):
        _bucket_reduce_scatters_over(gm, [rs for rs in found if rs.args[3] == name], cap)


def _reduce_scatters_over(gm, axes: tuple[str, ...]) -> list:
    """The program's reduce-scatters over (some of) `axes`, each with its one wait."""
    return [rs for rs in gm.graph.find_nodes(op="call_function", target=c10d.reduce_scatter_tensor.default)
            if (c := prog.comm(rs)) is not None and set(c.axes) <= set(axes) and len(rs.users) == 1]


def _bucket_reduce_scatters_over(gm, found: list, cap: int) -> None:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    # a layer's backward starts where gathered parameters are waited for (issued earlier, with
    # prefetch), or a layer kept gathered is first read again: buckets do not cross one
    gathers = gm.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    starts = sorted([index[w] for n in gathers
                     if _source(n.args[0]).op == "placeholder" or getattr(prog.comm(n), "parameters", False)
                     for w in n.users] + [i for i, n in enumerate(nodes) if n.meta.get(_LAYER_STARTS)])
    members = []
    for rs in found:
        (wait,) = rs.users
        if not wait.users:
            continue
        ready = index[rs.args[0]]
        members.append(bucket.Member(rs, wait, (*rs.args[1:], prog.comm(rs).dtype, bisect.bisect(starts, ready)),
                                     ready, min(index[u] for u in wait.users), prog.comm(rs).bytes))
    for b in bucket.plan(members, cap, index):
        bucket.merge(gm, b, bucket.REDUCE_SCATTER, nodes, index)
