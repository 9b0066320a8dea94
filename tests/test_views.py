"""Views of split blocks that DTensor's view rule refuses but that need no communication
(`ndfunc._src.partition.planning.views`): flattening (batch, sequence) to tokens where each rank
holds one sequence split over `cp`, and splitting the tokens back. Held to slicing the whole value
(each rank's block of the view equals the view of its block) and to the single device."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import ndfunc as nf
from ndfunc._src.partition.planning.layout import all_layouts
from ndfunc._src.partition.planning.views import contiguous_view
from ndfunc._src.partition.program import collectives
from ndfunc._src.torch_compat import view_dim_map
from ndfunc.sharding import P


def _block(x: torch.Tensor, layout, sizes, coords) -> torch.Tensor:
    """The block of `x` the rank at `coords` holds in `layout`: each dim cut by its axes in mesh
    order, major to minor (slicing, not the code under test)."""
    for dim in range(x.dim()):
        axes = [a for a, p in enumerate(layout) if isinstance(p, Shard) and p.dim == dim]
        index, blocks = 0, 1
        for a in axes:
            index, blocks = index * sizes[a] + coords[a], blocks * sizes[a]
        n = x.shape[dim] // blocks
        x = x.narrow(dim, index * n, n)
    return x


@pytest.mark.parametrize("sizes", [(2, 2), (2, 4), (2, 2, 2), (2, 2, 2, 2)])
@pytest.mark.parametrize("shape,to", [
    ((4, 8, 6), (32, 6)),  # (batch, sequence, vocabulary) -> (tokens, vocabulary): the loss
    ((32, 6), (4, 8, 6)),  # and back: the gradient of the logits
    ((2, 4, 8), (64,)),
    ((64,), (2, 4, 8)),
    ((4, 8, 6), (4, 48)),
    ((8, 2, 3), (4, 2, 2, 3)),  # a split and a flatten in one view
])
def test_each_ranks_block_of_the_view_is_the_view_of_its_block(shape, to, sizes):
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    rule = view_dim_map().view_groups(shape, to)
    taken = 0
    for layout in all_layouts(shape, sizes, partial=False):
        found = contiguous_view(rule, shape, layout, sizes)
        if found is None:
            continue
        ins, out = found
        assert ins == layout
        for coords in itertools.product(*(range(n) for n in sizes)):
            mine = _block(x, layout, sizes, coords)
            torch.testing.assert_close(mine.reshape(_block(x.reshape(to), out, sizes, coords).shape),
                                       _block(x.reshape(to), out, sizes, coords), rtol=0, atol=0)
        taken += 1
    assert taken > 0


def test_the_loss_flatten_takes_a_sequence_split_over_cp_where_each_rank_holds_one_sequence():
    dp, cp = Shard(0), Shard(1)
    rule = view_dim_map().view_groups((4, 8, 6), (32, 6))
    # one sequence a rank: tokens split over (dp_shard, cp), block dp_rank * cp + cp_rank
    assert contiguous_view(rule, (4, 8, 6), (dp, dp, cp), (2, 2, 2)) == ((dp, dp, cp), (Shard(0),) * 3)
    # two sequences a rank: each rank's tokens are two runs (strided), so no
    assert contiguous_view(rule, (4, 8, 6), (dp, Replicate(), cp), (2, 2, 2)) is None
    # axes out of mesh order (the sequence on an outer axis): the blocks would be numbered otherwise
    assert contiguous_view(rule, (4, 8, 6), (cp, dp, dp), (2, 2, 2)) is None


def test_under_fsdp_and_cp_tokens_are_flattened_and_split_back_where_they_are():
    # batch over dp_shard, sequence over cp, one sequence a rank: the flattened tokens are the
    # rank's own, so nothing moves; DTensor's rule alone gathers the sequence over cp first
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 6, generator=g)

    def f(x):
        tokens = torch.tanh(x.flatten(0, 1)) * 2  # (tokens, features)
        return tokens, tokens.unflatten(0, (2, 8)) + 1

    expected = f(x)
    with nf.simulate(4):
        mesh = nf.make_mesh(dp_shard=2, cp=2)
        jitted = nf.jit(f, mesh=mesh, in_shardings=P("dp_shard", "cp"),
                        out_shardings=(P(("dp_shard", "cp")), P("dp_shard", "cp")))
        moved = collectives(jitted.lower(x).program.local)
        got = nf.device_get(jitted(x))
    assert moved == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.slow  # a Llama-3-shaped step lowered
def test_under_fsdp_and_cp_the_logits_are_made_for_the_ranks_own_tokens_only():
    # 2 x 32 x 4 x 4: each data-parallel rank holds one sequence, split over 4 cp ranks. The loss
    # flattens (batch, sequence) to tokens; had it gathered the sequence first, every cp rank would
    # make the logits (and their gradient) of the whole sequence: 4x the head's work, and at 70B
    # 1 GiB of fp32 a value
    from models import llama, train

    cfg, seq = llama.LlamaConfig.llama3_70b(n_layers=2, remat="full"), 4096
    config = nf.ParallelConfig(2, 32, 4, 4)
    transforms = [nf.fsdp("dp_shard"), nf.mixed_precision(torch.bfloat16, torch.float32)]
    lowered = train.lower_abstract(cfg, config, seq, transforms)
    vocab = cfg.vocab_size // config.tp_size
    by_token = [tuple(n.meta["val"].shape) for n in lowered.program.local.graph.nodes
                if isinstance(n.meta.get("val"), torch.Tensor) and vocab in n.meta["val"].shape
                and n.meta["val"].numel() // vocab in (seq, seq // config.cp_size)]
    assert by_token and all(t.count(vocab) == 1 and torch.Size(t).numel() == seq // config.cp_size * vocab
                            for t in by_token), by_token


def test_under_fsdp_over_dp_shard_and_cp_with_a_ring_no_activation_is_gathered_over_cp():
    # torchtitan's CP: the sequence stays split over cp from the embedding to the loss; only the
    # ring passes keys and values, and FSDP gathers weights (over dp_shard and cp). A search that
    # admits the contiguous views only once the rest has settled finds the MLP's and the attention
    # projections' inputs cheaper to gather over cp and split the weights there (Llama-3-8B shape,
    # 2 layers, 131,072 tokens over cp 4: 17.1 GiB sent a rank where 10.7 GiB will do; dearer by
    # the cost model too)
    from models import llama, train

    cfg, seq = llama.LlamaConfig.llama3_8b(n_layers=2, remat="full"), 131072
    transforms = [nf.fsdp(("dp_shard", "cp")), nf.mixed_precision(torch.bfloat16, torch.float32),
                  nf.ring_attention("cp")]
    lowered = train.lower_abstract(cfg, nf.ParallelConfig(1, 2, 4, 1), seq, transforms)
    over_cp = [(c.kind, tuple(getattr(node.meta["val"], "shape", ()))) for node, c in
               collectives(lowered.program.local) if c.axes == ("cp",)]
    assert any(kind == "ppermute" for kind, _ in over_cp)  # the ring
    gathered = [shape for kind, shape in over_cp if kind == "all_gather"]
    # (a dim split over cp is gathered along dim 0 and put back in place: a rank's share of the
    # sequence is then a dim of what is gathered, and no weight has a dim that long; the positions,
    # a token each, may be gathered: the rotary tables are made from them)
    activations = [shape for shape in gathered if (seq in shape or seq // 4 in shape)
                   and torch.Size(shape).numel() >= seq // 4 * cfg.dim]
    assert gathered and not activations, activations
