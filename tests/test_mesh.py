import pytest
import torch
import torch.distributed as dist

import ndfunc as nf
from ndfunc.sharding import (
    AbstractMesh,
    NamedSharding,
    P,
    ShardingError,
    UnknownAxisError,
)


def test_abstract_mesh():
    mesh = AbstractMesh({"dp_shard": 4, "tp": 2})
    assert mesh.axis_names == ("dp_shard", "tp")
    assert mesh.shape == {"dp_shard": 4, "tp": 2}
    assert mesh.size == 8 and mesh.axis_size("tp") == 2
    assert mesh.coordinate(5) == (2, 1)  # row-major, last axis fastest
    assert mesh == AbstractMesh([("dp_shard", 4), ("tp", 2)])
    assert mesh != AbstractMesh({"tp": 2, "dp_shard": 4})  # order matters
    assert repr(mesh) == "AbstractMesh({'dp_shard': 4, 'tp': 2})"
    mesh.shape["tp"] = 9
    assert mesh.axis_size("tp") == 2
    import numpy as np

    assert AbstractMesh({"dp": np.int64(2)}) == AbstractMesh({"dp": 2})  # numpy ints are integers
    assert AbstractMesh((4, 2), ("dp_shard", "tp")) == mesh  # JAX's form: sizes, then names
    with pytest.raises(ShardingError, match=r"^AbstractMesh got 2 sizes \(4, 2\) for 1 axis names \('dp',\); give one "
                                            r"size per name\.$"):
        AbstractMesh((4, 2), ("dp",))


@pytest.mark.parametrize(
    "shape, message",
    [
        ({"dp": 0}, "mesh axis 'dp' has size 0 of type int; sizes must be integers >= 1"),
        ({"": 2}, "mesh axis names must be non-empty strings, got ''"),
        ([("dp", 2), ("dp", 2)], "mesh axis 'dp' appears twice"),
        ({"dp": 2.0}, "mesh axis 'dp' has size 2.0 of type float"),
    ],
)
def test_abstract_mesh_validates(shape, message):
    with pytest.raises(ShardingError, match=message):
        AbstractMesh(shape)


def test_unknown_axis_size():
    with pytest.raises(UnknownAxisError, match=r"mesh has no axis 'cp'; its axes are \('dp', 'tp'\)"):
        AbstractMesh({"dp": 2, "tp": 2}).axis_size("cp")


def test_make_mesh_in_simulation():
    with nf.simulate(8):
        mesh = nf.make_mesh({"dp_shard": 4, "tp": 2})
        assert mesh.axis_names == ("dp_shard", "tp") and mesh.size == 8
        assert mesh.abstract == AbstractMesh({"dp_shard": 4, "tp": 2})
        assert mesh.device_mesh.mesh.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert nf.make_mesh(dp=8).shape == {"dp": 8}


def test_make_mesh_wrong_world_size():
    with nf.simulate(8):
        with pytest.raises(ShardingError, match="mesh dp=4 x tp=4 has 16 ranks but the world has 8; choose axis sizes whose product is 8"):
            nf.make_mesh(dp=4, tp=4)


def test_make_mesh_without_ranks():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"make_mesh found no ranks: run inside `with nf.simulate\(n\):`"):
        nf.make_mesh(dp=1)


def test_bare_specs_under_a_mesh():
    mesh = AbstractMesh({"tp": 2})
    from ndfunc._src.sharding.named_sharding import resolve_sharding

    with pytest.raises(ShardingError, match=r"a bare P\('tp'\) needs a mesh: wrap the call in `with mesh:`"):
        resolve_sharding(P("tp"))
    with nf.set_mesh(mesh):
        assert nf.get_mesh() is mesh
        assert resolve_sharding(P("tp")) == NamedSharding(mesh, P("tp"))
    assert nf.get_mesh() is None


def test_with_mesh_nests_and_restores():
    with nf.simulate(4):
        outer, inner = nf.make_mesh(dp=4), nf.make_mesh(dp=2, tp=2)
        with outer:
            with inner:
                assert nf.get_mesh() is inner
            assert nf.get_mesh() is outer
        assert nf.get_mesh() is None


def test_set_mesh_without_with_lasts_until_replaced():
    import contextvars

    def body():
        mesh = AbstractMesh({"dp": 2})
        nf.set_mesh(mesh)  # a plain call, as in a notebook cell
        assert nf.get_mesh() is mesh
        with nf.set_mesh(AbstractMesh({"tp": 2})) as inner:
            assert nf.get_mesh() is inner
        assert nf.get_mesh() is mesh

    contextvars.copy_context().run(body)  # a fresh context, so this test leaves none behind
    assert nf.get_mesh() is None
    with pytest.raises(TypeError, match="set_mesh expects a Mesh or AbstractMesh, got dict"):
        nf.set_mesh({"dp": 2})


def test_simulate_drops_meshes_made_inside():
    with nf.simulate(8):
        mesh = nf.make_mesh(dp=8)
        nf.set_mesh(mesh)  # a plain call, never undone by the user
        with mesh:  # and a block still open when the simulation stops (notebook style)
            pass
    assert nf.get_mesh() is None
    with nf.simulate(8):
        with pytest.raises(RuntimeError, match=r"Mesh\(\{'dp': 8\}, device_type='cpu'\) belongs to ranks that no longer exist \(its nf.simulate block ended"):
            nf.device_put(torch.zeros(8), NamedSharding(mesh, P("dp")))


def test_mesh_must_span_the_world_in_order():
    from ndfunc.sharding import Mesh

    with nf.simulate(4):
        mesh = nf.make_mesh(dp=2, tp=2)
        with pytest.raises(ShardingError, match=r"a Mesh must hold ranks 0..1 in row-major order, but this DeviceMesh holds \[0, 2\]"):
            Mesh(AbstractMesh({"dp": 2}), mesh.device_mesh["dp"])
        with pytest.raises(ShardingError, match="does not match AbstractMesh.*; build meshes with nf.make_mesh"):
            Mesh(AbstractMesh({"x": 4}), mesh.device_mesh)
