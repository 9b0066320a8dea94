"""Meshes: named axes over ranks.

`AbstractMesh` is names and sizes only, device-free: tracing, propagation and planning use it.
`Mesh` pairs one with a torch `DeviceMesh` over the current ranks (real or simulated), the way
JAX keeps `AbstractMesh` beside `Mesh`. Ranks lie on the mesh row-major: rank = flat index of its
coordinate, the last axis varying fastest.
"""

from __future__ import annotations

import contextvars
import math
import numbers
import weakref
from collections.abc import Mapping, Sequence

from ndfunc._src.forward import on_workers
from ndfunc._src.sharding.errors import ShardingError, UnknownAxisError

AxisShape = Mapping[str, int] | Sequence[tuple[str, int]]


class AbstractMesh:
    """Ordered axis names and sizes, with no devices behind them: `AbstractMesh({'dp_shard': 4,
    'tp': 2})`, or JAX's form, sizes then names: `AbstractMesh((4, 2), ('dp_shard', 'tp'))`.

    Example:
        >>> m = AbstractMesh({'dp_shard': 4, 'tp': 2})
        >>> m.axis_names, m.size, m.axis_size('tp'), m == AbstractMesh((4, 2), ('dp_shard', 'tp'))
        (('dp_shard', 'tp'), 8, 2, True)
    """

    __slots__ = ("_axes",)
    _axes: tuple[tuple[str, int], ...]

    def __init__(self, shape: AxisShape | Sequence[int], axis_names: Sequence[str] | None = None):
        if axis_names is not None:  # JAX's AbstractMesh(axis_sizes, axis_names)
            sizes, names = tuple(shape), tuple(axis_names)
            if len(sizes) != len(names):
                raise ShardingError(f"AbstractMesh got {len(sizes)} sizes {sizes!r} for {len(names)} axis names "
                                    f"{names!r}; give one size per name.")
            shape = tuple(zip(names, sizes))
        items = tuple(shape.items()) if isinstance(shape, Mapping) else tuple(shape)
        seen: set[str] = set()
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ShardingError(
                    f"mesh shape must map axis names to sizes, got the entry {item!r}; "
                    f"write AbstractMesh({{'dp_shard': 4, 'tp': 2}})."
                )
            name, size = item
            if not isinstance(name, str) or not name:
                raise ShardingError(f"mesh axis names must be non-empty strings, got {name!r}.")
            if name in seen:
                raise ShardingError(f"mesh axis {name!r} appears twice in {items!r}; names must be unique.")
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise ShardingError(
                    f"mesh axis {name!r} has size {size!r} of type {type(size).__name__}; sizes must "
                    f"be integers >= 1."
                )
            seen.add(name)
        object.__setattr__(self, "_axes", tuple((name, int(size)) for name, size in items))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._axes)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self._axes)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in mesh order (a fresh dict; the mesh itself never changes)."""
        return dict(self._axes)

    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes)

    @property
    def abstract(self) -> "AbstractMesh":
        return self

    def axis_size(self, name: str) -> int:
        for axis, size in self._axes:
            if axis == name:
                return size
        raise UnknownAxisError(
            f"mesh has no axis {name!r}; its axes are {self.axis_names} (shape {self.shape})."
        )

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of a rank (row-major, last axis fastest)."""
        coord = []
        for size in reversed(self.axis_sizes):
            rank, index = divmod(rank, size)
            coord.append(index)
        return tuple(reversed(coord))

    def rank_of(self, coord) -> int:
        """The rank at a mesh coordinate (`coordinate`'s inverse)."""
        return rank_at(coord, self.axis_sizes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AbstractMesh) and type(other) is AbstractMesh and self._axes == other._axes

    def __hash__(self) -> int:
        return hash(("AbstractMesh", self._axes))

    def __repr__(self) -> str:
        return f"AbstractMesh({self.shape!r})"

    def __reduce__(self):
        return (AbstractMesh, (self._axes,))


def enter_mesh(mesh):
    """`with mesh:`: the mesh bare `P`s refer to until the block ends (a mesh's `__enter__`)."""
    _entered.set(_entered.get() + (set_mesh(mesh),))
    return mesh


def exit_mesh(mesh, *exc) -> None:
    entered = _entered.get()
    _entered.set(entered[:-1])
    entered[-1].__exit__(*exc)


