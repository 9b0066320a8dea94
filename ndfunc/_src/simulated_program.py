"""A local program run for every simulated rank at once: each op called on plain tensors, rank by
rank, and each collective computed from the ranks' blocks - as `LocalTensorMode` does, without its
dispatch per op.

Under `nf.simulate(n)` a compiled step could run as any torch code does there: every op goes
through the simulated-tensor mode, which unwraps the ranks' tensors, calls the op once per rank and
wraps the results again - a cost per op far above the op itself for the small blocks of a
simulated step. A compiled step is a known fx program, so `rank_program(gm, ranks)` writes it again
as Python in which each line is the op over the ranks' values, a list per value:

    mm = [_op_aten_mm_default(x, w) for x, w in zip(v_x, v_w)]

and each collective one call over those lists, with the mode's arithmetic: its groups, its
reduction in rank order, its concatenations. So the results are the mode's, bit for bit, and the cost is
the ops' own plus a list comprehension per op. What this does not run (a random op, whose draws
the mode keeps per rank; a collective it does not know) makes `rank_program` return None, and the
step runs through the mode as before.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx

from ndfunc._src.partition.backends.cpu_kernels import KERNELS
from ndfunc._src.torch_compat import (
    LocalTensor,
    local_blocks,
    local_reduce,
    process_group_ranks,
)

c10d = torch.ops._c10d_functional

_SCALARS = (int, bool, str, type(None))
_PER_RANK = frozenset({operator.getitem, *KERNELS})  # Python functions of one rank's values


def rank_program(gm: torch.fx.GraphModule, ranks: Sequence[int]) -> Callable | None:
    """`gm` (a local program) as a function of per-rank inputs (a list of tensors, one per rank,
    for each placeholder) returning per-rank outputs; None if it holds something only the
    simulated-tensor mode runs."""
    ranks = tuple(ranks)
    writer = _Writer(ranks)
    try:
        src = writer.write(gm.graph, gm)
    except _Unsupported:
        return None
    scope = dict(writer.globals)
    exec(compile(src, f"<ndfunc ranks program {id(gm):x}>", "exec"), scope)
    return scope["run"]


def run_on_ranks(program: Callable, ranks: Sequence[int], args: Sequence, fresh: Sequence[int] = ()) -> list:
    """Call `program` on the simulated ranks' blocks of `args` (LocalTensors, or plain values
    every rank shares); the results as LocalTensors, those at `fresh` as new tensor objects over
    the same memory (a result written into a donated argument: the argument's object is retired)."""
    per_rank = []
    for x in args:
        if isinstance(x, LocalTensor):
            blocks = local_blocks(x)
            per_rank.append([blocks[r] for r in ranks])
        else:
            per_rank.append([x] * len(ranks))
    outs = list(program(*per_rank))
    for j in fresh:
        outs[j] = [t.detach() for t in outs[j]]
    return [LocalTensor(dict(zip(ranks, o))) if isinstance(o, list) else o for o in outs]


def _blocks(ranks: tuple[int, ...], x):
    """The ranks' values of `x` (a LocalTensor, or a tuple of them: per rank, a tuple)."""
    if isinstance(x, (tuple, list)):
        return list(zip(*(_blocks(ranks, e) for e in x)))
    blocks = local_blocks(x)
    return [blocks[r] for r in ranks]


class _Unsupported(Exception):
    pass


class _Writer:
    def __init__(self, ranks: tuple[int, ...]):
        self.ranks = ranks
        self.globals: dict = {"_ranks": ranks, "_collective": _COLLECTIVES,
                              "_lt": lambda values: LocalTensor(dict(zip(ranks, values))),
                              "_blocks": functools.partial(_blocks, ranks)}
        self._ids: dict = {}
        self.helpers: list[str] = []  # the module's functions of one rank's values (`_call`)

    def constant(self, value) -> str:
        key = (type(value), id(value))
        name = self._ids.get(key)
        if name is None:
            name = self._ids[key] = f"_c{len(self._ids)}"
            self.globals[name] = value
        return name

    def write(self, graph: torch.fx.Graph, gm: torch.fx.GraphModule) -> str:
        nodes = list(graph.nodes)
        names = {n: f"v{i}" for i, n in enumerate(nodes)}
        last_use: dict = {}
        for n in nodes:
            for a in n.all_input_nodes:
                last_use[a] = n
        dies: dict = {}
        for value, user in last_use.items():
            dies.setdefault(user, []).append(names[value])
        params = [names[n] for n in nodes if n.op == "placeholder"]
        lines = [f"def run({', '.join(params)}):", "    _groups = {}"]
        for n in nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                lines.append(f"    return {self._render(n.args[0], names)}")
                continue
            if n.op == "get_attr":
                value = functools.reduce(getattr, n.target.split("."), gm)
                lines.append(f"    {names[n]} = [{self.constant(value)}] * {len(self.ranks)}")
            elif n.op == "call_function":
                lines.append(f"    {names[n]} = {self._call(n, names)}")
            else:
                raise _Unsupported(n.op)
            gone = [v for v in dies.get(n, []) if v != names[n]]
            if gone:
                lines.append(f"    del {', '.join(gone)}")
        return "".join(self.helpers) + "\n".join(lines) + "\n"

    def _call(self, n: torch.fx.Node, names: dict) -> str:
        target = n.target
        if isinstance(target, torch._ops.OpOverload):
            if target.namespace in ("_c10d_functional", "_dtensor", "c10d"):
                return self._collective(n, names)
            if torch.Tag.nondeterministic_seeded in target.tags:
                raise _Unsupported(target)  # its draws are per rank in the mode
            fn = self.constant(target._op)
        elif getattr(target, "across_ranks", False):
            return self._across_ranks(n, names)
        elif target in _PER_RANK:
            fn = self.constant(target)
        else:
            raise _Unsupported(target)  # a Python function this does not know: it may read the ranks
        refs = list(dict.fromkeys(n.all_input_nodes))
        local = {r: f"a{i}" for i, r in enumerate(refs)}
        args = ", ".join([self._render(a, local) for a in n.args]
                         + [f"{k}={self._render(v, local)}" for k, v in n.kwargs.items()])
        # the op on one rank's values is a function of the module, mapped over the ranks: a
        # comprehension per line would nest a scope per op in `run`, which CPython < 3.12 compiles
        # in time quadratic in their number (20,000 ops: 20 s, against 0.7 s so)
        per_rank = f"_r{len(self.helpers)}"
        params = ", ".join(local[r] for r in refs) or "_"  # (no input: each rank makes its own)
        self.helpers.append(f"def {per_rank}({params}):\n    return {fn}({args})\n")
        return f"list(map({per_rank}, {', '.join(names[r] for r in refs) or '_ranks'}))"

    def _across_ranks(self, n: torch.fx.Node, names: dict) -> str:
        """A function marked `point_to_point.across_ranks`: one call over every rank's blocks as
        LocalTensors (the form it takes them in), its result the ranks' blocks again."""
        wrapped = {r: f"_lt({names[r]})" for r in n.all_input_nodes}
        args = ", ".join([self._render(a, wrapped) for a in n.args]
                         + [f"{k}={self._render(v, wrapped)}" for k, v in n.kwargs.items()])
        return f"_blocks({self.constant(n.target)}({args}))"

    def _collective(self, n: torch.fx.Node, names: dict) -> str:
        if n.target is c10d.wait_tensor.default:  # the collectives below complete when called
            return names[n.args[0]]
        if n.target not in _COLLECTIVES or n.kwargs or any(isinstance(a, torch.fx.Node) for a in n.args[1:]):
            raise _Unsupported(n.target)  # as the lowering writes them: a tensor, then constants, the group last
        rest = ", ".join(self._render(a, {}) for a in n.args[1:])
        return f"_collective[{self.constant(n.target)}]({names[n.args[0]]}, _ranks, _groups, {rest})"

    def _render(self, a, names: dict) -> str:
        if isinstance(a, torch.fx.Node):
            return names[a]
        if isinstance(a, list):
            return "[" + ", ".join(self._render(x, names) for x in a) + "]"
        if isinstance(a, tuple):
            return "(" + "".join(self._render(x, names) + ", " for x in a) + ")"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {self._render(v, names)}" for k, v in a.items()) + "}"
        if isinstance(a, _SCALARS):
            return repr(a)
        return self.constant(a)


