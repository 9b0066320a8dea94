"""Repeated regions (`torch.compiler.nested_compile_region`) are traced once and copied at every
call: the program is the one op-by-op tracing records, node for node, and computes what eager does."""

from __future__ import annotations

import dataclasses

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.fx.node import map_arg

import ndfunc as nf
from models import llama, train
from ndfunc._src import regions, stamp
from ndfunc._src.trace import trace
from ndfunc.sharding import NamedSharding, P

UNMARKED = llama.decoder_layer.__marked_compile_region_fn__


def canonical(graph: torch.fx.Graph) -> list:
    """Each node as (name, op, target, arguments by position, annotations, shape, dtype, strides);
    remat region ids numbered by first appearance."""
    index, regions, out = {}, {}, []
    for i, n in enumerate(graph.nodes):
        index[n] = i
        custom = dict(n.meta.get("custom") or {})
        if "ndfunc_remat" in custom:
            custom["ndfunc_remat"] = (regions.setdefault(custom["ndfunc_remat"][0], len(regions)),
                                      custom["ndfunc_remat"][1])
        val = n.meta.get("val")
        described = (tuple(val.shape), val.dtype, val.stride()) if isinstance(val, torch.Tensor) else repr(val)
        ref = lambda a: ("%", index[a])  # noqa: E731
        out.append((n.name, n.op, str(n.target), str(map_arg(n.args, ref)), str(map_arg(n.kwargs, ref)),
                    sorted(custom.items()), described))
    return out


def llama_step(cfg, opt):
    def step(params, state, batch):
        loss, grads = nf.value_and_grad(llama.loss)(params, batch, cfg)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss
    return step


def op_by_op(monkeypatch):
    """Every marked region traced as if it were not marked: the reference."""
    monkeypatch.setattr(stamp.Stamps, "call", lambda self, fn, args, kwargs: fn(*args, **kwargs))


@pytest.mark.parametrize("remat", [None, "full", "save_dots"])
def test_a_step_with_copied_layers_and_optimizer_leaves_is_the_program_traced_op_by_op(monkeypatch, remat):
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=4, remat=remat)
    opt = nf.optim.adamw(1e-3, weight_decay=0.1)
    # float64: Adam's first step is sign(g), and near g = 0 float32's summation order would pick it
    params = llama.init(cfg, nf.random.key(0), dtype=torch.float64)
    state = opt.init(params)
    batch = {"tokens": torch.randint(0, 256, (2, 16)), "targets": torch.randint(0, 256, (2, 16))}
    runs = []
    attention = llama.attention
    monkeypatch.setattr(llama, "attention", lambda *a: runs.append(1) or attention(*a))
    stamped = trace(llama_step(cfg, opt), (params, state, batch))
    assert len(runs) < cfg.n_layers  # traced once (its shapes, then its ops), not once per layer
    op_by_op(monkeypatch)
    plain = trace(llama_step(cfg, opt), (params, state, batch))
    assert canonical(stamped.graph) == canonical(plain.graph)
    torch.testing.assert_close(stamped(params, state, batch), llama_step(cfg, opt)(params, state, batch))


def test_a_remat_region_inside_a_copied_region_is_one_region_per_call(monkeypatch):
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=3)
    params = llama.init(cfg, nf.random.key(0))
    batch = {"tokens": torch.randint(0, 256, (2, 16)), "targets": torch.randint(0, 256, (2, 16))}
    monkeypatch.setattr(llama, "decoder_layer",
                        torch.compiler.nested_compile_region(nf.remat(UNMARKED, "save_dots")))
    step = lambda params, batch: nf.value_and_grad(llama.loss)(params, batch, cfg)  # noqa: E731
    stamped = trace(step, (params, batch))
    monkeypatch.setattr(llama, "decoder_layer", nf.remat(UNMARKED, "save_dots"))
    plain = trace(step, (params, batch))
    assert canonical(stamped.graph) == canonical(plain.graph)
    regions = {n.meta["custom"]["ndfunc_remat"] for n in stamped.graph.nodes if "ndfunc_remat" in n.meta.get("custom", {})}
    assert len(regions) == 3


