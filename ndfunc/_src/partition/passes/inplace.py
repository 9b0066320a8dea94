"""Buffer reuse: an elementwise op whose first (or second) input dies there writes its result into it.

A traced step is functional, so run as it is it allocates a fresh buffer for every intermediate;
on big tensors (an optimizer update over every parameter) the allocations and first-touch page
faults cost more than the arithmetic. Where the first input of an elementwise op is a buffer the
program made (not an input the caller owns, not a view, not read later through any alias), the op
becomes its in-place form (`add` -> `add_`), as eager optimizers do by hand; where only the second
is, a division or subtraction writes into it (`div(a, b, out=b)`). Which ops have such forms is the
writes table's (`write_ops.IN_PLACE`, `write_ops.INTO_SECOND`).
"""

from __future__ import annotations

import torch

from ndfunc._src.buffers import aliased, lifetimes, readers
from ndfunc._src.partition.program import shape_dtype
from ndfunc._src.view_ops import READS_STRIDES
from ndfunc._src.write_ops import IN_PLACE, INTO_SECOND

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_COMMUTATIVE = (aten.add.Tensor, aten.mul.Tensor)
# aliases that are the whole buffer: a collective's result, an in-place op's, an `out=` op's
_WHOLE = frozenset({c10d.wait_tensor.default, *IN_PLACE.values(), *INTO_SECOND.values()})


def reuse_buffers(gm: torch.fx.GraphModule) -> int:
    """Turn ops whose first input dies there into their in-place forms (or whose second does, into
    `out=` forms); how many were turned.
    Reads shapes from `meta['val']` or the lowering's note (`program.local_note`)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    # values computed from factories alone stay plain tensors in simulation, where writing into
    # one from per-rank values would write every rank's result into the same memory
    from_inputs = set()
    for n in nodes:
        if n.op == "placeholder" or any(a in from_inputs for a in n.all_input_nodes):
            from_inputs.add(n)
    root, last = lifetimes(nodes)
    into: dict = {}  # an op turned in place -> the buffer its result is now (its views' too)

    def buffer(a):
        r = root.get(a)
        while r in into:
            r = into[r]
        return r

    def writable(a, n) -> bool:
        """Whether `n` may write its result into `a`'s memory: a fresh buffer (an op's own output,
        not a view) that dies at `n` and that no other input of `n` reads (a view of it would
        overlap the writes)."""
        if not isinstance(a, torch.fx.Node):
            return False
        r = buffer(a)
        whole = a  # the buffer itself, not a view of it
        while whole is not r and whole.target in _WHOLE:
            whole = aliased(whole)
        out, val = shape_dtype(n), shape_dtype(a)
        return (whole is r and r.op == "call_function" and a in from_inputs and last[r] == index[n]
                and out is not None and out == val and sum(b is a for b in n.args) == 1
                and all(buffer(b) is not r for b in n.all_input_nodes if b is not a))

    turned = 0
    for n in nodes:
        if n.op != "call_function" or n.target not in IN_PLACE or not n.args:
            continue
        if writable(n.args[0], n):  # the result keeps the first input's layout, as the op's would
            n.target = IN_PLACE[n.target]
        elif len(n.args) != 2 or not writable(n.args[1], n) or not _layout_free(n):
            continue
        elif n.target in _COMMUTATIVE and not n.kwargs:
            n.args = (n.args[1], n.args[0])  # a + b = b + a: write into the one that dies
            n.target = IN_PLACE[n.target]
        elif n.target in INTO_SECOND:
            n.target, n.kwargs = INTO_SECOND[n.target], {**n.kwargs, "out": n.args[1]}
        else:
            continue
        r = buffer(aliased(n))
        into[n] = r  # the result (and any view of it) is that buffer now, read until n's own last reader
        last[r] = max(last[r], last.get(n, index[n]))
        turned += 1
    if turned:
        gm.recompile()
    return turned


def _layout_free(n: torch.fx.Node) -> bool:
    """Whether nothing reads `n`'s result through an op that depends on its strides. Written into
    its second input, the result has that input's strides, where the op would have followed the
    first's (a `view` of it could then fail)."""
    return not any(r.target in READS_STRIDES for r in readers(n))


def fold_donated_copies(gm: torch.fx.GraphModule) -> int:
    """`copy_(buffer, op_k(...op_1(buffer, ...)...))`, a chain of elementwise ops each read only by
    the next, where nothing reads `buffer` after `op_1`, becomes `op_1_(buffer, ...)` ... `op_k_`:
    a donated input updated where it lies (Adam's first moment by `lerp_`, its second by `mul_` and
    `addcmul_`, the parameters by `add_`), with no temporary and no copy. How many were folded."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    folded = 0
    for copy in list(gm.graph.find_nodes(op="call_function", target=aten.copy_.default)):
        buffer, chain = copy.args[0], [copy.args[1]]
        if buffer.op != "placeholder":
            continue
        while _chain_link(chain[-1], buffer) and chain[-1].args[0] is not buffer:
            chain.append(chain[-1].args[0])
        first = chain[-1]
        if (not _chain_link(first, buffer) or first.args[0] is not buffer
                or any(len(n.users) != 1 or sum(b is n.args[0] for b in n.args) != 1 for n in chain)
                or any(index[r] > index[first] for r in readers(buffer, through_copies=False) if r is not copy)):
            continue
        for n in chain:
            n.target = IN_PLACE[n.target]
        copy.replace_all_uses_with(chain[0])
        gm.graph.erase_node(copy)
        folded += 1
    if folded:
        gm.recompile()
    return folded


def fold_scales(gm: torch.fx.GraphModule) -> int:
    """`add(a, mul(x, c))` with `c` a number and the product read only there becomes
    `add(a, x, alpha=c)`: one pass over the memory, not two (an update scaled by the learning rate
    and added to its parameter). How many were folded."""
    folded = 0
    for add in list(gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)):
        if add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
            continue
        for i in (1, 0):
            m = add.args[i]
            if (isinstance(m, torch.fx.Node) and m.target is aten.mul.Tensor and len(m.users) == 1 and not m.kwargs
                    and isinstance(m.args[1], (int, float)) and not isinstance(m.args[1], bool)
                    and isinstance(m.args[0], torch.fx.Node) and shape_dtype(m.args[0]) == shape_dtype(m)
                    and isinstance(add.args[1 - i], torch.fx.Node)):
                add.args, add.kwargs = (add.args[1 - i], m.args[0]), {"alpha": m.args[1]}
                gm.graph.erase_node(m)
                folded += 1
                break
    if folded:
        gm.recompile()
    return folded


def _chain_link(node, buffer: torch.fx.Node) -> bool:
    """Whether `node` is an elementwise op with an in-place form whose result has `buffer`'s
    shape and dtype, so it may be written into it."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in IN_PLACE
            and bool(node.args) and isinstance(node.args[0], torch.fx.Node)
            and shape_dtype(node) is not None and shape_dtype(node) == shape_dtype(buffer))