# --- collectives over the ranks' blocks --------------------------------------------------------
# Each takes the ranks' values (a list in rank order), the run's table of groups and the op's own
# arguments, and returns the ranks' results: the mode's arithmetic (`_local_tensor._c10d`), on lists.

def _groups(table: dict, group_name: str, ranks: tuple[int, ...]) -> list[list[int]]:
    """The groups `group_name` stands for, as positions into `ranks` (one group per offset, as the
    mode forms them); looked up once per run (a name may mean other ranks in another simulation)."""
    found = table.get(group_name)
    if found is None:
        members, offsets = process_group_ranks(group_name)
        position = {r: i for i, r in enumerate(ranks)}
        found = table[group_name] = [[position[o + r] for r in members] for o in offsets]
    return found


def _over_groups(collective: Callable) -> Callable:
    """`collective(values of one group, *its arguments) -> that group's results`, run for each
    group `group_name` (its last argument) stands for."""

    def call(values: list, ranks, table, *args) -> list:
        out = [None] * len(values)
        for group in _groups(table, args[-1], ranks):
            for i, result in zip(group, collective([values[i] for i in group], *args[:-1]), strict=True):
                out[i] = result
        return out

    return call


@_over_groups
def _all_reduce(values: list, reduce_op: str) -> list:
    reduced = local_reduce(reduce_op, values)
    return [torch.empty_like(v).copy_(reduced) for v in values]


@_over_groups
def _all_gather(values: list, group_size: int) -> list:
    gathered = torch.cat(values)
    return [gathered.clone() for _ in values]


@_over_groups
def _reduce_scatter(values: list, reduce_op: str, group_size: int) -> list:
    reduced = local_reduce(reduce_op, values)
    return [block.clone() for block in torch.tensor_split(reduced, len(values))]  # (one per rank: empty ones too)


@_over_groups
def _all_to_all(values: list, output_split_sizes, input_split_sizes) -> list:
    pieces = [torch.split(v, list(input_split_sizes)) for v in values]
    return [torch.cat([p[k] for p in pieces]) for k in range(len(values))]


@_over_groups
def _shard_dim_alltoall(values: list, gather_dim: int, shard_dim: int) -> list:
    gathered = torch.cat(values, dim=gather_dim)
    return [block.clone() for block in torch.split(gathered, gathered.size(shard_dim) // len(values), dim=shard_dim)]


_COLLECTIVES = {
    c10d.all_reduce.default: _all_reduce,
    c10d.all_gather_into_tensor.default: _all_gather,
    c10d.reduce_scatter_tensor.default: _reduce_scatter,
    c10d.all_to_all_single.default: _all_to_all,
    torch.ops._dtensor.shard_dim_alltoall.default: _shard_dim_alltoall,
}
