import sys

import pytest
import torch
import torch.distributed as dist
from helpers import arange
from torch.distributed._local_tensor import local_tensor_mode
from torch.distributed.tensor import DTensor

import ndfunc as nf
from ndfunc.sharding import IndivisibleError, NamedSharding, P, ShardingError


def test_simulate_leaves_no_state_behind():
    from torch.distributed.tensor import _random

    tracker, hook = _random._rng_tracker, sys.excepthook
    with nf.simulate(4):
        assert nf.world_size() == 4 and nf.rank() == 0 and nf.is_simulated()
        assert dist.is_initialized() and local_tensor_mode() is not None
        x = nf.device_put(torch.ones(4), NamedSharding(nf.make_mesh(dp=4), P("dp")))
        assert isinstance(x, DTensor)
    assert not dist.is_initialized()
    assert local_tensor_mode() is None and not nf.is_simulated()
    assert _random._rng_tracker is tracker
    assert sys.excepthook is hook  # (torch's process group wraps it to prefix "[rank0]: ", once a simulation)
    assert nf.world_size() == 1 and nf.get_mesh() is None
    with nf.simulate(2):  # and it can start again
        assert nf.world_size() == 2


def test_simulate_tears_down_on_error():
    with pytest.raises(KeyError):
        with nf.simulate(2):
            raise KeyError("boom")
    assert not dist.is_initialized() and local_tensor_mode() is None


def test_simulate_refuses_to_nest():
    with nf.simulate(2):
        with pytest.raises(RuntimeError, match=r"simulate\(4\) needs a process with no process group, but one of world size 2"):
            with nf.simulate(4):
                pass
    with pytest.raises(ValueError, match="simulate needs a number of ranks >= 1, got 0"):
        with nf.simulate(0):
            pass


def test_init_inside_simulation_is_a_no_op():
    with nf.simulate(2):
        nf.init()
        assert nf.world_size() == 2


def test_ranks_can_hold_different_values():
    from torch.distributed._local_tensor import rank_map

    full = arange((8, 2))
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=4)
        x = rank_map(lambda r: full + 100 * r)  # rank r holds full + 100 r
        blocks = nf.device_put(x, NamedSharding(mesh, P("dp"))).to_local()._local_tensors
        for r in range(4):
            assert torch.equal(blocks[r], (full + 100 * r)[2 * r: 2 * r + 2])
        replicated = nf.device_put(x, NamedSharding(mesh, P()))
        with pytest.raises(AssertionError, match=r"^the simulated ranks hold different values for a tensor that is "
                           r"the same on every rank \(replicated\): there is no single value to return$"):
            nf.device_get(replicated)


def test_make_array_from_callback_asks_each_rank_for_its_block_only():
    full = arange((8, 6))
    asked = []

    def block(index):
        asked.append(index)
        return full[index]

    with nf.simulate(8):
        mesh = nf.make_mesh(dp=4, tp=2)
        sharding = NamedSharding(mesh, P("dp", "tp"))
        x = nf.make_array_from_callback(full.shape, sharding, block)
        assert asked == sharding.shard_indices(full.shape)  # once per rank, in rank order
        assert tuple(x.shape) == (8, 6) and x.to_local().shape == (2, 3)
        assert torch.equal(nf.device_get(x), full)


def test_make_array_from_callback_checks_block_shapes():
    with nf.simulate(2):
        sharding = NamedSharding(nf.make_mesh(dp=2), P("dp"))
        with pytest.raises(ShardingError, match=r"rank 0's block has shape \(4,\), but the sharding gives each rank a block of shape \(2,\)"):
            nf.make_array_from_callback((4,), sharding, lambda index: torch.zeros(4))


def test_device_put_trees_with_prefix_shardings():
    params = {"embed": arange((8, 4)), "layers": [arange((4, 4)), arange((4,))], "step": torch.tensor(3)}
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        with mesh:
            out = nf.device_put(params, {"embed": P("tp", "dp"), "layers": P("dp"), "step": P()})
        assert out["layers"][0].placements == NamedSharding(mesh, P("dp")).placements
        back = nf.device_get(out)
        for a, b in zip(torch.utils._pytree.tree_leaves(back), torch.utils._pytree.tree_leaves(params)):
            assert type(a) is torch.Tensor and torch.equal(a, b)
        one = nf.device_put(params, NamedSharding(mesh, P()))  # one sharding for the whole tree
        assert all(s.spec == P() for s in map(nf.sharding_of, torch.utils._pytree.tree_leaves(one)))


def test_device_put_errors_name_the_path():
    params = {"layers": [{"wq": arange((6, 4))}]}
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=4)
        with pytest.raises(IndivisibleError, match=r"^'layers.0.wq': dim 0 of shape \(6, 4\) has size 6"):
            nf.device_put(params, NamedSharding(mesh, P("dp")))
        with pytest.raises(ValueError, match=r"shardings has no entry for 'layers'; shardings has an entry for 'embed', which is not in values \(shardings has keys \['embed'\]; values: \['layers'\]\) at the root"):
            nf.device_put(params, {"embed": NamedSharding(mesh, P())})
        with pytest.raises(ShardingError, match=r"'layers.0.wq': a bare P\('dp'\) needs a mesh"):
            nf.device_put(params, P("dp"))
        with pytest.raises(TypeError, match=r"'layers.0.wq': expected a NamedSharding or a PartitionSpec, got 'dp'"):
            nf.device_put(params, "dp")


