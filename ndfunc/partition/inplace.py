"""Buffer reuse: an elementwise op whose first input dies there writes its result into it.

A traced step is functional, so run as it is it allocates a fresh buffer for every intermediate;
on big tensors (an optimizer update over every parameter) the allocations and first-touch page
faults cost more than the arithmetic. Where the first input of an elementwise op is a buffer the
program made (not an input the caller owns, not a view, not read later through any alias), the op
becomes its in-place form (`add` -> `add_`), as eager optimizers do by hand.
"""

from __future__ import annotations

import torch

from ndfunc.partition.buffers import lifetimes, readers

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

INPLACE = {
    aten.add.Tensor: aten.add_.Tensor, aten.sub.Tensor: aten.sub_.Tensor, aten.mul.Tensor: aten.mul_.Tensor,
    aten.div.Tensor: aten.div_.Tensor, aten.add.Scalar: aten.add_.Scalar, aten.mul.Scalar: aten.mul_.Scalar,
    aten.div.Scalar: aten.div_.Scalar, aten.sub.Scalar: aten.sub_.Scalar, aten.sqrt.default: aten.sqrt_.default,
    aten.rsqrt.default: aten.rsqrt_.default, aten.neg.default: aten.neg_.default, aten.exp.default: aten.exp_.default,
    aten.reciprocal.default: aten.reciprocal_.default, aten.pow.Tensor_Scalar: aten.pow_.Scalar,
    aten.addcmul.default: aten.addcmul_.default, aten.addcdiv.default: aten.addcdiv_.default,
    aten.lerp.Scalar: aten.lerp_.Scalar, aten.sigmoid.default: aten.sigmoid_.default,
    aten.tanh.default: aten.tanh_.default, aten.silu.default: aten.silu_.default, aten.relu.default: aten.relu_.default,
}
_COMMUTATIVE = (aten.add.Tensor, aten.mul.Tensor)
_WHOLE = (c10d.wait_tensor.default,)  # aliases that are the whole buffer (a collective's result)
def _shape_dtype(node: torch.fx.Node):
    """(shape, dtype) of a node's tensor result, from its metadata or the lowering's note."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape), val.dtype
    return node.meta.get("ndfunc_local")


def reuse_buffers(gm: torch.fx.GraphModule) -> int:
    """Turn ops whose first input dies there into their in-place forms; how many were turned.
    Reads shapes from `meta['val']` or the lowering's `meta['ndfunc_local']`."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    # values computed from factories alone stay plain tensors in simulation, where writing into
    # one from per-rank values would write every rank's result into the same memory
    from_inputs = set()
    for n in nodes:
        if n.op == "placeholder" or any(a in from_inputs for a in n.all_input_nodes):
            from_inputs.add(n)
    root, last = lifetimes(nodes)
    def writable(a, n) -> bool:
        """Whether `n` may write its result into `a`'s memory (a fresh, dense buffer: an op's
        own output, not a view; in-place ops handle any strides it has)."""
        if not isinstance(a, torch.fx.Node):
            return False
        r = root.get(a)
        whole = r is a or (a.target in _WHOLE and a.args[0] is r)  # the buffer itself, not a view of it
        out, val = _shape_dtype(n), _shape_dtype(a)
        return (whole and r.op == "call_function" and a in from_inputs and last[r] == index[n]
                and out is not None and out == val and sum(b is a for b in n.args) == 1)

    turned = 0
    for n in nodes:
        if n.op != "call_function" or n.target not in INPLACE or not n.args:
            continue
        if not writable(n.args[0], n):
            if n.target in _COMMUTATIVE and not n.kwargs and len(n.args) == 2 and writable(n.args[1], n):
                n.args = (n.args[1], n.args[0])  # a + b = b + a: write into the one that dies
            else:
                continue
        r = root[n.args[0]]
        n.target = INPLACE[n.target]
        root[n] = r  # the result is that buffer now, read until n's own last reader
        last[r] = max(last[r], last.pop(n, index[n]))
        turned += 1
    if turned:
        gm.recompile()
    return turned


def fold_donated_copies(gm: torch.fx.GraphModule) -> int:
    """`copy_(buffer, op(buffer, ...))`, where nothing reads `buffer` after `op`, becomes
    `op_(buffer, ...)`: a donated input updated where it lies (Adam's moments by `lerp_`, the
    parameters by `add_`), with no temporary and no copy. How many were folded."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    folded = 0
    for copy in list(gm.graph.find_nodes(op="call_function", target=aten.copy_.default)):
        buffer, result = copy.args[0], copy.args[1]
        if (buffer.op != "placeholder" or not isinstance(result, torch.fx.Node) or result.target not in INPLACE
                or not result.args or result.args[0] is not buffer or len(result.users) != 1
                or sum(b is buffer for b in result.args) != 1
                or any(index[r] > index[result] for r in readers(buffer, through_copies=False) if r is not copy)):
            continue
        result.target = INPLACE[result.target]
        copy.replace_all_uses_with(result)
        gm.graph.erase_node(copy)
        folded += 1
    if folded:
        gm.recompile()
    return folded
