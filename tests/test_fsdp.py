"""nf.fsdp: FSDP's gather schedule over the lowered program. Results equal the unsharded step;
bytes and memory are read from the program and the collectives that run are counted."""

from __future__ import annotations

import operator

import optree
import pytest
import torch
from test_jit_partition import CountRun

import ndfunc as nf
from ndfunc._src.partition.passes.analysis import peak_memory
from ndfunc._src.partition.passes.schedule import schedule
from ndfunc._src.partition.program import comm
from ndfunc._src.view_ops import SAME_ELEMENTS
from ndfunc.sharding import NamedSharding, P

N_LAYERS, D, B = 4, 32, 128
c10d = torch.ops._c10d_functional


def setup(blocks: bool = True, batch: int = B):
    """A chain of `tanh(h @ w)` layers, each weight a block of a list (`layers.i.w`), as FSDP
    wraps each block: the unit `nf.fsdp` gathers, prefetches and buckets by; or, `blocks=False`,
    weights side by side (`w0`, `w1`, ..), each then a unit of its own."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(D, D, generator=g) / D**0.5 for _ in range(N_LAYERS)]
    params = {"layers": [{"w": w} for w in weights]} if blocks else {f"w{i}": w for i, w in enumerate(weights)}
    x, y = torch.randn(batch, D, generator=g), torch.randn(batch, D, generator=g)
    opt = nf.optim.adam(1e-2)

    def step(p, s, x, y):
        def loss_fn(p):
            weights = [layer["w"] for layer in p["layers"]] if blocks else [p[f"w{i}"] for i in range(N_LAYERS)]
            h = x.to(weights[0].dtype)  # (under nf.mixed_precision the weights come in bf16)
            for w in weights:
                h = torch.tanh(h @ w)
            return ((h - y) ** 2).mean()

        loss, grads = nf.value_and_grad(loss_fn)(p)
        u, s = opt.update(grads, s, p)
        return nf.optim.apply_updates(p, u), s, loss

    return params, opt, step, x, y


def jitted(mesh, transforms=(), blocks: bool = True, batch: int = B):
    params, opt, step, x, y = setup(blocks, batch)
    specs = optree.tree_map(lambda _: P("dp"), params)  # each weight stored as row blocks
    state = opt.init(params)
    sspecs = nf.optim.state_shardings(state, specs)
    put = lambda t, s: nf.device_put(t, optree.tree_map(lambda q: NamedSharding(mesh, q), s,  # noqa: E731
                                                         is_leaf=lambda q: isinstance(q, P)))
    f = nf.jit(step, mesh=mesh, in_shardings=(specs, sspecs, P("dp"), P("dp")), out_shardings=(specs, sspecs, P()),
               transforms=list(transforms))
    return f, (put(params, specs), put(state, sspecs), x, y)


def moved(costs, kind):
    return costs["comm_bytes"].get(kind, 0)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_step_equals_the_unsharded_step(reshard):
    params, opt, step, x, y = setup()
    expected = step(params, opt.init(params), x, y)
    with nf.simulate(4):
        f, args = jitted(nf.make_mesh(dp=4), [nf.fsdp("dp", reshard_after_forward=reshard)])
        got = nf.device_get(f(*args))
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("blocks", [True, False])
def test_resharding_gathers_each_weight_again_for_backward_and_frees_it_between(blocks, prefetch):
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=4)
        plain, args = jitted(mesh, blocks=blocks)
        # one collective per weight here (bucket_bytes=0), to count them
        keep, _ = jitted(mesh, [nf.fsdp("dp", reshard_after_forward=False, bucket_bytes=0)], blocks)
        reshard, _ = jitted(mesh, [nf.fsdp("dp", bucket_bytes=0, prefetch=prefetch)], blocks)
        c_plain, c_keep, c_reshard = (f.lower(*args).cost_analysis() for f in (plain, keep, reshard))
    weight = D * D * 4
    per_gather = weight * 3 // 4  # (N-1)/N of a weight comes in
    # without resharding: each weight gathered once, its gradient reduce-scattered: 2 x params x (N-1)/N;
    # the mean loss a sum of each rank's squared errors, one scalar all-reduce (its errors are not gathered)
    assert moved(c_keep, "all_gather") == N_LAYERS * per_gather == moved(c_plain, "all_gather")
    assert c_keep["collectives"]["all_reduce"] == 1 and moved(c_keep, "all_reduce") == 2 * 3 / 4 * 4
    assert moved(c_keep, "reduce_scatter") == N_LAYERS * per_gather
    # resharding: gathered again for backward (3 x params x (N-1)/N), except the last layer's,
    # whose backward comes right after its forward (as torchtitan leaves it), the first's, which
    # backward does not read (no gradient for the input x), and with prefetch the one before the
    # last: its gather for backward would be issued where the last layer's forward starts, as
    # soon as the first copy is freed, which would save no memory
    again = N_LAYERS - 2 - min(prefetch, 1)
    assert moved(c_reshard, "all_gather") == (N_LAYERS + again) * per_gather
    assert c_reshard["collectives"]["all_gather"] == c_keep["collectives"]["all_gather"] + again
    # and the gathered weights are not all held from forward to backward
    assert c_reshard["peak_memory_bytes"] < c_keep["peak_memory_bytes"] <= c_plain["peak_memory_bytes"]


def test_under_mixed_precision_each_shard_is_cast_gathered_and_gathered_again_for_backward():
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16): the shard is cast, then gathered (half the
    # bytes), and the gathered copy is freed after forward and made again for backward, as in fp32
    # (the test above); a cast between the stored shard and its gather does not make it a value
    # FSDP leaves alone
    # (a batch of 4 x B: with its activations in bf16 too, at B the partitioner moves some layers'
    # activations rather than gather their weights)
    bf16 = nf.mixed_precision(torch.bfloat16, torch.float32)
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=4)
        keep, args = jitted(mesh, [nf.fsdp("dp", reshard_after_forward=False, bucket_bytes=0), bf16], batch=4 * B)
        reshard, _ = jitted(mesh, [nf.fsdp("dp", bucket_bytes=0), bf16], batch=4 * B)
        lowered = {"keep": keep.lower(*args), "reshard": reshard.lower(*args)}
    c_keep, c_reshard = (lowered[k].cost_analysis() for k in ("keep", "reshard"))
    per_gather = D * D * 2 * 3 // 4  # (N-1)/N of a bf16 weight comes in
    again = N_LAYERS - 3  # as above, with prefetch
    assert moved(c_keep, "all_gather") == N_LAYERS * per_gather
    assert moved(c_reshard, "all_gather") == (N_LAYERS + again) * per_gather
    held = {k: low.memory_analysis().breakdown.gathered for k, low in lowered.items()}
    weight = D * D * 2
    assert held["keep"] == (N_LAYERS - 1) * weight  # each, forward to backward (bar the first: backward reads none)
    assert held["reshard"] == 2 * weight  # the one computing and the next, prefetched


def test_prefetch_issues_the_next_gather_before_the_current_layer_computes():
    with nf.simulate(4):
        f, args = jitted(nf.make_mesh(dp=4), [nf.fsdp("dp", reshard_after_forward=False, prefetch=1, bucket_bytes=0)])
        gm = f.lower(*args).program.local
    nodes = list(gm.graph.nodes)
    starts = [n for n in nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    mms = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    # the second weight's gather is issued before the first layer's matmul
    assert nodes.index(starts[1]) < nodes.index(mms[0])


def test_gradients_are_reduced_in_the_reduce_dtype():
    with nf.simulate(4):
        f, args = jitted(nf.make_mesh(dp=4), [nf.fsdp("dp", reshard_after_forward=False, reduce_dtype=torch.float64)])
        costs = f.lower(*args).cost_analysis()
        gm = f.lower(*args).program.local
        params, opt, step, x, y = setup()
        expected = step(params, opt.init(params), x, y)
        got = nf.device_get(f(*args))
    rs = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default
             and n.kwargs.get("dtype") is torch.float64]
    # each gradient cast up before its reduction (the reductions bucketed or not)
    assert rs and all(comm(n).dtype is torch.float64 for n in rs) and len(casts) == N_LAYERS
    assert moved(costs, "reduce_scatter") == N_LAYERS * (D * D * 8) * 3 // 4
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def two_weight_layers():
    """Layers of two weights, a batch much bigger than a weight (gathering weights is then the
    cheap plan, FSDP's), and the step: the weights' gradients."""
    g = torch.Generator().manual_seed(0)
    layers = [{"a": torch.randn(D, D, generator=g) / D**0.5, "b": torch.randn(D, D, generator=g) / D**0.5}
              for _ in range(N_LAYERS)]
    x, y = torch.randn(512, D, generator=g), torch.randn(512, D, generator=g)

    def grads(layers, x, y):
        def loss(layers):
            h = x
            for layer in layers:
                h = torch.tanh(torch.tanh(h @ layer["a"]) @ layer["b"])
            return ((h - y) ** 2).mean()
        return nf.grad(loss)(layers)

    return layers, x, y, grads


def test_buckets_gather_and_reduce_each_layers_weights_at_once_with_the_same_bytes():
    layers, x, y, grads = two_weight_layers()
    expected = grads(layers, x, y)
    specs = [{"a": P("dp"), "b": P("dp")} for _ in layers]
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=4)
        put = nf.device_put(layers, optree.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                                    is_leaf=lambda s: isinstance(s, P)))
        kw = dict(mesh=mesh, in_shardings=(specs, P("dp"), P("dp")), out_shardings=specs)
        single = nf.jit(grads, transforms=[nf.fsdp("dp", bucket_bytes=0)], **kw)
        bucketed = nf.jit(grads, transforms=[nf.fsdp("dp")], **kw)
        one, many = single.lower(put, x, y).cost_analysis(), bucketed.lower(put, x, y).cost_analysis()
        with CountRun() as ran:
            out = bucketed(put, x, y)
        got = nf.device_get(out)
    assert many["comm_bytes"] == one["comm_bytes"]  # the same bytes, in fewer collectives
    # each layer's two weights gathered together (forward and again for backward), the loss's
    # activations on their own
    assert many["collectives"]["all_gather"] - 1 == (one["collectives"]["all_gather"] - 1) // 2
    # gradients: a bucket ends where backward gathers the next weights again
    assert many["collectives"]["reduce_scatter"] < one["collectives"]["reduce_scatter"] == 2 * N_LAYERS
    assert {k: v for k, v in ran.counts.items() if v} == many["collectives"]  # what ran is what was lowered
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_weight_gathered_off_dim_0_is_copied_out_of_its_bucket_once():
    # "b" is stored as column blocks: its gathered copy is the ranks' blocks put along dim 1 (one
    # copy of a permuted view), read straight out of the layer's bucket, so that is the only copy
    from torch.multiprocessing.reductions import StorageWeakRef

    layers, x, y, grads = two_weight_layers()
    expected = grads(layers, x, y)
    specs = [{"a": P("dp"), "b": P(None, "dp")} for _ in layers]
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=4)
        put = nf.device_put(layers, optree.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                                    is_leaf=lambda s: isinstance(s, P)))
        f = nf.jit(grads, transforms=[nf.fsdp("dp")], mesh=mesh, in_shardings=(specs, P("dp"), P("dp")),
                   out_shardings=specs)
        program = f.lower(put, x, y).program
        got = nf.device_get(f(put, x, y))
    program.ensure_meta()
    nodes = list(program.local.graph.nodes)
    storage = lambda n: StorageWeakRef(n.meta["val"].untyped_storage())  # noqa: E731
    buckets = {storage(n) for n in nodes if n.target is torch.ops._c10d_functional.wait_tensor.default
               and getattr(comm(n.args[0]), "parameters", False)}
    # the blocks put along dim 1: one copy, read from the bucket
    joined = [n for n in nodes if n.target is torch.ops.aten.clone.default and n.meta["val"].numel() == D * D
              and storage(n.args[0]) in buckets]
    assert len(joined) >= N_LAYERS  # each "b", gathered for forward (and some again for backward)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def llama_case(batch_shape, **config):
    """A small llama, its parameters, a batch, AdamW, and the parameters' bytes.

    AdamW's eps is 1e-5, not 1e-8: its first step is lr * g / (|g| + eps), so with eps = 1e-8 a
    gradient near zero turns an fp32 summation-order difference of an ulp into a whole step (one
    CPU's kernels against another's: the unsharded fp32 step is up to 2x the tolerance from the
    same step in float64). With 1e-5 it is within 3% of it, and the comparison is of what the
    partitioner did."""
    from models import llama

    cfg = llama.LlamaConfig(n_heads=4, n_kv_heads=2, **config)
    params = llama.init(cfg, nf.random.key(0))
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randint(0, cfg.vocab_size, batch_shape, generator=g) for k in ("tokens", "targets")}
    return cfg, params, batch, nf.optim.adamw(1e-3, eps=1e-5), sum(p.numel() * 4 for p in optree.tree_leaves(params))


def llama_fsdp_step(cfg, params, opt, n, transforms, config=None):
    """The llama AdamW step under FSDP rules on `n` ranks (call inside nf.simulate(n); `config`'s
    rules and mesh where given), and its arguments laid out (the batch split by the step)."""
    from models import llama, train

    config = config or nf.ParallelConfig(dp_shard_size=n)
    mesh = config.build_mesh()
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
    state = opt.init(params)
    sspec = nf.optim.state_shardings(state, pspec)
    named = lambda t, s: nf.device_put(t, optree.tree_map(  # noqa: E731
        lambda q: NamedSharding(mesh, q), s, is_leaf=lambda q: isinstance(q, P)))
    f = nf.jit(train.make_step(cfg, opt, config.rules), mesh=mesh, in_shardings=(pspec, sspec, None),
               out_shardings=(pspec, sspec, P()), donate_argnums=(0, 1), transforms=transforms)
    return f, (named(params, pspec), named(state, sspec))


@pytest.mark.slow
def test_llama_under_fsdp_rules_moves_at_most_what_fsdp2_moves_and_reduces_no_activation():
    # A vocabulary big next to the batch: the head's logits (B*L x V) outweigh its weight.
    # FSDP2 gathers each parameter and reduce-scatters each gradient: 2 x params x (N-1)/N, and
    # 3x with resharding. The partitioner may do better (the embedding table can stay split:
    # gathering the tokens and the rows looked up is cheaper), never worse, and never all-reduces
    # logits or activations: only the loss.
    from models import train

    cfg, params, batch, opt, param_bytes = llama_case((8, 16), vocab_size=2048, dim=128, n_layers=1, ffn_dim=256)
    expected = train.make_step(cfg, opt)(params, opt.init(params), batch)
    costs = {}
    with nf.simulate(4):
        for reshard in (False, True):
            f, args = llama_fsdp_step(cfg, params, opt, 4, [nf.fsdp("dp_shard", reshard_after_forward=reshard)])
            costs[reshard] = f.lower(*args, batch).cost_analysis()
        got = nf.device_get(f(*args, batch))
    assert costs[False]["comm_bytes"]["total"] <= 2 * param_bytes * 3 / 4
    assert costs[True]["comm_bytes"]["total"] <= 3 * param_bytes * 3 / 4
    assert costs[True]["comm_bytes"].get("all_reduce", 0) <= 4 * 3 / 4 * 4  # the loss's sum and count
    # one layer: its parameters gathered in one bucket, again for backward; gradients in one
    assert costs[True]["collectives"]["reduce_scatter"] <= 2
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_peak_memory_is_the_shards_plus_the_gathered_layers_plus_activations():
    # The analytic FSDP peak per rank: (params + grads + Adam's two moments) / N, the gathered
    # weights of prefetch + 1 layers, and a rank's share of the activations (those of the
    # single-device step, whose peak is the same four copies of the parameters and activations).
    # Two sequences a rank: a rank's tokens outweigh a weight, so FSDP's plan (weights gathered,
    # tokens where they are) is the partitioner's optimum, not a tie with gathering the tokens.
    cfg, params, batch, opt, param_bytes = llama_case((8, 32), vocab_size=1024, dim=128, n_layers=4, ffn_dim=384)
    layer_bytes = sum(p.numel() * 4 for p in optree.tree_leaves(params["layers"][0]))

    def peak(n, transforms):
        with nf.simulate(n):
            f, args = llama_fsdp_step(cfg, params, opt, n, transforms)
            return f.lower(*args, batch).cost_analysis()["peak_memory_bytes"]

    activations = peak(1, []) - 4 * param_bytes
    assert 0 < activations / 4 < param_bytes  # a rank's share as big as the parameters: every term counts
    n = 4
    for prefetch in (0, 1):
        got = peak(n, [nf.fsdp("dp_shard", prefetch=prefetch)])
        formula = 4 * param_bytes / n + (prefetch + 1) * layer_bytes + activations / n
        assert got == pytest.approx(formula, rel=0.10), (prefetch, got, formula)


@pytest.mark.slow
def test_gradient_reduce_scatters_stay_in_flight_as_long_as_the_peak_allows():
    # Each bucketed reduce-scatter is waited for where its results are read (by the optimizer),
    # else before the next is issued, else at once: whichever is latest without raising the peak
    # of the program that waits for each at once. The vocabulary here is big next to the layers,
    # so the step's peak is the logits' and every bucket can stay in flight until it is read.
    cfg, params, batch, opt, _ = llama_case((4, 32), vocab_size=4096, dim=64, n_layers=3, ffn_dim=192)
    with nf.simulate(4):
        f, args = llama_fsdp_step(cfg, params, opt, 4, [nf.fsdp("dp_shard")])
        lowered = f.lower(*args, batch)
        got = nf.device_get(f(*args, batch))
    lowered.program.ensure_meta()
    gm = lowered.program.local
    nodes = list(gm.graph.nodes)
    rs = [n for n in nodes if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    waits = [next(iter(r.users)) for r in rs]
    assert len(rs) == 3 + 1  # a bucket per block, and the root's (final norm and head)
    buckets = [w for r, w in zip(rs, waits) if comm(r).bucket > 1]
    assert len(buckets) >= 3 and all(w.next in w.users for w in buckets)  # as late as can be: read next
    assert sum(nodes.index(w) > nodes.index(r.next) for w, r in zip(waits, rs[1:])) >= 2  # over later layers
    peak = peak_memory(gm)
    for r in rs:  # each waited for at once instead
        r.append(next(iter(r.users)))
    assert peak_memory(gm) == peak
    from models import train

    expected = train.make_step(cfg, opt)(params, opt.init(params), batch)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_reduce_scatters_are_waited_for_at_once_where_in_flight_would_raise_the_peak():
    # Here the layers outweigh the logits: the peak is in backward, where a reduce-scatter in
    # flight would hold a layer's gradients over the next layer's; the peak formula's case.
    cfg, params, batch, opt, _ = llama_case((4, 32), vocab_size=1024, dim=128, n_layers=4, ffn_dim=384)
    with nf.simulate(4):
        f, args = llama_fsdp_step(cfg, params, opt, 4, [nf.fsdp("dp_shard", prefetch=0)])
        lowered = f.lower(*args, batch)
    lowered.program.ensure_meta()
    gm = lowered.program.local
    nodes = list(gm.graph.nodes)
    rs = [n for n in nodes if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    at_once = [next(iter(r.users)) is r.next for r in rs]
    assert any(at_once)
    peak = peak_memory(gm)
    for r, once in zip(rs, at_once):
        if not once:  # the others, later still, would raise it
            r.append(next(iter(r.users)))
    assert peak_memory(gm) == peak


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_prefetch_issues_a_whole_layer_that_many_layers_ahead(prefetch):
    # Three llama blocks (a rank's 64 tokens outweigh a weight: FSDP's plan is the optimum, which
    # the exact solver proves): each block's nine parameters come in one gather, and with prefetch k
    # that gather is in flight over the forward matmuls of the k blocks before it (seven each: q,
    # k, v, o, gate, up, down). The final norm and the head, which no block holds, come together
    # (FSDP2's root), once: the norm is not gathered again for a backward that follows the head's.
    cfg, params, batch, opt, _ = llama_case((4, 64), vocab_size=1024, dim=128, n_layers=3, ffn_dim=384)
    with nf.simulate(4):
        f, args = llama_fsdp_step(cfg, params, opt, 4, [nf.fsdp("dp_shard", prefetch=prefetch)])
        gm = f.lower(*args, batch).program.local
    nodes = list(gm.graph.nodes)
    matmuls = [i for i, n in enumerate(nodes) if n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    gathers = []  # (parameters in the gather, matmuls while it is in flight)
    for i, n in enumerate(nodes):
        if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default and comm(n).parameters:
            (wait,) = n.users
            gathers.append((comm(n).bucket, sum(i < m < nodes.index(wait) for m in matmuls)))
    forward, head = gathers[:3], gathers[3]
    assert [b for b, _ in forward] == [9, 9, 9]
    assert [m for _, m in forward] == [0, 7 * min(prefetch, 1), 7 * min(prefetch, 2)]
    assert head == (2, 7 * prefetch)
    # and each block again for backward, but with prefetch the last: its gather for backward
    # would be issued (one layer ahead: at the head) where its forward ends
    assert len(gathers) == 3 + 1 + 3 - min(prefetch, 1)


@pytest.mark.slow
def test_gradient_reductions_are_waited_for_in_turn_so_gradients_are_not_held_to_the_end():
    # The partitioner issues each gradient's reduce-scatter where the gradient is made; waited for
    # where the optimizer reads it, at the end, every gradient would be held, full size, through
    # backward (a collective reads its input until its wait). Waited for before the next is issued,
    # at most one is: the peak is that of the step holding one layer's gradient at a time.
    cfg, params, batch, opt, param_bytes = llama_case((4, 32), vocab_size=1024, dim=128, n_layers=4, ffn_dim=384)
    with nf.simulate(4):
        f, args = llama_fsdp_step(cfg, params, opt, 4, [])
        lowered = f.lower(*args, batch)
        got = nf.device_get(f(*args, batch))
    nodes = list(lowered.program.local.graph.nodes)
    rs = [n for n in nodes if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    assert len(rs) > 4
    for r, following in zip(rs, rs[1:]):
        (wait,) = r.users
        assert nodes.index(wait) < nodes.index(following)
    from models import train

    expected = train.make_step(cfg, opt)(params, opt.init(params), batch)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_a_weight_gathered_over_two_axes_is_prefetched_whole():
    # Weights stored split over dp by rows and over tp by columns, a batch split over both: the
    # partitioner runs each layer data-parallel, its weight gathered over tp, then over dp (one
    # chain, FSDP's unit over several axes). Prefetched, the last gather is in flight over the
    # layer before's matmul, as a gather over one axis is; it was issued just before its own use.
    params, opt, step, _, _ = setup()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32 * B, D, generator=g), torch.randn(32 * B, D, generator=g)  # activations outweigh weights
    expected = step(params, opt.init(params), x, y)
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        specs = optree.tree_map(lambda _: P("dp", "tp"), params)
        state = opt.init(params)
        sspecs = nf.optim.state_shardings(state, specs)
        put = lambda t, s: nf.device_put(t, optree.tree_map(lambda q: NamedSharding(mesh, q), s,  # noqa: E731
                                                             is_leaf=lambda q: isinstance(q, P)))
        f = nf.jit(step, mesh=mesh, in_shardings=(specs, sspecs, P(("dp", "tp")), P(("dp", "tp"))),
                   out_shardings=(specs, sspecs, P()), transforms=[nf.fsdp("dp", bucket_bytes=0)])
        args = (put(params, specs), put(state, sspecs), x, y)
        nodes = list(f.lower(*args).program.local.graph.nodes)
        got = nf.device_get(f(*args))
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    matmuls = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    gathers = [(i, n) for i, n in enumerate(nodes) if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    last = []  # matmuls while each chain's gather over dp is in flight, in program order
    for i, n in gathers:
        if comm(n).axes == ("dp",):
            before = n.args[0]  # a chain: it gathers what a gather over tp made (laid out by views)
            while before.target is not torch.ops._c10d_functional.wait_tensor.default:
                before = before.args[0]
            assert comm(before.args[0]).axes == ("tp",)
            (wait,) = n.users
            last.append(sum(i < m < nodes.index(wait) for m in matmuls))
    assert last[:N_LAYERS] == [0, 1, 1, 1]  # the forward's; before, [0, 0, 0, 0]


def test_a_hugging_face_models_weights_gathered_over_two_axes_are_prefetched():
    # transformers' Mixtral (3 layers, small) on dp_shard 2 x tp 2, 8 sequences a rank, its
    # activations left to the partitioner (no axis rules): it gathers weights over tp, lays the
    # result out (views, copies) and gathers it over dp_shard. Each such chain is one FSDP unit:
    # its gather over dp_shard is in flight over the layer before's matmuls. It was read as two
    # gathers, the second issued just before its use.
    transformers = pytest.importorskip("transformers")
    from models import train

    hf = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2)
    lowered = train.lower_abstract_hf(hf, nf.ParallelConfig(1, 2, 1, 2), 64, [
        nf.fsdp("dp_shard", bucket_bytes=0), nf.mixed_precision(torch.bfloat16, torch.float32)], batch_per_rank=8,
        ruled=False)
    nodes = list(lowered.program.local.graph.nodes)
    c10d = torch.ops._c10d_functional
    matmuls = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    second = []  # matmuls in flight over each gather over dp_shard of what a gather over tp made
    for i, n in enumerate(nodes):
        if n.target is c10d.all_gather_into_tensor.default and comm(n).axes == ("dp_shard",):
            x = n.args[0]
            while (x.op == "call_function" and x.target is not c10d.wait_tensor.default
                   and isinstance(x.args[0], torch.fx.Node)):
                x = x.args[0]
            if x.target is c10d.wait_tensor.default and comm(x.args[0]).axes == ("tp",):
                (wait,) = n.users
                second.append(sum(i < m < nodes.index(wait) for m in matmuls))
    # all but a few in flight: the first layer's, issued at the head, and the first regathered for
    # backward, issued where the forward ends (before: every one of them at 0)
    assert len(second) > 10 and sum(m == 0 for m in second) <= 3, second


# what lays a value out or cuts it, and the collectives' own nodes: no compute
_DATA_MOVEMENT = SAME_ELEMENTS | {torch.ops.aten.cat.default, torch.ops.aten.slice.Tensor, torch.ops.aten.split_with_sizes.default,
                          operator.getitem, c10d.wait_tensor.default, c10d.all_gather_into_tensor.default,
                          c10d.reduce_scatter_tensor.default}


def first_computed_on(node: torch.fx.Node, index: dict) -> torch.fx.Node:
    """The first op that computes on `node`'s value (read through data movement)."""
    found, todo = [], [node]
    while todo:
        for u in todo.pop().users:
            (todo if u.target in _DATA_MOVEMENT else found).append(u)
    return min(found, key=index.__getitem__)


def of_program_inputs(node: torch.fx.Node) -> bool:
    """Whether `node` is a program input laid out, cut or gathered, nothing computed."""
    while node.op == "call_function" and node.target in _DATA_MOVEMENT:
        node = node.args[0][0] if node.target is torch.ops.aten.cat.default else node.args[0]
    return node.op == "placeholder"


@pytest.mark.parametrize("prefetch", [1, 2])
def test_the_scheduler_gathers_a_layer_prefetch_layers_ahead_and_waits_where_it_is_read(prefetch):
    # The llama step over stand-ins under nf.fsdp, its collectives placed by the scheduler
    # (passes/schedule.py) from nf.fsdp's windows. The schedule nf.fsdp made before there was a
    # scheduler, read off the program alone: each gather of stored values (a layer's parameters in
    # one bucket; the batch's tokens, a unit of their own) is waited for just before what it
    # gathered is first read; in forward, unit j starts in the data movement just before the first
    # op computing on unit j - prefetch (the first `prefetch` units', on the first's); each
    # gradient reduce-scatter is waited for at once, where it is read, or before the next over its
    # group starts, and the peak is that of each one waited for at once. Scheduled again, the
    # program does not change.
    from models import llama, train

    cfg = llama.LlamaConfig(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128)
    lowered = train.lower_abstract(cfg, nf.ParallelConfig(dp_shard_size=4), 32, [nf.fsdp("dp_shard", prefetch=prefetch)])
    gm = lowered.program.local
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default and of_program_inputs(n.args[0])]
    assert sum(comm(g).parameters for g in gathers) == cfg.n_layers + 1 + cfg.n_layers - 1  # blocks, the root,
    waits = [next(iter(g.users)) for g in gathers]  # blocks again for backward but the last
    for w in waits:
        read = min(w.users, key=index.__getitem__)
        assert all(n.target is c10d.wait_tensor.default for n in nodes[index[w] + 1:index[read]])
    forward = gathers[:1 + cfg.n_layers + 1]  # the tokens, the blocks, the root
    for j, g in enumerate(forward):
        anchor = first_computed_on(waits[max(j - prefetch, 0)], index)
        assert index[g] < index[anchor]
        assert all(n.target in _DATA_MOVEMENT for n in nodes[index[g]:index[anchor]]), (j, prefetch)
    reduce_scatters = [n for n in nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert len(reduce_scatters) == cfg.n_layers + 1
    for rs, following in zip(reduce_scatters, [*reduce_scatters[1:], None]):
        (w,) = rs.users
        read = min(w.users, key=index.__getitem__)
        assert w.prev is rs or all(n.target is c10d.wait_tensor.default for n in nodes[index[w] + 1:index[read]]) or (
            following is not None and all(n.target is c10d.wait_tensor.default
                                          for n in nodes[index[w] + 1:index[following]]))
    assert schedule(gm, peak=True) == 0
    peak = peak_memory(gm)
    for rs in reduce_scatters:
        rs.append(next(iter(rs.users)))
    assert peak_memory(gm) == peak
