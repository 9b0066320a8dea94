"""nf.shard_map and nf.lax in simulation, against the same math on whole tensors (and the
gradients of that math through torch.autograd)."""

import re

import pytest
import torch
from helpers import arange
from torch.distributed._local_tensor import rank_map

import ndfunc as nf
from ndfunc import lax
from ndfunc.sharding import NamedSharding, P

TOL = dict(rtol=1e-5, atol=1e-5)  # float32 sums in another order than the whole-tensor reference


def per_rank(tensor):
    return tensor.to_local()._local_tensors if hasattr(tensor, "to_local") else tensor._local_tensors


def test_megatron_mlp_values_and_gradients():
    gen = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(6, 8, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(16, 8, generator=gen)

    def local_loss(x, w1, w2):  # w1 column-sharded, w2 row-sharded: one psum of the activation
        y = lax.psum(torch.tanh(x @ w1) @ w2, "tp")
        return (y * y).sum()

    w1.requires_grad_(), w2.requires_grad_()
    expected = ((torch.tanh(x @ w1) @ w2) ** 2).sum()
    gw1, gw2 = torch.autograd.grad(expected, (w1, w2))
    with nf.simulate(4):
        mesh = nf.make_mesh(tp=4)
        step = nf.shard_map(local_loss, mesh, in_specs=(P(), P(None, "tp"), P("tp")), out_specs=P())
        w1d = nf.device_put(w1.detach(), NamedSharding(mesh, P(None, "tp"))).requires_grad_()
        w2d = nf.device_put(w2.detach(), NamedSharding(mesh, P("tp"))).requires_grad_()
        loss = step(x, w1d, w2d)
        torch.testing.assert_close(nf.device_get(loss), expected.detach(), **TOL)
        loss.backward()
        torch.testing.assert_close(nf.device_get(w1d.grad), gw1, **TOL)
        torch.testing.assert_close(nf.device_get(w2d.grad), gw2, **TOL)


def test_fsdp_style_gather_and_its_gradient():
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(8, 4, generator=gen), torch.randn(12, 8, generator=gen)
    w.requires_grad_()
    expected = ((x @ w) ** 2).sum()
    (gw,) = torch.autograd.grad(expected, (w,))

    def local_loss(w_shard, x_shard):  # gather the weight, use it on this rank's batch rows, sum up
        w_full = lax.all_gather(w_shard, "dp", dim=0, tiled=True)
        return lax.psum(((x_shard @ w_full) ** 2).sum(), "dp")

    with nf.simulate(4):
        mesh = nf.make_mesh(dp=4)
        wd = nf.device_put(w.detach(), NamedSharding(mesh, P("dp"))).requires_grad_()
        loss = nf.shard_map(local_loss, mesh, in_specs=(P("dp"), P("dp")), out_specs=P())(wd, x)
        torch.testing.assert_close(nf.device_get(loss), expected.detach(), **TOL)
        loss.backward()  # the gather's transpose is a reduce-scatter of the weight's gradient
        torch.testing.assert_close(nf.device_get(wd.grad), gw, **TOL)


def test_collectives_on_per_rank_values():
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        with nf.lax._manual_axes(mesh):
            x = rank_map(lambda r: torch.tensor([float(r), 10.0 + r]))
            assert [t.tolist() for t in per_rank(lax.psum(x, "tp")).values()] == [[1, 21], [1, 21], [5, 25], [5, 25]]
            assert per_rank(lax.pmean(x, ("dp", "tp")))[3].tolist() == [1.5, 11.5]
            assert per_rank(lax.pmax(x, "dp"))[1].tolist() == [3, 13]
            gathered = per_rank(lax.all_gather(x, "dp"))  # untiled: a new leading dim, dp order
            assert gathered[1].tolist() == [[1, 11], [3, 13]]
            assert per_rank(lax.all_gather(x, "tp", tiled=True))[2].tolist() == [2, 12, 3, 13]
            scattered = per_rank(lax.psum_scatter(x, "tp", tiled=True))  # sum over tp, element i to tp=i
            assert [scattered[r].tolist() for r in range(4)] == [[1], [21], [5], [25]]
            assert [int(v) for v in per_rank(lax.axis_index("tp")).values()] == [0, 1, 0, 1]
            assert [int(per_rank(lax.axis_index(("dp", "tp")))[r]) for r in range(4)] == [0, 1, 2, 3]
            assert lax.axis_size(("dp", "tp")) == 4
            ring = per_rank(lax.ppermute(x, ("dp", "tp"), [(i, (i + 1) % 4) for i in range(4)]))
            assert [ring[r][0].item() for r in range(4)] == [3, 0, 1, 2]
            partial = per_rank(lax.ppermute(x, "tp", [(0, 1)]))  # position 0 receives nothing: zeros
            assert partial[0].tolist() == [0, 0] and partial[1].tolist() == [0, 10]


def test_all_to_all_matches_the_block_transpose():
    full = arange((4, 8))  # rank r holds row r; columns split in 4 blocks of 2
    with nf.simulate(4):
        mesh = nf.make_mesh(x=4)
        with nf.lax._manual_axes(mesh):
            x = rank_map(lambda r: full[r:r + 1].clone())
            out = per_rank(lax.all_to_all(x, "x", split_dim=1, concat_dim=0, tiled=True))
            for r in range(4):  # rank r ends with column block r of every row
                assert torch.equal(out[r], full[:, 2 * r:2 * r + 2])
            untiled = per_rank(lax.all_to_all(rank_map(lambda r: full[r].reshape(4, 2).clone()), "x", 0, 0))
            for r in range(4):
                assert torch.equal(untiled[r], full[:, 2 * r:2 * r + 2])


def test_gradients_of_permute_and_all_to_all_are_their_inverses():
    gen = torch.Generator().manual_seed(2)
    x, c = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)

    def ring_loss(x, c):  # rank i's block moves to i+1, then meets c's block there
        return lax.psum((lax.ppermute(x, "x", [(i, (i + 1) % 4) for i in range(4)]) * c).sum(), "x")

    x.requires_grad_()
    expected = (x.reshape(4, 2, 4).roll(1, 0).reshape(8, 4) * c).sum()
    (gx,) = torch.autograd.grad(expected, (x,))
    with nf.simulate(4):
        mesh = nf.make_mesh(x=4)
        xd = nf.device_put(x.detach(), NamedSharding(mesh, P("x"))).requires_grad_()
        loss = nf.shard_map(ring_loss, mesh, in_specs=(P("x"), P("x")), out_specs=P())(xd, c)
        torch.testing.assert_close(nf.device_get(loss), expected.detach(), **TOL)
        loss.backward()
        torch.testing.assert_close(nf.device_get(xd.grad), gx, **TOL)
        # inside nf.jit: one block sent per rank each way (the permute, then its inverse for the
        # gradient), not a gather of every block
        step = nf.jit(nf.value_and_grad(nf.shard_map(ring_loss, mesh, in_specs=(P("x"), P("x")), out_specs=P())),
                      mesh=mesh, in_shardings=(P("x"), P("x")))
        costs = step.lower(x.detach(), c).cost_analysis()
        block = 2 * 4 * 4  # bytes of one rank's (2, 4) block
        assert costs["collectives"].get("all_gather", 0) == 0 and costs["collectives"]["ppermute"] == 2
        assert costs["comm_bytes"]["ppermute"] == 2 * block
        loss, grad = step(x.detach(), c)
        torch.testing.assert_close(nf.device_get(loss), expected.detach(), **TOL)
        torch.testing.assert_close(nf.device_get(grad), gx, **TOL)

        def swap_loss(x, c):  # rows sharded in, columns sharded out
            return lax.psum((lax.all_to_all(x, "x", split_dim=1, concat_dim=0, tiled=True) * c).sum(), "x")

        xd.grad = None
        loss = nf.shard_map(swap_loss, mesh, in_specs=(P("x"), P(None, "x")), out_specs=P())(xd, c)
        torch.testing.assert_close(nf.device_get(loss), (x * c).sum().detach(), **TOL)
        loss.backward()
        torch.testing.assert_close(nf.device_get(xd.grad), c, **TOL)


