"""How calls and results cross between the notebook and the workers: pickles whose persistent ids
stand for what lives on the other side.

Going out, a handle (`Array`, `ProcessMesh`, `Remote`) or a twinned object (an `nf.jit` step, sent
by value once and named after) becomes `("ref", ref)`; the notebook's own functions and closures go
by value (cloudpickle). Coming back, each tensor, mesh and object a worker made stays there and
becomes a descriptor the notebook turns into a handle; plain data (numbers, strings, specs, frozen
dataclasses such as `MemoryAnalysis`, matplotlib figures) comes back as it is.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import io
import numbers
import pathlib
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ndfunc._src.sharding.mesh import AbstractMesh
from ndfunc._src.sharding.named_sharding import NamedSharding
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.sharding.shape_dtype import ShapeDtypeStruct

_VALUES = (type(None), bool, numbers.Number, str, bytes, tuple, list, dict, set, frozenset, slice, range,
           torch.dtype, torch.device, torch.Size, torch.Generator, PartitionSpec, AbstractMesh, NamedSharding,
           ShapeDtypeStruct, enum.Enum, pathlib.PurePath, type, BaseException, types.FunctionType,
           types.BuiltinFunctionType)


def is_value(obj: Any) -> bool:
    """Whether `obj` crosses by value: data, not something that holds a rank's state."""
    if isinstance(obj, _VALUES):
        return True
    cls = type(obj)
    if dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen:
        return True
    module = cls.__module__ or ""
    return module.split(".")[0] in ("numpy", "matplotlib", "PIL")


@functools.cache
def _pickler() -> type:
    """cloudpickle's Pickler with persistent ids and ndfunc's globals by name (cloudpickle comes
    with Monarch, in ndfunc[notebook]: imported when a block first sends something)."""
    import cloudpickle

    class Out(cloudpickle.Pickler):
        def __init__(self, file, persistent: Callable[[Any], Any]):
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self._persistent = persistent
            self._globals = _library_globals()

        def persistent_id(self, obj):
            return self._persistent(obj)

        def reducer_override(self, obj):
            # ndfunc's own module globals (a context variable, a cache) that a closure of ndfunc's
            # reads cross by name: the worker's own, never a copy of this process's
            where = self._globals.get(id(obj))
            if where is not None and where[2] is obj:
                return (_module_global, where[:2])
            return super().reducer_override(obj)

    return Out


_INDEX: dict = {"modules": -1, "globals": {}}


def _library_globals() -> dict[int, tuple[str, str, Any]]:
    """id -> (module, name, object) of every mutable or unpicklable global of ndfunc's modules."""
    if _INDEX["modules"] != len(sys.modules):
        found = {}
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == "ndfunc" or module_name.startswith("ndfunc.")):
                continue
            for name, value in list(vars(module).items()):
                if not isinstance(value, (type, types.ModuleType, types.FunctionType, str, bytes, numbers.Number,
                                          bool, type(None), tuple, frozenset)):
                    found[id(value)] = (module_name, name, value)
        _INDEX.update(modules=len(sys.modules), globals=found)
    return _INDEX["globals"]


def _module_global(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(module), name)


class _In(pickle.Unpickler):
    def __init__(self, file, load: Callable[[Any], Any]):
        super().__init__(file)
        self._load = load

    def persistent_load(self, pid):
        return self._load(pid)


def dumps(obj: Any, persistent: Callable[[Any], Any] = lambda obj: None) -> bytes:
    buffer = io.BytesIO()
    _pickler()(buffer, persistent).dump(obj)
    return buffer.getvalue()


def loads(data: bytes, load: Callable[[Any], Any] | None = None) -> Any:
    if load is None:
        return pickle.loads(data)
    return _In(io.BytesIO(data), load).load()