@pytest.mark.parametrize("mark", [torch.compiler.nested_compile_region, regions.repeated], ids=["torch's", "ndfunc's"])
def test_a_region_runs_once_per_signature_however_often_it_is_called(mark):
    runs = []

    @mark
    def region(x, w):
        runs.append(x.shape)
        return torch.tanh(x @ w) + x

    def step(x, w, calls, y):
        def loss(x, w, y):
            for _ in range(calls):
                x = region(x, w)
            return region(y, w[:3, :3]).sum() + x.sum()  # another signature
        return nf.value_and_grad(loss, argnums=(0, 1))(x, w, y)

    x, w, y = torch.randn(4, 8), torch.randn(8, 8) / 3, torch.randn(2, 3)
    for calls in (2, 10):
        runs.clear()
        traced = trace(step, (x, w, calls, y), static_argnums=(2,))
        assert len(runs) == len([s for s in runs if s == (4, 8)]) + len([s for s in runs if s == (2, 3)])
        if calls == 2:
            per_signature = len(runs)
        assert len(runs) == per_signature  # not once per call
        (value, grads), (want_value, want_grads) = traced(x, w, calls, y), step(x, w, calls, y)
        torch.testing.assert_close(value, want_value)
        torch.testing.assert_close(grads, want_grads)


def test_regions_that_cannot_be_copied_are_traced_op_by_op_and_compute_what_eager_does():
    @torch.compiler.nested_compile_region
    def writes(x):
        return x.mul_(2)

    @torch.compiler.nested_compile_region
    def returns_its_input(x):
        return x

    def closing_over(w):
        @torch.compiler.nested_compile_region
        def region(x):
            return torch.sin(x) * w  # w: a traced tensor it was not passed
        return region

    class Box:  # an output optree cannot see into
        def __init__(self, t):
            self.t = t

    @torch.compiler.nested_compile_region
    def boxed(x):
        return Box(torch.tanh(x))

    def step(x, w):
        a = x * 1
        writes(a)
        writes(a)
        r = closing_over(torch.cos(w))
        loss = lambda x: (r(r(x)) + returns_its_input(x) * 3).sum()  # noqa: E731
        batched = torch.func.vmap(lambda row: closing_over(w[0])(row))(x.reshape(2, 2))  # under vmap
        return a, nf.value_and_grad(loss)(x), batched, boxed(x).t + boxed(w).t

    x, w = torch.randn(4), torch.randn(4)
    got, want = trace(step, (x, w))(x, w), step(x, w)
    torch.testing.assert_close(got, want)


def test_a_region_that_fails_to_trace_raises_its_own_error_from_its_own_line():
    @torch.compiler.nested_compile_region
    def region(x, w):
        return x @ w  # (4, 8) @ (4, 8): the shapes do not match

    with pytest.raises(RuntimeError, match=r"must have same reduction dim, but got \[4, 8\] X \[4, 8\]"):
        trace(lambda x: region(x, x), (torch.randn(4, 8),))

    @torch.compiler.nested_compile_region
    def reads_a_value(x):
        return x * 2 if x.sum() > 0 else x

    with pytest.raises(nf.DataDependentError, match="test_stamp.py"):
        trace(lambda x: reads_a_value(x), (torch.randn(4),))


def test_a_lowered_step_with_fsdp_mixed_precision_and_remat_is_the_program_lowered_op_by_op(monkeypatch):
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=3, remat="full")
    config = nf.ParallelConfig(dp_shard_size=2, tp_size=2)
    opt = nf.optim.adamw(1e-3, weight_decay=0.1)
    mesh = config.build_abstract_mesh()
    specs = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    params = llama.abstract_params(cfg, optree.tree_map(lambda s: NamedSharding(mesh, s), specs))
    args = (params, opt.init(params), train.abstract_batch(config, mesh, config.dp_world_size, 32))

    def lowered():
        step = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh,
                      transforms=[nf.fsdp("dp_shard"), nf.mixed_precision(torch.bfloat16)])
        return step.lower(*args)

    copied = lowered()
    op_by_op(monkeypatch)
    traced = lowered()
    assert copied.as_text() == traced.as_text()
    assert copied.memory_analysis() == traced.memory_analysis()


def same_as_op_by_op(monkeypatch, step, args, in_order=True):
    """`step` traced with its regions copied is the program traced op by op, and computes what eager
    does. Not `in_order`: the same ops, some in another order (where a region's gradient meets
    another's, autograd runs a copied backward at once, and adds the two when it has both)."""
    copied = trace(step, args)
    with monkeypatch.context() as m:
        op_by_op(m)
        traced = trace(step, args)
    if in_order:
        assert canonical(copied.graph) == canonical(traced.graph)
    else:
        ops = lambda g: sorted((n.op, str(n.target), str(n.meta.get("val"))) for n in g.nodes)  # noqa: E731
        assert ops(copied.graph) == ops(traced.graph)
    torch.testing.assert_close(copied(*args), step(*args))


