"""nf.ring_attention against full attention (torch's own, on the whole sequence): the ring alone on
simulated ranks, the gathered form the partitioner writes without it, the ring inside nf.jit, and
the llama step with context parallelism."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor

import ndfunc as nf
from ndfunc._src.transforms import ring
from ndfunc.sharding import P

N = 4  # ranks on the ring
B, H, L, K = 2, 4, 32, 8


def full_attention(q, k, v, positions):
    """Reference: torch's attention over the whole sequence, mask from positions; and its lse."""
    mask = positions[:, None, :, None] >= positions[:, None, None, :]
    kk, vv = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    scores = (q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    return out, torch.logsumexp(scores, -1), mask


def blocks(x, dim=2):
    """Rank r's block of a sequence split into N contiguous blocks, as a LocalTensor."""
    return LocalTensor({r: c.contiguous() for r, c in enumerate(x.chunk(N, dim))})


def whole(x, dim=2):
    return torch.cat([x._local_tensors[r] for r in range(N)], dim)


def ring_kwargs(mask, kernel="cpu_flash"):
    return dict(mask=blocks(mask), causal=False, scale=None, kernel=kernel, coords=LocalTensor({r: torch.tensor([r]) for r in range(N)}), axis=0,
                size=N, peers=tuple((r, (r + 1) % N) for r in range(N)), skip=True)


def inputs(kv_heads=H, dtype=torch.float32, layout="zigzag"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, K, generator=g)
    k, v = torch.randn(B, kv_heads, L, K, generator=g), torch.randn(B, kv_heads, L, K, generator=g)
    grad_out = torch.randn(B, H, L, K, generator=g)
    positions = torch.arange(L).expand(B, L)
    if layout == "zigzag":  # the sequence reordered so that rank r holds chunks r and 2N-1-r
        order = ring.zigzag_order(L, N)
        q, k, v, grad_out = (x.index_select(2, order) for x in (q, k, v, grad_out))
        positions = positions.index_select(1, order)
    return [x.to(dtype) for x in (q, k, v, grad_out)], positions


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])  # math: what runs where no kernel of torch's does
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
def test_ring_forward_and_gradients_equal_full_attention_fp32(layout, kv_heads, kernel):
    (q, k, v, grad_out), positions = inputs(kv_heads, layout=layout)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected, expected_lse, mask = full_attention(*leaves, positions)
    expected.backward(grad_out)
    with nf.simulate(N):
        kw = ring_kwargs(mask, kernel)
        out, lse = ring.ring_forward(blocks(q), blocks(k), blocks(v), **kw)
        dq, dk, dv = ring.ring_backward(blocks(grad_out), blocks(q), blocks(k), blocks(v), out, lse, **kw)
        got = [whole(x) for x in (out, lse, dq, dk, dv)]
    for a, b in zip(got, [expected, expected_lse, *(x.grad for x in leaves)]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("skip,keys", [(True, L), (False, L), (False, L // 2), (False, 2 * L)],
                         ids=["skip", "all", "fewer-keys", "more-keys"])
def test_is_causal_without_a_mask_is_the_causal_mask_of_the_sequence_in_order(skip, keys):
    # Hugging Face's sdpa path with no padding: is_causal=True, each rank's queries the positions
    # rank * block ..; each block's mask made for it alone; with another number of keys, torch's
    # top-left causal mask (key j seen by query i where j <= i)
    (q, k, v, grad_out), _ = inputs(layout="contiguous")
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(B, H, keys, K, generator=g) for _ in range(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True)
    scores = (leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(K)).masked_fill(
        torch.ones(L, keys, dtype=torch.bool).tril().logical_not(), -math.inf)
    expected_lse = torch.logsumexp(scores, -1)
    expected.backward(grad_out)
    with nf.simulate(N):
        kw = {**ring_kwargs(torch.ones(B, 1, L, L, dtype=torch.bool)), "mask": None, "causal": True, "skip": skip}
        out, lse = ring.ring_forward(blocks(q), blocks(k), blocks(v), **kw)
        dq, dk, dv = ring.ring_backward(blocks(grad_out), blocks(q), blocks(k), blocks(v), out, lse, **kw)
        got = [whole(x) for x in (out, lse, dq, dk, dv)]
    for a, b in zip(got, [expected, expected_lse, *(x.grad for x in leaves)]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
def test_a_query_that_sees_no_key_on_any_rank_has_torchs_zero_output_and_gradients(kernel):
    # left padding under a causal mask, as Hugging Face builds it: the first keys are padding, so
    # the first queries see no key at all; torch's attention gives them out 0 and gradients 0
    (q, k, v, grad_out), positions = inputs(layout="contiguous")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    mask = positions[:, None, :, None] >= positions[:, None, None, :]
    mask[..., :3] = False
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    expected.backward(grad_out)
    with nf.simulate(N):
        kw = ring_kwargs(mask, kernel)
        out, lse = ring.ring_forward(blocks(q), blocks(k), blocks(v), **kw)
        dq, dk, dv = ring.ring_backward(blocks(grad_out), blocks(q), blocks(k), blocks(v), out, lse, **kw)
        got = [whole(x) for x in (out, dq, dk, dv)]
    assert not any(x.isnan().any() for x in got)
    for a, b in zip(got, [expected, *(x.grad for x in leaves)]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_ring_in_bf16_is_within_bf16_rounding_of_fp32_attention():
    # inputs and outputs rounded to bf16 (8 bits of mantissa: relative 2**-8 = 0.4%), scores,
    # softmax and merges in fp32: the error is that rounding, a few of it at most, on values of
    # order 1, so 2e-2 absolute and relative
    (q, k, v, grad_out), positions = inputs(dtype=torch.bfloat16)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    expected, _, mask = full_attention(*leaves, positions)
    expected.backward(grad_out.float())
    with nf.simulate(N):
        kw = ring_kwargs(mask)
        out, lse = ring.ring_forward(blocks(q), blocks(k), blocks(v), **kw)
        dq, dk, dv = ring.ring_backward(blocks(grad_out), blocks(q), blocks(k), blocks(v), out, lse, **kw)
        got = [whole(x) for x in (out, dq, dk, dv)]
    assert all(x.dtype == torch.bfloat16 for x in got)
    for a, b in zip(got, [expected, *(x.grad for x in leaves)]):
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("layout,most,least", [("zigzag", 2 * N + 1, 2 * N + 1), ("contiguous", 4 * N - 1, 3)])
def test_zigzag_balances_and_halves_the_quarter_blocks_each_rank_computes(layout, most, least):
    # a real rank computes each key block in quarters (its two chunks of queries by the block's two
    # of keys) and skips the quarters its queries cannot see; count them as it would. Under zigzag
    # a rank's chunks r and 2N-1-r see half of every other rank's block and three quarters of
    # their own: 2N + 1 of 4N on every rank, where a block at a time computes all 4N. In order,
    # rank r sees its own block's three quarters and the r blocks before it
    _, positions = inputs(layout=layout)
    mask = positions[:, None, :, None] >= positions[:, None, None, :]
    work = []
    for r in range(N):
        block_rows = mask.chunk(N, 2)[r]
        blocks = [ring._block(block_rows, torch.tensor([r]), 0, N, s)[0] for s in range(N)]
        halves = ring._halves(block_rows.shape[2], True)
        work.append(sum(ring._visible(b[:, :, i, j]) for b in blocks for i in halves for j in halves))
    assert (max(work), min(work)) == (most, least)  # attention FLOPs per rank, in quarter blocks


def test_zigzag_lays_out_and_undoes():
    batch = {"tokens": torch.arange(16).reshape(1, 16), "targets": torch.arange(16).reshape(1, 16) + 1}
    laid = nf.zigzag(batch, 2)
    # 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert laid["tokens"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert torch.equal(laid["positions"], laid["tokens"])
    assert torch.equal(nf.unzigzag(laid["targets"], 2), batch["targets"])
    with pytest.raises(ValueError, match=r"^zigzag: a sequence of 12 tokens does not cut into 2 x 4 equal chunks; "
                                         r"use a length divisible by 8\.$"):
        nf.zigzag({"tokens": torch.zeros(1, 12)}, 4)


# --- inside nf.jit ------------------------------------------------------------------------------

def attention_step(q, k, v, positions, w):
    """Attention and the gradients of a weighted sum of it: forward and backward in one program."""
    def f(q, k, v):
        mask = positions[:, None, :, None] >= positions[:, None, None, :]
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * w).sum()

    return nf.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("transforms", [[], [nf.ring_attention("cp")]], ids=["gathered", "ring"])
def test_sequence_sharded_attention_in_jit_equals_full_attention(transforms):
    # one sequence, one head: the sequence is the only dim to split, so attention runs split
    (q, k, v, w), positions = inputs(layout="zigzag")
    q, k, v, w = (x[:1, :1] for x in (q, k, v, w))
    positions = positions[:1]
    expected = attention_step(q, k, v, positions, w)
    seq = P(None, None, "cp")
    with nf.simulate(N):
        mesh = nf.make_mesh(cp=N)
        step = nf.jit(attention_step, mesh=mesh, in_shardings=(seq, seq, seq, P(None, "cp"), seq),
                      out_shardings=(P(), (seq, seq, seq)), transforms=transforms)
        got = nf.device_get(step(q, k, v, positions, w))
        costs = step.lower(q, k, v, positions, w).cost_analysis()
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if transforms:  # K and V go round the ring, never gathered
        assert costs["collectives"]["ppermute"] == 2
        assert costs["comm_bytes"].get("all_gather", 0) < L * K * 4 * 2  # positions only, not K and V


@pytest.mark.parametrize("load_balance", ["zigzag", None])
def test_an_encoders_attention_with_no_mask_runs_as_a_ring_equal_to_full_attention(load_balance):
    # BERT's self-attention without an attention mask: every query sees every key
    (q, k, v, w), _ = inputs(layout="contiguous")
    q, k, v, w = (x[:1, :1] for x in (q, k, v, w))

    def step(q, k, v, w):
        return nf.value_and_grad(lambda q, k, v: (F.scaled_dot_product_attention(q, k, v) * w).sum(),
                                 argnums=(0, 1, 2))(q, k, v)

    expected = step(q, k, v, w)
    seq = P(None, None, "cp")
    with nf.simulate(N):
        f = nf.jit(step, mesh=nf.make_mesh(cp=N), in_shardings=(seq,) * 4, out_shardings=(P(), (seq, seq, seq)),
                   transforms=[nf.ring_attention("cp", load_balance=load_balance)])
        got = nf.device_get(f(q, k, v, w))
        costs = f.lower(q, k, v, w).cost_analysis()
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert costs["collectives"]["ppermute"] == 2  # K and V go round the ring, never gathered
    assert costs["comm_bytes"].get("all_gather", 0) == 0


def test_an_attention_whose_sequence_the_axis_does_not_divide_is_split_as_without_the_ring():
    # a vision-language model: the text's causal attention over the sequence split on cp, and the
    # vision tower's over 17 tokens (CLS and 16 patches), which the ring cannot split: that one is
    # split by the batch, as without the transform (it ran whole, with a warning; pytest errors on it)
    g = torch.Generator().manual_seed(0)  # float64: sums of squares' gradients, summed in another order
    w, text, img = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((8, 8), (4, 2, 16, 8), (4, 2, 17, 8)))

    def loss(w, text, img):
        t = F.scaled_dot_product_attention(text @ w, text, text, is_causal=True)
        v = F.scaled_dot_product_attention(img @ w, img, img)
        return t.square().sum() + v.square().sum()

    want = nf.value_and_grad(loss)(w, text, img)
    with nf.simulate(4):
        f = nf.jit(nf.value_and_grad(loss), mesh=nf.make_mesh(dp_shard=2, cp=2),
                   in_shardings=(P(), P("dp_shard", None, "cp"), P("dp_shard")), out_shardings=(P(), P()),
                   transforms=[nf.ring_attention("cp", load_balance=None)])
        got = nf.device_get(f(w, text, img))
        ring_nodes = [n for n in f.lower(w, text, img).program.local.graph.nodes if n.target is ring.ring_forward]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(ring_nodes) == 1  # the text's


def test_ring_holds_less_than_the_gathered_keys_and_falls_with_the_ring_size():
    (q, k, v, w), positions = inputs(layout="zigzag")
    q, k, v, w = (x[:1, :1] for x in (q, k, v, w))
    positions = positions[:1]
    seq = P(None, None, "cp")
    peaks = {}
    for n in (2, 4):
        with nf.simulate(n):
            mesh = nf.make_mesh(cp=n)
            for name, transforms in (("gathered", []), ("ring", [nf.ring_attention("cp")])):
                step = nf.jit(attention_step, mesh=mesh, in_shardings=(seq, seq, seq, P(None, "cp"), seq),
                              out_shardings=(P(), (seq, seq, seq)), transforms=transforms)
                peaks[name, n] = step.lower(q, k, v, positions, w).cost_analysis()["peak_memory_bytes"]
    assert peaks["ring", 4] < peaks["gathered", 4]
    assert peaks["ring", 4] < peaks["ring", 2]


def test_two_sequences_a_rank_under_the_ring_warn_that_the_plan_gathers_them_over_its_axis():
    # a rank's two sequences, flattened to tokens for the loss, are two strided runs of the
    # flattened dim: no layout holds them, so the plan gathers the sequence over cp first. One
    # sequence a rank is one contiguous run, kept split (warnings are errors in this suite).
    import dataclasses

    from models import llama, train
    from ndfunc._src.partition.passes.analysis import collectives

    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=1)
    config = nf.ParallelConfig(dp_shard_size=2, cp_size=2)
    ring_cp = [nf.ring_attention("cp", load_balance=None)]
    def gathered_over_cp(lowered) -> float:
        return sum(c.moved for _, c in collectives(lowered.program.local) if (c.kind, c.axes) == ("all_gather", ("cp",)))
    one = train.lower_abstract(cfg, config, 64 * 2, ring_cp, batch_per_rank=1)
    message = (r"^nf\.ring_attention\('cp'\): step takes 2 sequences a rank, and where it flattens \(batch, "
               r"sequence\) to tokens \(a loss's targets and scores\) a rank's tokens are strided, which no layout "
               r"holds: the plan gathers the sequence over 'cp' before \d+ such flattens \([\w, .]+\), moving "
               r"\(and often computing\) what one sequence a rank keeps split\. Pass one sequence a rank per step "
               r"under context parallelism, and nf\.accumulate micro-batches for a larger batch \(as nf\.plan and "
               r"torchtitan do\)\.$")
    with pytest.warns(nf.sharding.ShardingWarning, match=message) as warned:
        two = train.lower_abstract(cfg, config, 64 * 2, ring_cp, batch_per_rank=2)
    assert warned[0].filename == train.__file__  # the caller's line, outside ndfunc
    # what the program does: the linear layers keep the tokens split (each an `ndfunc::dot`, no
    # flatten), so twice the tokens move about twice the bytes over cp (gathered before every linear
    # layer, they moved more than five times)
    assert gathered_over_cp(one) < gathered_over_cp(two) < 3 * gathered_over_cp(one)


def test_a_reshape_inside_a_shard_map_region_is_no_flatten_the_ring_warns_of():
    # inside an nf.shard_map region every value is a rank's own block (a layout of its own), so the
    # ring's look for gathered flattens passes its reshapes by (cp second on the mesh: it used to
    # index that layout by cp's place and fail to lower)

    with nf.simulate(4):
        mesh = nf.make_mesh(dp_shard=2, cp=2)

        def step(q, x):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            flat = nf.shard_map(lambda t: t.reshape(-1) * 2, mesh, in_specs=P("dp_shard", "cp"),
                                out_specs=P(("dp_shard", "cp")))(x)
            return out.sum() + flat.sum()

        f = nf.jit(step, mesh=mesh, in_shardings=(P("dp_shard", None, "cp"), P("dp_shard", "cp")), out_shardings=P(),
                   transforms=[nf.ring_attention("cp", load_balance=None)])
        g = torch.Generator().manual_seed(0)
        q, x = torch.randn(2, 2, 8, 4, generator=g), torch.randn(4, 8, generator=g)
        got = nf.device_get(f(q, x))
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, q, q, is_causal=True).sum() + 2 * x.sum())
