"""`Program`: a step between partitioning and running, the object transforms work on.

A transform is any object with one or both of these methods, passed in `nf.jit(transforms=[...])`:

    partitioned(program)  after every node has a strategy (`program.plan`), before lowering:
                          may change strategies or the global graph (`program.traced.graph`).
    lowered(program)      after lowering: may rewrite the local program (`program.local`, an fx
                          GraphModule whose nodes have `meta['val']` at local shapes and whose
                          collectives carry `meta['ndfunc_comm']`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ndfunc.partition.layout import Layout, local_shape


@dataclasses.dataclass
class Program:
    name: str
    traced: Any  # ndfunc.trace.Traced: the global program
    mesh: Any  # ndfunc Mesh
    axes: tuple[int, ...]  # mesh axes partitioned over (those of size > 1)
    sizes: tuple[int, ...]
    in_layouts: list[Layout]
    out_layouts: list[Layout | None]  # as requested (None: the partitioner's choice)
    donated: list[int]  # flat input leaves whose buffers outputs may reuse
    plan: Any = None  # ndfunc.partition.solve.Plan
    local: torch.fx.GraphModule | None = None
    donation: dict = dataclasses.field(default_factory=dict)  # output leaf -> input leaf it reuses
    out_placements: list = dataclasses.field(default_factory=list)  # per result: asked, whole mesh, or None
    _meta_ready: bool = False

    def ensure_meta(self, changed: bool = False) -> None:
        """Fill `meta['val']` of the local program (fake tensors at local shapes), once, or again
        if the program `changed` since. Running needs none of it; reading the program (text,
        costs, transforms) does."""
        if changed or not self._meta_ready:
            from ndfunc.partition.lower import propagate_meta

            propagate_meta(self.local, self.local_inputs())
            self._meta_ready = True

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names[i] for i in self.axes)

    def local_inputs(self) -> list:
        """(local shape, dtype, device) of each local program input, `coords` last."""
        out = []
        device = torch.device("cpu")
        for spec, lay, node in zip(self.traced.in_specs, self.in_layouts, self._placeholders()):
            device = node.meta["val"].device
            out.append((local_shape(spec.shape, lay, self.sizes), spec.dtype, device))
        out.append(((len(self.sizes),), torch.int64, device))
        return out

    def _placeholders(self):
        return [n for n in self.traced.graph.nodes if n.op == "placeholder"]