@pytest.mark.parametrize("case", ["expanded gradient", "gradient passed on", "unused input and outputs"])
def test_gradients_come_in_strided_as_they_are_and_unused_inputs_and_outputs_get_none(monkeypatch, case):
    region = torch.compiler.nested_compile_region

    @region
    def linear(x, w):
        return torch.tanh(x) @ w

    @region
    def add(a, b):
        return a + b  # the gradient of each is the one coming in

    @region
    def two(x, w, unused):
        y = torch.tanh(x @ w)
        return y, y.sum(-1), x * 2  # the second's gradient never comes; the third's cannot

    def loss(x, w, b):
        if case == "expanded gradient":
            return (linear(x, w).sum(1) ** 2).sum()  # its gradient comes in with strides (8, 0, 1)
        if case == "gradient passed on":
            return (add(add(x, x * 2), x).sum(1) ** 2).sum()
        h, _, c = two(x.reshape(8, 8), w, b)
        h, _, _ = two(h, w, b)
        return (h * c.exp()).sum()

    def step(x, w):
        return nf.value_and_grad(loss, argnums=(0, 1, 2))(x, w, torch.zeros(3))

    # w is read by both calls of `two`: its two gradients meet
    same_as_op_by_op(monkeypatch, step, (torch.randn(2, 4, 8), torch.randn(8, 8) / 3),
                     in_order=case != "unused input and outputs")


def test_what_else_makes_a_program_keys_the_copy(monkeypatch):
    @torch.compiler.nested_compile_region
    def region(x, w, scale):
        return (x @ w) * scale + torch.ones(()) * 2

    def step(x, w):
        outs = [region(x, w, 0.0), region(x, w, -0.0)]  # equal, and not the same program
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(region(x, w, 1.0))
        outs.append(region(x, w, 1.0))
        outs.append(region(x, MASK, 1.0))  # a tensor the trace did not make: op by op
        return outs

    MASK = torch.eye(8)
    same_as_op_by_op(monkeypatch, step, (torch.randn(4, 8), torch.randn(8, 8)))
    def step64(x):  # the default dtype, changed between calls
        a = region(x, x.T, 1.0)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return a, region(x, x.T, 1.0)
        finally:
            torch.set_default_dtype(old)

    same_as_op_by_op(monkeypatch, step64, (torch.randn(4, 4),))


def test_a_region_output_written_in_place_before_backward_is_refused_as_op_by_op():
    @torch.compiler.nested_compile_region
    def region(x, w):
        return torch.tanh(x @ w)  # its backward reads its output

    def step(x, w):
        def loss(w):
            y = region(x, w)
            y.mul_(2)
            return y.sum()
        return nf.value_and_grad(loss)(w)

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        trace(step, (torch.randn(4, 8), torch.randn(8, 8)))


def test_a_region_whose_gradient_comes_strided_otherwise_is_traced_again_as_its_forward_was():
    # Whisper's encoder layers: their input is a transpose, so the residual add returns it
    # transposed while the gradient reaching it is contiguous, and the region's backward is traced
    # again for that gradient, inside autograd's backward, where the tracer's function mode is off
    # while its own handler runs: SDPA traced as itself there, not ndfunc.attention, was "another
    # forward"
    @torch.compiler.nested_compile_region
    def layer(x, w):
        h = (x @ w).unflatten(-1, (4, 8)).transpose(1, 2).contiguous()
        a = F.scaled_dot_product_attention(h, h, h).transpose(1, 2).contiguous().flatten(2)
        return x + a

    def loss(p, feats):
        x = layer(feats.transpose(1, 2), p["w"])  # strides (512, 1, 16)
        return (x @ p["head"]).square().mean()  # its gradient contiguous

    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(32, 32, generator=g) / 6, "head": torch.randn(32, 8, generator=g)}
    feats = torch.randn(4, 32, 16, generator=g)
    want_grads, want_loss = torch.func.grad_and_value(loss)(p, feats)
    with nf.simulate(2):
        step = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp=2), in_shardings=(P(), P("dp")),
                      out_shardings=(P(), P()))
        got_loss, got_grads = nf.device_get(step(p, feats))
    torch.testing.assert_close(got_loss, want_loss)
    torch.testing.assert_close(got_grads, want_grads, rtol=1e-4, atol=1e-5)