class Mesh:
    """An `AbstractMesh` over the ranks of a torch `DeviceMesh`.

    Build one with `nf.make_mesh`. `with mesh:` makes it the mesh that bare `P`s refer to.
    """

    __slots__ = ("_abstract", "_device_mesh", "_world")

    def __init__(self, abstract: AbstractMesh, device_mesh):
        if tuple(device_mesh.mesh_dim_names or ()) != abstract.axis_names or tuple(
            device_mesh.shape
        ) != abstract.axis_sizes:
            raise ShardingError(
                f"DeviceMesh of shape {tuple(device_mesh.shape)} with dims "
                f"{device_mesh.mesh_dim_names} does not match {abstract!r}; build meshes with "
                f"nf.make_mesh, which keeps the two in step."
            )
        if _ranks_of(device_mesh) != tuple(range(abstract.size)):
            raise ShardingError(
                f"a Mesh must hold ranks 0..{abstract.size - 1} in row-major order, but this "
                f"DeviceMesh holds {device_mesh.mesh.tolist()} (a slice of a larger mesh?); build "
                f"the mesh over the whole world with nf.make_mesh and shard over its axes instead."
            )
        object.__setattr__(self, "_abstract", abstract)
        object.__setattr__(self, "_device_mesh", device_mesh)
        object.__setattr__(self, "_world", _default_group())

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Mesh is immutable")

    @property
    def abstract(self) -> AbstractMesh:
        return self._abstract

    @property
    def device_mesh(self):
        return self._device_mesh

    @property
    def device_type(self) -> str:
        return self._device_mesh.device_type

    axis_names = property(lambda self: self._abstract.axis_names)
    axis_sizes = property(lambda self: self._abstract.axis_sizes)
    shape = property(lambda self: self._abstract.shape)
    size = property(lambda self: self._abstract.size)

    def axis_size(self, name: str) -> int:
        return self._abstract.axis_size(name)

    def check_alive(self) -> None:
        """Raise unless this mesh's ranks still exist (its simulation or world has not ended)."""
        if _default_group() is not self._world:
            raise RuntimeError(
                f"{self!r} belongs to ranks that no longer exist (its nf.simulate block ended, or "
                f"nf.shutdown() ran); make a new mesh with nf.make_mesh in the current world."
            )

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return self._abstract.coordinate(rank)

    def rank_of(self, coord) -> int:
        return self._abstract.rank_of(coord)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Mesh)
            and self._abstract == other._abstract
            and self._device_mesh == other._device_mesh
        )

    def __hash__(self) -> int:
        return hash((self._abstract, self._device_mesh))

    def __repr__(self) -> str:
        return f"Mesh({self.shape!r}, device_type={self.device_type!r})"

    __enter__ = enter_mesh
    __exit__ = exit_mesh


def _ranks_of(device_mesh) -> tuple[int, ...]:
    """The ranks a DeviceMesh holds, in row-major order, read once per DeviceMesh (each `.mesh`
    builds the tensor anew) off its plain CPU tensor with no dispatch mode in the way (under
    `nf.simulate` each element read would pass through it)."""
    ranks = _RANKS.get(device_mesh)
    if ranks is None:
        from ndfunc._src.torch_compat import no_dispatch_modes

        with no_dispatch_modes():
            ranks = _RANKS[device_mesh] = tuple(device_mesh.mesh.flatten().tolist())
    return ranks


_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _default_group():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


# The mesh that bare `P`s refer to: context-local (per thread and task), never process-global.
_current_mesh: contextvars.ContextVar[Mesh | AbstractMesh | None] = contextvars.ContextVar(
    "ndfunc_mesh", default=None
)
_entered: contextvars.ContextVar[tuple] = contextvars.ContextVar("ndfunc_mesh_entered", default=())


def mesh_context() -> tuple:
    """The current mesh state, to put back with `restore_mesh_context` (used by `nf.simulate`)."""
    return (_current_mesh.get(), _entered.get())


def restore_mesh_context(state: tuple) -> None:
    mesh, entered = state
    _current_mesh.set(mesh)
    _entered.set(entered)


def get_mesh() -> Mesh | AbstractMesh | None:
    """The mesh set by `with mesh:` or `nf.set_mesh`, or None."""
    return _current_mesh.get()


class set_mesh:
    """Make `mesh` the one bare `P`s refer to, from now on in this context (thread, task, notebook).

    As a context manager it is undone on exit: `with nf.set_mesh(mesh): ...`.
    """

    def __init__(self, mesh: Mesh | AbstractMesh):
        if not isinstance(mesh, (Mesh, AbstractMesh)):
            raise TypeError(f"set_mesh expects a Mesh or AbstractMesh, got {type(mesh).__name__}.")
        self.mesh = mesh
        self._token = _current_mesh.set(mesh)

    def __enter__(self) -> Mesh | AbstractMesh:
        return self.mesh

    def __exit__(self, *exc) -> None:
        _current_mesh.reset(self._token)


@on_workers
def make_mesh(shape: AxisShape | None = None, /, **axes: int) -> Mesh:
    """A mesh over every current rank: `make_mesh({'dp_shard': 4, 'tp': 2})` or `make_mesh(dp=8)`.

    The product of the axis sizes must equal the world size (`nf.world_size()`). Ranks must exist:
    inside `nf.simulate(n)`, or after `nf.init()` (torchrun).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if shape is not None and axes:
        raise TypeError("make_mesh takes a shape mapping or keyword axes, not both.")
    abstract = AbstractMesh(shape if shape is not None else axes)
    if not abstract.axis_names:
        raise ShardingError("make_mesh needs at least one axis, e.g. make_mesh(dp=8).")
    if not dist.is_initialized():
        raise RuntimeError(
            "make_mesh found no ranks: run inside `with nf.simulate(n):` for n ranks in this "
            "process, or call nf.init() in each process started by torchrun."
        )
    world = dist.get_world_size()
    if abstract.size != world:
        sizes = " x ".join(f"{n}={s}" for n, s in abstract.shape.items())
        raise ShardingError(
            f"mesh {sizes} has {abstract.size} ranks but the world has {world}; "
            f"choose axis sizes whose product is {world}."
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device_mesh = init_device_mesh(device_type, abstract.axis_sizes, mesh_dim_names=abstract.axis_names)
    return Mesh(abstract, device_mesh)


def rank_at(coord, sizes) -> int:
    """The rank at `coord` of a mesh of `sizes` (row-major, the last axis fastest)."""
    rank = 0
    for c, n in zip(coord, sizes):
        rank = rank * n + c
    return rank
