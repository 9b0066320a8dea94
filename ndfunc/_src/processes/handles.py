"""What the notebook holds for values that live on the workers.

An `Array` is JAX's array as a single controller sees it: shape, dtype and sharding here, the
blocks on the ranks until fetched (`nf.device_get`, `float(x)`). A `ProcessMesh` is the workers'
mesh as an `AbstractMesh` with a name on them; a `Remote` is any other object they made (a
`Lowered`, a checkpoint `Manager`), its methods run on every rank. Each pickles, on its way to the
workers, as the reference its owner gave it.
"""

from __future__ import annotations

import torch

from ndfunc._src.forward import Handle, handles_in
from ndfunc._src.sharding.mesh import AbstractMesh, enter_mesh, exit_mesh
from ndfunc._src.sharding.named_sharding import NamedSharding


class _Held(Handle):
    """A handle its owner names: released there when it dies here, never pickled but as that name."""

    __slots__ = ()

    def __del__(self):
        owner = getattr(self, "_owner", None)
        if owner is not None:
            owner.release(self._ref)

    def __reduce__(self):
        return self._owner.reference(self)


class Array(_Held):
    """A value on the workers: `shape`, `dtype` and `sharding` here, its blocks there.

    Torch functions and tensor methods applied to it run on every rank (eager, as on a DTensor)
    and give arrays; `float(x)`, `x.item()` and `nf.device_get(x)` fetch it.
    """

    __slots__ = ("_owner", "_ref", "shape", "dtype", "sharding", "__weakref__")

    def __init__(self, owner, ref, shape, dtype: torch.dtype, sharding: NamedSharding | None):
        self._owner, self._ref = owner, ref
        self.shape, self.dtype, self.sharding = torch.Size(shape), dtype, sharding

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def dim(self) -> int:
        return self.ndim

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __repr__(self) -> str:
        where = "whole on every rank" if self.sharding is None else repr(self.sharding)
        gone = "" if self._owner.holds(self) else ", gone"
        return f"Array(shape={tuple(self.shape)}, dtype={self.dtype}, sharding={where}{gone})"

    def fetch(self) -> torch.Tensor:
        """The whole value, here (gathered over the ranks)."""
        from ndfunc._src.transfer import device_get

        return device_get(self)

    def __float__(self) -> float:
        return float(self.fetch())

    def __int__(self) -> int:
        return int(self.fetch())

    def __bool__(self) -> bool:
        return bool(self.fetch())

    def __index__(self) -> int:
        return self.fetch().__index__()

    def __format__(self, spec: str) -> str:
        return format(self.fetch().item() if self.ndim == 0 else self.fetch(), spec)

    def __array__(self, dtype=None, copy=None):
        value = self.fetch().numpy()
        return value if dtype is None else value.astype(dtype)

    def item(self):
        return self.fetch().item()

    def tolist(self):
        return self.fetch().tolist()

    def numpy(self):
        return self.fetch().numpy()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owners = {a._owner for a in handles_in((args, kwargs), Array)}
        if len(owners) != 1:
            raise ValueError(f"{getattr(func, '__name__', func)} was given arrays of {len(owners)} different "
                             f"nf.processes blocks; use arrays of one block together.")
        # waited for: an op's result may take its shape from the data (a mask, `nonzero`)
        return owners.pop().call(func, args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_") or not callable(getattr(torch.Tensor, name, None)):
            raise AttributeError(f"'Array' object has no attribute {name!r}")
        method = getattr(torch.Tensor, name)
        return lambda *args, **kwargs: Array.__torch_function__(method, (Array,), (self, *args), kwargs)


def _operator(name: str):
    method = getattr(torch.Tensor, name)

    def apply(self, *args):
        return Array.__torch_function__(method, (Array,), (self, *args), {})

    apply.__name__ = name
    return apply


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__",
              "__neg__", "__abs__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__and__", "__or__", "__xor__",
              "__invert__", "__getitem__"):
    setattr(Array, _name, _operator(_name))
Array.__hash__ = Handle.__hash__  # (as a tensor: by identity, though `==` compares values)


class ProcessMesh(AbstractMesh):
    """The workers' mesh, as the controller sees it: axis names and sizes (an `AbstractMesh`, so
    `NamedSharding(mesh, P(...))` and `with mesh:` work here) naming the `Mesh` on every rank."""

    __slots__ = ("_owner", "_ref", "_device_type", "__weakref__")

    def __init__(self, owner, ref, axes, device_type: str):
        super().__init__(axes)
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_device_type", device_type)

    @property
    def device_type(self) -> str:
        return self._device_type

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessMesh) and other._owner is self._owner and other._ref == self._ref

    def __hash__(self) -> int:
        return hash(("ProcessMesh", self._ref))

    def __repr__(self) -> str:
        return f"Mesh({self.shape!r}, device_type={self._device_type!r}, on {self._owner!r})"

    __enter__ = enter_mesh
    __exit__ = exit_mesh

    def __reduce__(self):
        return self._owner.reference(self)


class Remote(_Held):
    """An object the workers made (a `Lowered`, a `Compiled`, a checkpoint `Manager`): its methods
    run on every rank, and rank 0's result comes back (arrays and objects as handles)."""

    __slots__ = ("_owner", "_ref", "_kind", "_names", "__weakref__")

    def __init__(self, owner, ref, kind: str, names: dict[str, bool]):
        self._owner, self._ref, self._kind, self._names = owner, ref, kind, names

    def __getattr__(self, name: str):
        names = object.__getattribute__(self, "_names")
        if name not in names:
            raise AttributeError(f"{object.__getattribute__(self, '_kind')!r} object has no attribute {name!r}")
        if not names[name]:  # a plain attribute: its value, read now
            return self._owner.call(getattr, (self, name), {})
        return lambda *args, **kwargs: self._owner.call_method(self, name, args, kwargs)

    def __call__(self, *args, **kwargs):
        if "__call__" not in self._names:
            raise TypeError(f"{self._kind!r} object is not callable")
        return self._owner.call_method(self, "__call__", args, kwargs, asynchronous=True)

    def __enter__(self):
        return self._owner.call_method(self, "__enter__", (), {}) and self

    def __exit__(self, *exc):
        self._owner.call_method(self, "__exit__", (None, None, None), {})

    def __repr__(self) -> str:
        return f"<{self._kind} on {self._owner!r}>"
