"""Every public namespace: each name in `__all__` imports and is what its docs say it is - a
module with a docstring and an `__all__`, a callable (function or class) with a docstring of its
own, or a documented constant - and nothing is public by accident."""

import importlib
import inspect
import types

import pytest

NAMESPACES = ["ndfunc", "ndfunc.sharding", "ndfunc.optim", "ndfunc.random", "ndfunc.lax", "ndfunc.transforms",
              "ndfunc.tree", "ndfunc.nn", "ndfunc.checkpoint", "ndfunc.plan"]
# public constants, each named in its module's docstring or beside it with what it is for
CONSTANTS = {"ndfunc.random": {"CHUNK", "COMPILE_CHUNK"}}
# type aliases: documented where they are defined, not callables of their own
ALIASES = {"ndfunc.optim": {"Schedule"}}


def own_doc(obj) -> str:
    """The object's own docstring (a class's, not its base's; a dataclass's, not its signature)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
    doc = (doc or "").strip()
    if isinstance(obj, type) and doc.startswith(f"{obj.__name__}("):  # dataclasses and NamedTuples write one
        return ""
    return doc


@pytest.mark.parametrize("module", NAMESPACES)
def test_every_public_name_is_what_its_docs_say(module):
    mod = importlib.import_module(module)
    assert mod.__doc__ and mod.__all__, module
    assert len(set(mod.__all__)) == len(mod.__all__), f"{module}.__all__ lists a name twice"
    for name in mod.__all__:
        obj = getattr(mod, name)
        where = f"{module}.{name}"
        if isinstance(obj, types.ModuleType):
            assert obj.__doc__ and hasattr(obj, "__all__"), f"{where}: a module without a docstring or __all__"
        elif name in CONSTANTS.get(module, ()):
            assert isinstance(obj, (int, float, str)), where
        elif name in ALIASES.get(module, ()):
            assert obj is not None, where
        else:
            assert callable(obj), f"{where} is a {type(obj).__name__}, not a function or class"
            assert own_doc(obj), f"{where} has no docstring of its own"


@pytest.mark.parametrize("module", NAMESPACES)
def test_nothing_is_public_by_accident(module):
    """What the module itself defines without an underscore is in `__all__`."""
    mod = importlib.import_module(module)
    extra = {n for n, v in vars(mod).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
             and (inspect.isfunction(v) or inspect.isclass(v)) and n not in mod.__all__
             and getattr(v, "__module__", "") == module}
    assert not extra, f"{module} exposes {sorted(extra)} outside __all__"


def test_the_readme_example_names():
    import ndfunc as nf
    from ndfunc.sharding import NamedSharding, P  # noqa: F401

    for name in ("simulate", "init", "rank", "world_size", "make_mesh", "set_mesh", "device_put",
                 "device_get", "make_array_from_callback", "visualize_sharding", "ParallelConfig", "jit",
                 "value_and_grad", "fsdp", "ring_attention", "mixed_precision", "remat", "accumulate"):
        assert callable(getattr(nf, name)), name
