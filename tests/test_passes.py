"""The memory passes over a local program, each on a small hand-built graph: the result must equal
the graph run as it was built, and the rewrite must be the one promised."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ndfunc._src.buffers import lifetimes
from ndfunc._src.partition.passes.inplace import (
    fold_donated_copies,
    fold_scales,
    reuse_buffers,
)
from ndfunc._src.partition.passes.hoist import hoist_freeing_ops
from ndfunc._src.partition.passes.schedule import Start, Wait, Window, schedule
from ndfunc._src.partition.passes.shared import share_repeated_moves
from ndfunc._src.partition.program import carry_marks, note_local, set_window, window

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
SHAPE = (4, 8)


def build(body, n_inputs: int) -> torch.fx.GraphModule:
    """A GraphModule of `body(graph, *placeholders) -> outputs`, every value of shape SHAPE."""
    g = torch.fx.Graph()
    ins = [g.placeholder(f"x{i}") for i in range(n_inputs)]
    for node in ins:
        note_local(node, SHAPE, torch.float32)
    out = body(g, *ins)
    for node in g.nodes:
        if node.op == "call_function":
            note_local(node, SHAPE, torch.float32)
    g.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def inputs(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.rand(SHAPE, generator=g) + 0.5 for _ in range(n)]


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_donated_moment_is_updated_where_it_lies_through_a_chain_of_ops():
    # Adam's second moment: copy_(v, addcmul(v * b2, g, g)) -> v.mul_(b2).addcmul_(g, g)
    def body(g, v, grad):
        scaled = g.call_function(aten.mul.Tensor, (v, 0.999))
        new = g.call_function(aten.addcmul.default, (scaled, grad, grad), {"value": 0.001})
        return (g.call_function(aten.copy_.default, (v, new)),)

    v, grad = inputs(2)
    expected = v * 0.999 + 0.001 * grad * grad
    gm = build(body, 2)
    assert fold_donated_copies(gm) == 1
    assert targets(gm) == [aten.mul_.Tensor, aten.addcmul_.default]
    buffer = v.clone()
    (out,) = gm(buffer, grad)
    torch.testing.assert_close(out, expected)
    assert out.data_ptr() == buffer.data_ptr()


def test_a_donated_input_read_after_the_chain_starts_is_not_overwritten():
    def body(g, v, grad):
        scaled = g.call_function(aten.mul.Tensor, (v, 0.5))
        later = g.call_function(aten.add.Tensor, (v, grad))  # reads the old v after the chain began
        new = g.call_function(aten.add.Tensor, (scaled, later))
        return (g.call_function(aten.copy_.default, (v, new)),)

    gm = build(body, 2)
    assert fold_donated_copies(gm) == 0
    assert aten.copy_.default in targets(gm)


def test_a_donated_input_a_gather_still_reads_is_not_overwritten():
    # the gather sends p in the background until its wait: the update may not go into p before
    def body(g, p, u):
        gathered = g.call_function(c10d.all_gather_into_tensor.default, (p, 2, "0"))
        new = g.call_function(aten.add.Tensor, (p, u))
        waited = g.call_function(c10d.wait_tensor.default, (gathered,))
        return (g.call_function(aten.copy_.default, (p, new)), waited)

    gm = build(body, 2)
    assert fold_donated_copies(gm) == 0
    assert aten.copy_.default in targets(gm)


def test_a_scale_feeding_an_add_becomes_its_alpha():
    def body(g, p, u):
        return (g.call_function(aten.add.Tensor, (p, g.call_function(aten.mul.Tensor, (u, -0.01)))),)

    p, u = inputs(2)
    gm = build(body, 2)
    assert fold_scales(gm) == 1
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert node.target is aten.add.Tensor and node.args[1].name == "x1" and node.kwargs == {"alpha": -0.01}
    torch.testing.assert_close(gm(p, u)[0], p - 0.01 * u)


def test_each_update_is_added_to_its_parameter_before_the_next_is_made():
    # a tree_map of the update, then a tree_map of the sum: every update alive at once, unless the
    # sums move up to just after their update
    def body(g, p0, p1, g0, g1):
        u0 = g.call_function(aten.mul.Tensor, (g0, 2.0))
        u1 = g.call_function(aten.mul.Tensor, (g1, 2.0))
        v0 = g.call_function(aten.sqrt.default, (u0,))
        v1 = g.call_function(aten.sqrt.default, (u1,))
        return (g.call_function(aten.add.Tensor, (p0, v0)), g.call_function(aten.add.Tensor, (p1, v1)))

    args = inputs(4)
    gm = build(body, 4)
    expected = gm(*args)
    hoist_freeing_ops(gm)
    order = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert order == ["mul_tensor", "sqrt_default", "add_tensor", "mul_tensor_1", "sqrt_default_1", "add_tensor_1"]
    torch.testing.assert_close(gm(*args), expected)


def test_nothing_moves_above_a_write():
    def body(g, p, x):
        u = g.call_function(aten.mul.Tensor, (x, 2.0))
        w = g.call_function(aten.copy_.default, (p, x))  # p now holds x
        return (w, g.call_function(aten.add.Tensor, (u, w)))

    gm = build(body, 2)
    assert hoist_freeing_ops(gm) == 0


def test_an_in_place_result_is_a_whole_buffer_the_next_op_may_write_into():
    # sqrt_ writes into its input; the add after it may write into the same buffer again
    def body(g, v, m):
        d = g.call_function(aten.div.Tensor, (v, 3.0))
        s = g.call_function(aten.sqrt.default, (d,))
        e = g.call_function(aten.add.Tensor, (s, 1e-8))
        return (g.call_function(aten.div.Tensor, (m, e)),)

    v, m = inputs(2)
    gm = build(body, 2)
    expected = gm(v, m)
    # sqrt -> sqrt_, add -> add_; the last div's first input m is the caller's, its second dies: out=
    assert reuse_buffers(gm) == 3
    assert targets(gm) == [aten.div.Tensor, aten.sqrt_.default, aten.add_.Tensor, aten.div.out]
    torch.testing.assert_close(gm(v, m), expected)


def test_a_quotient_is_written_into_a_divisor_that_dies_and_the_buffers_say_so():
    def body(g, a, b):
        d = g.call_function(aten.exp.default, (b,))  # a fresh buffer, read only by the division
        q = g.call_function(aten.div.Tensor, (a, d))
        r = g.call_function(aten.sub.Tensor, (a, q), {"alpha": 2})  # q dies here too
        return (g.call_function(aten.div.Tensor, (r, b)),)  # b is the caller's: never written

    a, b = inputs(2)
    gm = build(body, 2)
    expected = a - 2 * (a / b.exp())
    expected = expected / b
    assert reuse_buffers(gm) == 3
    assert targets(gm) == [aten.exp.default, aten.div.out, aten.sub.out, aten.div_.Tensor]
    nodes = list(gm.graph.nodes)
    root, _ = lifetimes(nodes)
    exp, div, sub, last = [n for n in nodes if n.op == "call_function"]
    assert root[div] is exp and root[sub] is exp and root[last] is exp  # one buffer for the whole chain
    before = (a.clone(), b.clone())
    torch.testing.assert_close(gm(a, b)[0], expected)
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


def reduction_after_other_work(g, x, y, write_first: bool):
    """A gradient `x * 2`, laid out (a transpose and a copy) and reduce-scattered where the
    optimizer reads it, after other work on `y`; `write_first`: `x` is written in between."""
    grad = g.call_function(aten.mul.Tensor, (x, 2.0))
    other = g.call_function(aten.mul.Tensor, (y, 3.0))
    if write_first:
        other = g.call_function(aten.add_.Tensor, (grad, other))  # the gradient changes here
    laid = g.call_function(aten.clone.default, (g.call_function(aten.t.default, (grad,)),))
    rs = g.call_function(c10d.reduce_scatter_tensor.default, (laid, "sum", 2, "0"))
    return (g.call_function(c10d.wait_tensor.default, (rs,)), other)


def test_a_reduction_and_the_copies_feeding_it_are_issued_right_after_the_gradient():
    gm = build(lambda g, x, y: reduction_after_other_work(g, x, y, write_first=False), 2)
    assert schedule(gm) == 3
    assert targets(gm) == [aten.mul.Tensor, aten.t.default, aten.clone.default, c10d.reduce_scatter_tensor.default,
                           aten.mul.Tensor, c10d.wait_tensor.default]  # the wait stays where it was read


def test_a_reduction_does_not_move_above_a_write_to_what_it_reads():
    gm = build(lambda g, x, y: reduction_after_other_work(g, x, y, write_first=True), 2)
    before = targets(gm)
    assert schedule(gm) == 0
    assert targets(gm) == before


def square(body, n_inputs: int, metas: dict | None = None) -> torch.fx.GraphModule:
    """Like `build`, over 4 x 4 values (so a transpose keeps the shape); `metas` name the others."""
    g = torch.fx.Graph()
    ins = [g.placeholder(f"x{i}") for i in range(n_inputs)]
    g.output(body(g, *ins))
    for node in g.nodes:
        if node.op != "output":
            note_local(node, *(metas or {}).get(node.name, ((4, 4), torch.float32)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_a_result_read_through_a_view_is_not_written_into_a_second_input_of_other_strides():
    # exp(x.t()) is column-major; a / it is row-major, as `a` is. Written into the divisor, the
    # quotient would be column-major and the view after it would fail.
    def body(g, a, x):
        b = g.call_function(aten.exp.default, (g.call_function(aten.t.default, (x,)),))
        flat = g.call_function(aten.view.default, (g.call_function(aten.div.Tensor, (a, b)), [-1]))
        return (flat,)

    a, x = (torch.rand(4, 4, generator=torch.Generator().manual_seed(i)) + 0.5 for i in range(2))
    gm = square(body, 2, {"view_default": ((16,), torch.float32)})
    assert reuse_buffers(gm) == 0
    torch.testing.assert_close(gm(a, x)[0], (a / x.t().exp()).reshape(-1))


def test_nothing_is_written_into_a_buffer_another_input_views():
    # b.t() / b and b + b.t(): b dies at the op, but the other input reads the same memory
    def body(g, x):
        b = g.call_function(aten.exp.default, (x,))
        c = g.call_function(aten.exp.default, (x,))
        return (g.call_function(aten.div.Tensor, (g.call_function(aten.t.default, (b,)), b)),
                g.call_function(aten.add.Tensor, (c, g.call_function(aten.t.default, (c,)))))

    x = torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    gm = square(body, 1)
    assert reuse_buffers(gm) == 0
    q, s = gm(x)
    torch.testing.assert_close(q, x.exp().t() / x.exp())
    torch.testing.assert_close(s, x.exp() + x.exp().t())


def in_flight_reduction(g, x, y, wait_first: bool):
    """A gradient `x * 2` all-reduced, and `grad + y` read while the reduction runs (or, with
    `wait_first`, after its wait)."""
    grad = g.call_function(aten.mul.Tensor, (x, 2.0))
    ar = g.call_function(c10d.all_reduce.default, (grad, "sum", "0"))
    waited = g.call_function(c10d.wait_tensor.default, (ar,)) if wait_first else None
    total = g.call_function(aten.add.Tensor, (grad, y))
    if not wait_first:
        waited = g.call_function(c10d.wait_tensor.default, (ar,))
    return (waited, total)


def test_a_buffer_a_collective_reads_lives_until_its_wait_and_is_not_written_before():
    # `grad + y` is grad's last reader: written into grad, it would change what the all-reduce,
    # still running, sends. After the wait it may.
    for wait_first, rewrites in ((False, 0), (True, 1)):
        gm = build(lambda g, x, y: in_flight_reduction(g, x, y, wait_first), 2)
        nodes = list(gm.graph.nodes)
        root, last = lifetimes(nodes)
        grad, wait, total = (next(n for n in nodes if n.target is t)
                             for t in (aten.mul.Tensor, c10d.wait_tensor.default, aten.add.Tensor))
        assert last[grad] == nodes.index(total if wait_first else wait)
        assert reuse_buffers(gm) == rewrites


def test_a_reduction_is_waited_for_before_the_next_over_its_group_is_issued():
    # both waited for at the end: both gradients held to there. In turn: the first is freed
    # before the second reduction starts.
    def body(g, x, y):
        rs = [g.call_function(c10d.reduce_scatter_tensor.default, (g.call_function(aten.mul.Tensor, (v, 2.0)), "sum", 2, "0"))
              for v in (x, y)]
        return tuple(g.call_function(c10d.wait_tensor.default, (r,)) for r in rs)

    gm = build(body, 2)
    first = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert lifetimes(list(gm.graph.nodes))[1][first] == 6  # after x0, x1, mul, rs, mul, rs: the first wait
    assert schedule(gm) == 1
    assert targets(gm) == [aten.mul.Tensor, c10d.reduce_scatter_tensor.default, aten.mul.Tensor, c10d.wait_tensor.default,
                           c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default]
    assert lifetimes(list(gm.graph.nodes))[1][first] == 5
    assert schedule(gm) == 0


def test_a_declared_gather_starts_just_before_its_anchor_and_is_waited_for_where_it_is_read():
    # nf.fsdp's prefetch as the scheduler takes it: the gather of w (a view of a program input) may
    # start just before the first op of the layer before; it moves there with its view, and its
    # wait stays just before its result is read. Its start is placed once.
    def body(g, x, w):
        a = g.call_function(aten.mul.Tensor, (x, 2.0))  # the layer before
        b = g.call_function(aten.mul.Tensor, (a, 3.0))
        view = g.call_function(aten.t.default, (w,))
        gathered = g.call_function(c10d.all_gather_into_tensor.default, (view, 2, "0"))
        waited = g.call_function(c10d.wait_tensor.default, (gathered,))
        return (g.call_function(aten.add.Tensor, (b, waited)),)

    gm = build(body, 2)
    first, _, view, gather, _, _ = [n for n in gm.graph.nodes if n.op == "call_function"]
    set_window(gather, Window(Start.EARLY, Wait.READ, after=first))
    assert schedule(gm) == 2
    assert targets(gm) == [aten.t.default, c10d.all_gather_into_tensor.default, aten.mul.Tensor, aten.mul.Tensor,
                           c10d.wait_tensor.default, aten.add.Tensor]
    assert window(gather) == Window(Start.LOWERED, Wait.READ)
    assert schedule(gm) == 0


def test_views_alike_are_moved_once_within_a_phase_and_again_in_another():
    # three einsums' permutes of x, each gathered: the forward's two (the same annotations) become
    # one view, one gather and one wait; the backward's (another phase) keeps its own, so the
    # forward's gathered block is not kept alive for it
    def body(g, x):
        out = []
        for phase in ({"ndfunc_forward": True}, {"ndfunc_forward": True}, {}):
            view = g.call_function(aten.permute.default, (x, [1, 0]))
            carry_marks(view, SimpleNamespace(meta={"custom": phase}))  # as `lower` marks it from the traced op
            gathered = g.call_function(c10d.all_gather_into_tensor.default, (view, 2, "0"))
            out.append(g.call_function(c10d.wait_tensor.default, (gathered,)))
        return tuple(out)

    gm = build(body, 1)
    assert share_repeated_moves(gm) == 3
    assert targets(gm) == [aten.permute.default, c10d.all_gather_into_tensor.default, c10d.wait_tensor.default] * 2
    first, second, third = gm.graph.find_nodes(op="output")[0].args[0]
    assert first is second and third is not first
