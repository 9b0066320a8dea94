"""The transform protocol: what `nf.jit(transforms=[...])` accepts, and when each hook runs.

A transform is a frozen dataclass deriving from `Transform`; it overrides the hooks it needs and
inherits no-ops for the rest. `nf.jit` calls them in the pipeline's order
(`ndfunc._src.pipeline.PASSES`), each with the `Program` (`ndfunc._src.partition.program`):

    validate(mesh)        before anything is traced: refuse axes the mesh does not have
    tracing()             a context around tracing, for what is traced (mixed precision's dtype)
    traced(program)       the global program, before partitioning: mark nodes (ring attention)
    partitioned(program)  every node has a strategy (`program.plan`); lowering comes next
    lowered(program)      the local program (`program.local`), before the memory passes (buffer
                          reuse, in place, donation), which then serve the transform's buffers too

A hook asks the program for what it needs (`program.axis_position(name)`, `program.comm(node)`,
`program.LoweringContext` for a node's own lowering), never for the lowering's private objects.

Example (a transform that counts the collectives it is handed):

    >>> @dataclasses.dataclass(frozen=True)
    ... class count(Transform):
    ...     seen: list = dataclasses.field(default_factory=list)
    ...     def lowered(self, program):
    ...         self.seen.append(len(prog.collectives(program.local)))
    >>> with nf.simulate(2):
    ...     t = count()
    ...     f = nf.jit(lambda x: x.sum(), mesh=nf.make_mesh(dp=2), in_shardings=P("dp"), transforms=[t])
    ...     _ = f(torch.ones(4))
    >>> t.seen
    [1]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

from ndfunc._src.partition import program as prog  # noqa: F401 - the doctest's namespace


@dataclasses.dataclass(frozen=True)
class Transform:
    """Base of every transform: each hook does nothing until overridden (see the module's text)."""

    def axes_used(self) -> tuple[str, ...]:
        """The mesh axes this transform names; `validate` checks the mesh has each."""
        return ()

    def validate(self, mesh) -> None:
        """Raise a ValueError naming the mesh's axes if this transform names one it does not have."""
        names = tuple(mesh.axis_names)
        for axis in self.axes_used():
            if axis not in names:
                raise ValueError(f"nf.{type(self).__name__}: the mesh has no axis {axis!r}; its axes are {names}. "
                                 f"Name one of those (a size-1 axis is fine: the transform then does nothing).")

    @contextlib.contextmanager
    def tracing(self):
        yield

    def traced(self, program) -> None:
        pass

    def partitioned(self, program) -> None:
        pass

    def lowered(self, program) -> None:
        pass


def check_transforms(transforms: Sequence[Any], name: str) -> tuple[Transform, ...]:
    """`transforms` as given to `nf.jit`, each checked to be a Transform."""
    if isinstance(transforms, (str, Transform)) or not isinstance(transforms, Sequence):
        raise TypeError(f"nf.jit({name}): transforms is a list, e.g. [nf.fsdp('dp_shard')]; got {transforms!r}.")
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            hint = f" (did you mean nf.{t}(...)?)" if isinstance(t, str) else ""
            raise TypeError(
                f"nf.jit({name}): transforms[{i}] is {t!r}, a {type(t).__name__}{hint}; a transform is "
                f"nf.fsdp(axis), nf.ring_attention(axis), nf.mixed_precision(...) or another "
                f"ndfunc.transforms.Transform.")
    return tuple(transforms)
