"""A random value laid out sharded is computed block by block: each rank generates only its own
block (numel / shards values), the same bits as the whole value on one device."""

import optree
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import ndfunc as nf
import ndfunc.random._blocks as blocks
import ndfunc.random._samplers as samplers
from models import llama
from ndfunc.sharding import P


@pytest.fixture
def generated(monkeypatch):
    """The number of values each call of the block sampler makes (run time only, not tracing)."""
    counts = []
    real = blocks.sample

    def counting(kernel, key, shape, index, *args):
        out = real(kernel, key, shape, index, *args)
        if not isinstance(out, FakeTensor):
            counts.append(out.numel())
        return out

    monkeypatch.setattr(blocks, "sample", counting)
    monkeypatch.setattr(samplers, "sample", counting)
    return counts


def test_a_sharded_normal_is_each_ranks_block_and_the_whole_values_bits(generated):
    key = nf.random.key(7)
    want = nf.random.normal(key, (8, 12))
    generated.clear()
    with nf.simulate(4):
        f = nf.jit(lambda k: nf.random.normal(k, (8, 12)) * 0.5, mesh=nf.make_mesh(a=2, b=2),
                   out_shardings=P("b", "a"))
        got = f(key)
        assert generated == [8 * 12 // 4] * 4  # one block of a quarter per rank
        assert torch.equal(nf.device_get(got), want * 0.5)
        assert f.lower(key).cost_analysis()["collectives"] == {}


def test_the_jitted_llama_init_generates_an_eighth_per_rank_with_one_devices_bits(generated):
    cfg, key = llama.LlamaConfig.tiny(), nf.random.key(0)
    want = llama.init(cfg, key)
    whole = sum(generated)
    generated.clear()
    config = nf.ParallelConfig(1, 8, 1, 1)
    with nf.simulate(8):
        mesh = config.build_mesh()
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        got = nf.jit(lambda k: llama.init(cfg, k), mesh=mesh, out_shardings=pspec)(key)
        assert sum(generated) == whole  # 8 ranks, an eighth each
        assert max(generated) * 8 <= max(p.numel() for p in optree.tree_leaves(want))
        for a, b in zip(optree.tree_leaves(nf.device_get(got)), optree.tree_leaves(want), strict=True):
            assert torch.equal(a, b)
