"""What a rank's memory holds, by kind: the figures the closed forms of FSDP, TP, HSDP and CP give
(parameters, optimizer state, gradients, gathered parameters, activations), read from the local
program.

Every buffer of the local program is given a kind by the node that makes it:

- `arguments`: the step's inputs (each rank's blocks), by argument;
- `gathered`: an all-gather of a stored input (through views and casts), and what is made of it
  without a traced op of its own (its wait, the lowering's reshapes): FSDP's gathered units;
- `activations`: made by a differentiated function's forward (`nf.value_and_grad` marks its ops
  when traced), or by a collective moving such a value;
- `backward`: made by its backward (recomputed forward ops included);
- `other`: the rest (the optimizer, the step's own ops, constants).

A collective, its wait and the reshapes the lowering adds carry no op of the user's: they take the
kind of what they move. `gradients` are the `backward` buffers that the rest of the step (the
optimizer) or its results read: the gradients as each rank holds them once reduced (or, where the
partitioner moved a linear op of the optimizer, a scale, ahead of the reduction, the pending sum
that op reads).
"""

from __future__ import annotations

import dataclasses

import torch

from ndfunc._src import cast_ops, view_ops
from ndfunc._src.autodiff import DIFFERENTIATED, FORWARD
from ndfunc._src.buffers import lifetimes
from ndfunc._src.partition import program as prog

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_KINDS = ("arguments", "gathered", "activations", "backward", "other")
# ops that leave a stored input what it is: a view, a copy, a cast
_PASS_THROUGH = view_ops.SAME_ELEMENTS | frozenset(cast_ops.CASTS)


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Per rank, in bytes: `arguments` (each argument's blocks, by its position or keyword: a train
    step's parameters, optimizer state, batch), `gradients` (as the optimizer first reads them:
    reduced, see the module), `gathered` (the most bytes of gathered parameters alive at once:
    FSDP's units, prefetch included), `activations` (what the forward keeps for the backward: alive
    when the last of its ops that makes a buffer is done), `at_peak` (what is alive at the peak,
    by kind; it adds up to the peak), and `live`: the same by kind at every op (`LiveBytes`)."""

    arguments: dict[str, int]
    gradients: int
    gathered: int
    activations: int
    at_peak: dict[str, int]
    live: LiveBytes | None = dataclasses.field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        args = ", ".join(f"{k}: {gib(v)}" for k, v in self.arguments.items())
        peak = ", ".join(f"{k} {gib(v)}" for k, v in self.at_peak.items() if v)
        return (f"arguments ({args}), gradients {gib(self.gradients)}, gathered at most {gib(self.gathered)} "
                f"at once, activations kept for backward {gib(self.activations)}; at the peak: {peak} per rank")


@dataclasses.dataclass(frozen=True)
class LiveBytes:
    """What a rank holds while each op of its program runs, by kind: `by_kind[k][i]` bytes of kind
    `k` alive while the program's `i`-th op runs (`ops[i]`, its node's name; the arguments alive
    from the start). `forward_ends`: the op after which what is alive of the forward is kept for
    the backward (None: no differentiated function)."""

    ops: tuple[str, ...]
    by_kind: dict[str, tuple[int, ...]]
    forward_ends: int | None

    def total(self) -> list[int]:
        """Bytes alive at each op, every kind."""
        return [sum(column) for column in zip(*self.by_kind.values())]


def breakdown(program, gm: torch.fx.GraphModule) -> MemoryBreakdown:
    """`gm`'s memory by kind (`gm`: `program.local` or a rewrite of it, its metadata filled)."""
    nodes = list(gm.graph.nodes)
    kind = _kinds(nodes)
    root, last = lifetimes(nodes)
    sizes = {r: value_bytes(r.meta.get("val")) for r in set(root.values())}
    index = {n: i for i, n in enumerate(nodes)}

    change = {k: [0] * (len(nodes) + 2) for k in _KINDS}
    for r, size in sizes.items():
        change[kind[r]][index[r]] += size
        change[kind[r]][last[r] + 1] -= size
    live = {k: _running(change[k], len(nodes)) for k in _KINDS}
    totals = [sum(live[k][i] for k in _KINDS) for i in range(len(nodes))]
    peak = max(range(len(nodes)), key=totals.__getitem__, default=0)

    placeholders = [n for n in nodes if n.op == "placeholder"][:-1]  # coords last: not an argument
    arguments: dict[str, int] = {}
    for node, path in zip(placeholders, program.traced.input_paths):
        name = path.split(".", 1)[0]
        arguments[name] = arguments.get(name, 0) + value_bytes(node.meta.get("val"))

    read_after = {root[n] for n in nodes if n.op != "output" and kind.get(root.get(n)) == "backward"
                  and any(_reads_as_rest(u, kind) for u in n.users)}
    # the forward's last op that makes a buffer: what of it is alive after is kept for the backward
    # (or returned). Not its last op: a view of a forward value can run after the backward has
    # begun (nf.fsdp's programs read them where the backward does), and makes no buffer
    forward_ends = max((i for i, n in enumerate(nodes) if kind.get(n) == "activations"
                        and prog.marks(n) is not None and root.get(n) is n), default=None)
    kept_from = len(nodes) - 2 if forward_ends is None else forward_ends
    return MemoryBreakdown(
        arguments=arguments,
        gradients=sum(sizes[r] for r in read_after),
        gathered=max(live["gathered"], default=0),
        activations=live["activations"][kept_from + 1] if nodes else 0,
        at_peak={k: live[k][peak] for k in _KINDS} if nodes else dict.fromkeys(_KINDS, 0),
        live=_over_ops(nodes, live, forward_ends),
    )


