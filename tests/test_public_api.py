import importlib

import pytest


@pytest.mark.parametrize("module", ["ndfunc", "ndfunc.sharding", "ndfunc.optim"])
def test_every_public_name_imports(module):
    mod = importlib.import_module(module)
    assert mod.__all__, module
    for name in mod.__all__:
        assert getattr(mod, name) is not None, f"{module}.{name}"


def test_the_issue_example_names():
    import ndfunc as nf
    from ndfunc.sharding import NamedSharding, P  # noqa: F401

    for name in ("simulate", "init", "rank", "world_size", "make_mesh", "set_mesh", "device_put",
                 "device_get", "make_array_from_callback", "visualize_sharding", "ParallelConfig"):
        assert callable(getattr(nf, name)), name