def test_outputs_take_their_out_specs():
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        double = nf.shard_map(lambda x: x * 2, mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))
        y = double(arange((4, 6)))
        assert nf.sharding_of(y).spec == P("dp", "tp") and torch.equal(nf.device_get(y), arange((4, 6)) * 2)
        with mesh:  # the mesh from the context
            assert torch.equal(nf.device_get(nf.shard_map(lambda x: x, in_specs=P(), out_specs=P())(arange((2,)))), arange((2,)))


def test_errors():
    with pytest.raises(RuntimeError, match=r"nf.lax.psum runs per rank over a named mesh axis, so it belongs inside a function mapped by nf.shard_map"):
        lax.psum(torch.ones(2), "tp")
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        with nf.lax._manual_axes(mesh):
            with pytest.raises(ValueError, match=r"axis_name 'cp' is not an axis of the shard_map's mesh, whose axes are \('dp', 'tp'\)"):
                lax.psum(torch.ones(2), "cp")
            with pytest.raises(ValueError, match=r"lists mesh axes out of mesh order; write them as the mesh orders them: \('dp', 'tp'\)"):
                lax.psum(torch.ones(2), ("tp", "dp"))
            with pytest.raises(ValueError, match=r"perm \[\(0, 1\), \(1, 1\)\] must pair distinct sources with distinct destinations"):
                lax.ppermute(torch.ones(2), "tp", [(0, 1), (1, 1)])
        with pytest.raises(TypeError, match=r"in_specs at '0' is 'tp'; expected a P\(...\)"):
            nf.shard_map(lambda x: x, mesh, in_specs=("tp",), out_specs=P())(torch.ones(4))
    with pytest.raises(Exception, match=r"nf.shard_map needs a mesh of ranks"):
        nf.shard_map(lambda x: x, in_specs=P(), out_specs=P())(torch.ones(2))