def test_device_put_does_not_make_a_whole_value_unreduced():
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        with pytest.raises(ShardingError) as e:
            nf.device_put({"g": arange((4, 2))}, NamedSharding(mesh, P(unreduced="dp")))
        parts = nf.make_array_from_callback((4, 2), NamedSharding(mesh, P(unreduced="dp")), lambda i: arange((4, 2)))
        again = nf.device_put(parts, NamedSharding(mesh, P(unreduced="dp")))  # already so: it stays so
        assert again.placements == parts.placements
        torch.testing.assert_close(nf.device_get(again), 2 * arange((4, 2)))  # the value is the sum of the parts
    assert str(e.value) == ("'g': device_put cannot lay a value out as P(unreduced={'dp'}): a whole value has no parts "
                            "of a sum to keep. Lay it out without unreduced; unreduced values come from nf.jit "
                            "(out_shardings) or make_array_from_callback, each rank giving its part.")


def test_device_put_copies():
    full = arange((4, 4))
    with nf.simulate(2):
        x = nf.device_put(full, NamedSharding(nf.make_mesh(dp=2), P()))
        full.add_(1)  # the caller's tensor changes; the placed value does not
        assert torch.equal(nf.device_get(x), arange((4, 4)))


def test_start_and_stop_for_notebooks():
    sim = nf.simulate(2).start()
    try:
        assert nf.world_size() == 2 and repr(sim) == "simulate(2)"
        with pytest.raises(RuntimeError, match=r"this simulate\(2\) is already running"):
            sim.start()
    finally:
        sim.stop()
    sim.stop()  # stopping twice is harmless
    assert not dist.is_initialized() and local_tensor_mode() is None


def test_device_put_moves_a_dtensor_to_another_mesh():
    full = arange((8, 4))
    with nf.simulate(8):
        x = nf.device_put(full, NamedSharding(nf.make_mesh(dp=8), P("dp")))
        mesh = nf.make_mesh(dp=2, tp=4)
        y = nf.device_put(x, NamedSharding(mesh, P("tp", "dp")))
        assert y.device_mesh == mesh.device_mesh
        assert torch.equal(y.to_local()._local_tensors[5], full[2:4, 2:4])  # rank 5 = (dp 1, tp 1)
        with pytest.raises(IndivisibleError, match=r"dim 1 of shape \(8, 4\) has size 4, which P\(None, \('dp', 'tp'\)\)"):
            nf.device_put(y, NamedSharding(mesh, P(None, ("dp", "tp"))))


def test_device_put_none_leaves_values_as_they_are():
    params = {"w": arange((4, 4)), "b": arange((4,))}
    with nf.simulate(2):
        mesh = nf.make_mesh(dp=2)
        out = nf.device_put(params, {"w": NamedSharding(mesh, P("dp")), "b": None})
        assert out["b"] is params["b"] and isinstance(out["w"], DTensor)


def test_placing_needs_a_mesh_of_ranks():
    from ndfunc.sharding import AbstractMesh

    with pytest.raises(ShardingError, match=r"placing values needs a sharding over a Mesh of ranks, got one over AbstractMesh\(\{'dp': 2\}\)"):
        nf.make_array_from_callback((4,), NamedSharding(AbstractMesh({"dp": 2}), P("dp")), lambda i: torch.zeros(2))


def test_bare_spec_with_unknown_axis_names_the_path():
    from ndfunc.sharding import UnknownAxisError

    with nf.simulate(2):
        with nf.make_mesh(dp=2):
            with pytest.raises(UnknownAxisError, match=r"^'layers.wq': P\('data'\) names mesh axis 'data'"):
                nf.device_put({"layers": {"wq": torch.zeros(2)}}, P("data"))


def test_blocks_of_one_value_share_a_dtype():
    with nf.simulate(2):
        sharding = NamedSharding(nf.make_mesh(dp=2), P("dp"))
        dtypes = iter([torch.float32, torch.float64])
        with pytest.raises(ShardingError, match=r"the ranks' blocks have different dtypes \['torch.float32', 'torch.float64'\]"):
            nf.make_array_from_callback((4,), sharding, lambda i: torch.zeros(2, dtype=next(dtypes)))


def test_an_explicit_generator_draws_as_on_real_ranks():
    # on real ranks each process holds its own identically seeded generator: every rank draws the
    # numbers one process draws, and the stream goes on from there
    g = torch.Generator().manual_seed(0)
    expected = [torch.randn(3, generator=g), torch.randperm(6, generator=g), torch.empty(4).normal_(generator=g),
                torch.randn(2, generator=g)]
    with nf.simulate(4):
        g = torch.Generator().manual_seed(0)
        drawn = [torch.randn(3, generator=g), torch.randperm(6, generator=g), torch.empty(4).normal_(generator=g),
                 torch.randn(2, generator=g)]
        for got, want in zip(drawn, expected):
            assert sorted(got._local_tensors) == [0, 1, 2, 3]
            for block in got._local_tensors.values():
                assert torch.equal(block, want)
