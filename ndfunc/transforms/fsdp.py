"""`nf.fsdp`: when FSDP's gathers happen, as a pass over the lowered program.

The partitioner already turns a parameter stored sharded over an axis into an all-gather before
its use and its gradient into a reduce-scatter. What it does not decide is *when*: its program
gathers each parameter once and keeps the whole of it alive from the forward use to the backward
one, so every layer's gathered weights are held at once. This pass makes that FSDP2's schedule:

- reshard after forward: a gathered parameter whose uses fall in two groups, with other
  parameters gathered in between (a layer's forward, then, much later, its backward), is gathered
  again just before the second group, so the first copy dies after forward;
- prefetch: each parameter's all-gather is issued where the gather `prefetch` places earlier is
  first used (the wait stays at its own first use), so the transfer overlaps that layer's compute;
- reduce_dtype: gradients are reduce-scattered in that dtype (cast before, cast back after).
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from ndfunc.transforms._reduce import reduce_in

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class fsdp:  # noqa: N801 - a transform is named like the function it stands for
    """FSDP's gather schedule for parameters stored sharded over `axis` (a name or a tuple).

    Use: `nf.jit(train_step, mesh=mesh, in_shardings=..., transforms=[nf.fsdp('dp_shard')])`.
    """

    axis: str | tuple[str, ...]
    reshard_after_forward: bool = True
    prefetch: int = 1
    reduce_dtype: torch.dtype | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)

    def lowered(self, program) -> None:
        gm = program.local
        gathers = [g for g in _parameter_gathers(gm) if set(g.comm["axes"]) <= set(self.axes)]
        if self.reshard_after_forward:
            index = {n: i for i, n in enumerate(gm.graph.nodes)}  # copies go in; these stay valid
            firsts = sorted(index[min(g.value.users, key=index.__getitem__)] for g in gathers if g.value.users)
            for g in gathers:
                _regather_for_second_use(gm, g, index, firsts)
        gathers = [g for g in _parameter_gathers(gm) if set(g.comm["axes"]) <= set(self.axes)]
        if self.prefetch > 0:
            _prefetch(gm, gathers, self.prefetch)
        if self.reduce_dtype is not None:
            reduce_in(gm, self.reduce_dtype, self.axes, kinds=(c10d.reduce_scatter_tensor.default,))
        gm.graph.lint()
        gm.recompile()


@dataclasses.dataclass
class _Gather:
    start: torch.fx.Node  # all_gather_into_tensor
    chain: list  # start .. value: the nodes that make the gathered value
    value: torch.fx.Node  # what the program reads

    @property
    def comm(self) -> dict:
        return self.start.meta["ndfunc_comm"]


def _parameter_gathers(gm: torch.fx.GraphModule) -> list[_Gather]:
    """All-gathers of program inputs (through views), with the nodes that finish them."""
    found = []
    for start in gm.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default):
        src = start.args[0]
        while src.op == "call_function" and src.target in (aten.clone.default, aten.view.default, aten.reshape.default):
            src = src.args[0]
        if src.op != "placeholder" or "ndfunc_comm" not in start.meta:
            continue
        chain, value = [start], start
        while len(value.users) == 1:  # wait, then (a gather off dim 0) split, getitems, cat
            (user,) = value.users
            if user.target is c10d.wait_tensor.default or user.target is aten.split.Tensor:
                chain.append(user)
                value = user
                continue
            break
        if value.target is aten.split.Tensor:
            items = list(value.users)
            cats = {u for i in items for u in i.users}
            if len(cats) == 1:
                chain += items + [cats.pop()]
                value = chain[-1]
        found.append(_Gather(start, chain, value))
    return found


def _regather_for_second_use(gm, g: _Gather, index: dict, firsts: list[int]) -> None:
    """Gather `g` again before its first use that follows another parameter's first use (its
    backward, after the later layers' forward); the uses from there on read the new copy.
    `index`: the program order before any copy; `firsts`: each parameter gather's first use."""
    uses = sorted(g.value.users, key=index.__getitem__)
    if len(uses) < 2:
        return
    # split where other parameters are first used in between: forward, then backward
    cut = None
    for a, b in zip(uses, uses[1:]):
        if bisect.bisect_right(firsts, index[a]) < bisect.bisect_left(firsts, index[b]):
            cut = b
            break
    if cut is None:
        return
    later = [u for u in uses if index[u] >= index[cut]]
    env: dict = {}
    with gm.graph.inserting_before(cut):
        for n in g.chain:
            env[n] = gm.graph.node_copy(n, lambda a: env.get(a, a))
    again = env[g.value]
    for u in later:
        u.replace_input_with(g.value, again)


def _prefetch(gm, gathers: list[_Gather], k: int) -> None:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    live = [g for g in gathers if g.value.users]
    live.sort(key=lambda g: index[min(g.value.users, key=index.__getitem__)])
    for i in range(k, len(live)):
        earlier = live[i - k]
        anchor = min(earlier.value.users, key=index.__getitem__)
        start = live[i].start
        if index[anchor] < index[start] and all(index[a] < index[anchor] for a in start.all_input_nodes):
            anchor.prepend(start)  # issued there; its wait stays where it was