def test_an_input_every_rank_holds_gets_the_sum_of_its_cotangents():
    gen = torch.Generator().manual_seed(3)
    w, c = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    w.requires_grad_()
    expected = (w * c).sum()
    (gw,) = torch.autograd.grad(expected, (w,))

    def local_loss(w, c_block):  # w is whole on every rank; each rank uses its column block of it
        mine = lax.all_to_all(w, "x", split_dim=1, concat_dim=1, tiled=True)
        index = lax.axis_index("x")
        block = mine.unflatten(1, (3, 2)).index_select(1, index.reshape(1)).squeeze(1)
        return lax.psum((block * c_block).sum(), "x")

    with nf.simulate(3):
        mesh = nf.make_mesh(x=3)
        wd = nf.device_put(w.detach(), NamedSharding(mesh, P())).requires_grad_()
        loss = nf.shard_map(local_loss, mesh, in_specs=(P(), P(None, "x")), out_specs=P())(wd, c)
        torch.testing.assert_close(nf.device_get(loss), expected.detach(), **TOL)
        loss.backward()
        torch.testing.assert_close(nf.device_get(wd.grad), gw, **TOL)


@pytest.mark.parametrize("a,b", [(2, 2), (4, 2), (2, 4)])
def test_a_reshard_trading_two_axes_dims_sends_one_block_per_rank(a, b):
    # of one size: each block to one rank; one axis twice the other: each block in halves, to two
    x = torch.arange(64.0).reshape(8, 8)
    with nf.simulate(a * b):
        mesh = nf.make_mesh(a=a, b=b)
        swap = nf.jit(lambda x: x, mesh=mesh, in_shardings=P("a", "b"), out_shardings=P("b", "a"))
        costs = swap.lower(x).cost_analysis()
        assert set(costs["collectives"]) == {"ppermute"}  # not two gathers
        assert costs["comm_bytes"]["ppermute"] == 64 // (a * b) * 4  # one block per rank
        got = swap(x)
        assert torch.equal(nf.device_get(got), x)  # every element where DTensor's layout puts it
        assert tuple(got.placements) == nf.sharding.spec_to_placements(mesh, P("b", "a"))


CHECKED = [  # (what the function does, it, where its result is declared the same, the axes it varies along)
    ("its input as it came", lambda x: x * 2.0, P(), ["dp"]),
    ("a sum over its rows", lambda x: x.sum(0), P(), ["dp"]),
    ("its position", lambda x: x[:, 0] * 0 + lax.axis_index("tp"), P("dp"), ["tp"]),
    ("a psum_scatter", lambda x: lax.psum_scatter(lax.psum(x, "dp"), "tp", dim=1, tiled=True), P(), ["tp"]),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fn,out_spec,along", [c[1:] for c in CHECKED], ids=[c[0] for c in CHECKED])
def test_a_result_declared_the_same_where_it_varies_is_refused_as_jaxs_check_vma_does(fn, out_spec, along, jit):
    x = torch.randn(4, 8)
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)

        def mapped(check_vma):
            g = nf.shard_map(fn, mesh, in_specs=(P("dp"),), out_specs=out_spec, check_vma=check_vma)
            return (nf.jit(g, mesh=mesh) if jit else g)(x)

        with pytest.raises(nf.sharding.ShardingError, match=re.escape(
                f"nf.shard_map(<lambda>): out_specs {out_spec!r} at 'the root' says the result is the same on every "
                f"rank along {along}, but it varies along them (it comes from an input split over them, or from "
                "axis_index, psum_scatter, ppermute or all_to_all over them, and nothing reduced it there). Reduce "
                "it over them (nf.lax.psum, pmean, pmax or all_gather), name them in out_specs, or pass "
                "check_vma=False where it is the same on every rank by a route ndfunc does not follow.")):
            mapped(True)
        # and it does vary: unchecked, the ranks along those axes hold different blocks
        blocks = per_rank(mapped(False))
        coords = [mesh.coordinate(r) for r in range(4)]
        axis = mesh.axis_names.index(along[0])
        assert any(not torch.equal(blocks[a], blocks[b]) for a in range(4) for b in range(4)
                   if coords[a][axis] != coords[b][axis] and all(coords[a][i] == coords[b][i] for i in range(2) if i != axis))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_results_reduced_over_the_axes_their_specs_leave_out_pass_the_check_and_are_the_same_there(jit):
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)

        def fn(x, w):
            y = x @ w  # varies along dp (x) and tp (w)
            return lax.psum(y.sum(0), "dp"), lax.all_gather(lax.pmean(y, "dp"), "tp", dim=1, tiled=True), w * 3

        g = nf.shard_map(fn, mesh, in_specs=(P("dp"), P(None, "tp")), out_specs=(P("tp"), P(), P(None, "tp")))
        total, whole, scaled = (nf.jit(g, mesh=mesh) if jit else g)(x, w)
        torch.testing.assert_close(nf.device_get(total), (x @ w).sum(0))
        torch.testing.assert_close(nf.device_get(whole), (x @ w).reshape(2, 2, 6).mean(0))
        torch.testing.assert_close(nf.device_get(scaled), w * 3)