def _over_ops(nodes: list[torch.fx.Node], live: dict[str, list[int]], forward_ends: int | None) -> LiveBytes:
    """`live` (by kind, at each node) at the ops only: not the inputs coming alive one by one."""
    ops = [i for i, n in enumerate(nodes) if n.op == "call_function"]
    return LiveBytes(tuple(nodes[i].name for i in ops), {k: tuple(v[i] for i in ops) for k, v in live.items()},
                     None if forward_ends is None else ops.index(forward_ends))


def _kinds(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, str]:
    kind: dict[torch.fx.Node, str] = {}
    for n in nodes:
        if n.op == "placeholder":
            kind[n] = "arguments"
        elif n.op != "call_function":
            kind[n] = "other"  # constants, and the output node (which makes no buffer)
        elif (marks := prog.marks(n)) is not None:  # lowered from a traced op
            kind[n] = ("activations" if marks.get(FORWARD) else "backward" if marks.get(DIFFERENTIATED) else "other")
        elif n.target is _GATHER and _stored(n.args[0], kind):
            kind[n] = "gathered"
        else:  # added by the partitioner or a pass: what it moves or reshapes
            inputs = n.all_input_nodes
            kind[n] = kind.get(inputs[0], "other") if inputs else "other"
    return kind


def _stored(node: torch.fx.Node, kind: dict) -> bool:
    """Whether `node` is a step input, through views, copies and casts."""
    while node.op == "call_function" and node.target in _PASS_THROUGH:
        node = node.args[0]
    return kind.get(node) in ("arguments", "gathered")  # a gather over a second axis reads the first's


def _reads_as_rest(user: torch.fx.Node, kind: dict) -> bool:
    """Whether `user` is the step beyond the differentiated function (the optimizer, the results)."""
    if user.op == "output":
        return True
    return prog.marks(user) is not None and kind[user] == "other"


def _running(change: list[int], n: int) -> list[int]:
    out, total = [], 0
    for delta in change[:n]:
        total += delta
        out.append(total)
    return out


def value_bytes(val) -> int:
    """The bytes of a value (a tensor, or a tuple of them: a collective of several)."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(value_bytes(v) for v in val)
    return 0
