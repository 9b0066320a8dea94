"""The stages of a jitted step, as JAX names them: `Lowered` (read it) and `Compiled` (run it).

`nf.jit(f).lower(*args)` returns a `Lowered`: the program after the pipeline's partitioning,
lowering, transform and memory passes (`ndfunc._src.pipeline`). `.compile()` runs the backend passes and
returns a `Compiled`, which takes each DTensor's local block, runs the program, and wraps the
results as DTensors. Neither knows the `Jitted` that made them: they hold the `Program` and the
`Arguments` that lay a call's arguments out.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from ndfunc._src import pipeline
from ndfunc._src.arguments import Arguments
from ndfunc._src.buffers import written_inputs
from ndfunc._src.display import stage_html
from ndfunc._src.donation import mark_donated
from ndfunc._src.partition.passes.analysis import MemoryAnalysis, as_text, cost_analysis, memory_analysis
from ndfunc._src.partition.program import Program, propagate_meta
from ndfunc._src.runtime import simulation_paused
from ndfunc._src.sharding.mesh import Mesh
from ndfunc._src.simulated_program import rank_program, run_on_ranks
from ndfunc._src.torch_compat import (
    DTensorSpec,
    LocalTensor,
    TensorMeta,
    bind_ops,
    compiled_program,
    current_dispatch_mode,
    dtensor_of_local,
    local_blocks,
    local_of,
    local_tensor_mode,
)


@dataclasses.dataclass
class Lowered:
    """A traced, partitioned and lowered step: inspect it, or `.compile()` it."""

    name: str
    program: Program
    arguments: Arguments
    key: Any
    backend: str | None = None  # torch.compile's backend for the local program (nf.jit's `compile`)

    def as_text(self) -> str:
        """The local program each rank runs, as partitioned; collectives show kind, mesh axes and bytes."""
        return as_text(self.program)

    def cost_analysis(self) -> dict:
        """Per rank: `flops`, `comm_bytes` (moved, total and per kind), `collectives` (count per
        kind), `by_axes` (mesh axes -> kind -> `count` and `bytes` moved), `peak_memory_bytes` (from
        liveness in the local program, inputs included)."""
        return cost_analysis(self.program)

    def memory_analysis(self) -> MemoryAnalysis:
        """Per rank: bytes of the arguments, outputs (and those in donated buffers), temporaries and
        the peak of one run, from liveness in the local program (`.plot()` draws it op by op)."""
        return memory_analysis(self.program)

    def _repr_html_(self) -> str:
        """In a notebook: collectives by mesh axes, flops and memory of a rank's program."""
        return _html("lowered", self.program, self.cost_analysis(), self.memory_analysis())

    def compile(self) -> "Compiled":
        if not isinstance(self.program.mesh, Mesh) and self.program.axes:
            raise TypeError(f"{self.name} was lowered on {self.program.mesh!r}, an abstract mesh (names and sizes, "
                            f"no ranks): read it (as_text, cost_analysis, memory_analysis); to run it, lower it "
                            f"on a Mesh (nf.make_mesh under nf.init or nf.simulate).")
        return self.compiled

    @functools.cached_property
    def compiled(self) -> "Compiled":
        return Compiled(pipeline.run(self.program, pipeline.backend_passes(self.backend is not None)), self.arguments,
                        self.key, self.backend)


def _html(stage: str, program: Program, cost: dict, memory: MemoryAnalysis) -> str:
    mesh = dict(zip(program.mesh.axis_names, program.mesh.axis_sizes))
    return stage_html(f"{program.name}, {stage}: the program each rank runs on mesh {mesh}", cost, memory)


class Compiled:
    """A lowered step ready to run: `compiled(*args)` with the signature it was lowered for."""

    def __init__(self, program: Program, arguments: Arguments, key, backend: str | None = None):
        self.program, self._arguments, self._key = program, arguments, key
        self._coords = None
        self._rank_program = None
        self._donated = frozenset(program.donated)
        self._written = frozenset(written_inputs(program.runs)) - self._donated
        self._bound = None  # `_forward`, written on first use (simulated ranks run `_on_ranks`')
        # torch.compile'd on its first call; simulated ranks run the program op by op
        self._compiled_forward = None if backend is None else compiled_program(program.runs, backend)
        self._runs_meta = False
        # how each result is wrapped, worked out once: placements over the whole mesh, shape, stride
        self._specs = []
        if isinstance(program.mesh, Mesh):
            for (_, layout), spec, asked in zip(program.plan.outputs, program.traced.out_specs,
                                                program.out_placements):
                # as asked, size-1 axes included, so a result passes back in as it came out
                placements = program.mesh_placements(layout, asked)
                shape = torch.Size(spec.shape)
                meta = TensorMeta(shape, torch.empty(shape, device="meta").stride(), spec.dtype)
                self._specs.append(DTensorSpec(program.mesh.device_mesh, placements, tensor_meta=meta))

    @property
    def runs(self) -> torch.fx.GraphModule:
        """The local program as it runs here (fx), after the backend passes."""
        return self.program.runs

    def as_text(self) -> str:
        """The local program as it runs here: collectives as this backend runs them, CPU kernels chosen."""
        return as_text(self.program, self._runs())

    def cost_analysis(self) -> dict:
        """As `Lowered.cost_analysis`, of the program as it runs here."""
        return cost_analysis(self.program, self._runs())

    def memory_analysis(self) -> MemoryAnalysis:
        """As `Lowered.memory_analysis`, of the program as it runs here."""
        return memory_analysis(self.program, self._runs())

    def _repr_html_(self) -> str:
        """As `Lowered`'s, of the program as it runs here."""
        return _html("compiled", self.program, self.cost_analysis(), self.memory_analysis())

    def _runs(self) -> torch.fx.GraphModule:
        if not self._runs_meta and self.program.runs is not self.program.local:
            propagate_meta(self.program.runs, self.program.local_inputs())
        self._runs_meta = True
        return self.program.runs

    def __call__(self, *args, **kwargs):
        _, prepared, key = self._arguments.prepare(args, kwargs)
        if key != self._key:
            raise TypeError(
                f"this Compiled {self.program.name} was lowered for other arguments (shapes, dtypes, "
                f"shardings or static values differ); call the nf.jit function, which compiles per signature."
            )
        return self._run(prepared, args)

    def _coords_tensor(self, device) -> torch.Tensor:
        if self._coords is None:
            mesh, axes = self.program.mesh, self.program.axes
            mode = local_tensor_mode()
            if mode is not None:
                self._coords = mode.rank_map(lambda r: torch.tensor([mesh.coordinate(r)[i] for i in axes],
                                                                    dtype=torch.int64, device=device))
            else:
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_initialized() else 0
                self._coords = torch.tensor([mesh.coordinate(rank)[i] for i in axes] if axes else [],
                                            dtype=torch.int64, device=device)
        return self._coords

    def _forward(self) -> Any:
        """The program's forward, each op called at its C++ entry point (`bind_ops`)."""
        if self._bound is None:
            self._bound = bind_ops(self.program.runs)
        return self._bound

    def _on_ranks(self, mode) -> tuple[tuple[int, ...], Any]:
        """(the simulated ranks, the program over their blocks: `simulated_program`), written once
        per set of ranks; the program is None where only the mode can run it."""
        ranks = tuple(sorted(mode.ranks))
        if self._rank_program is None or self._rank_program[0] != ranks:
            self._rank_program = (ranks, rank_program(self.program.runs, ranks))
        return self._rank_program

    def _run(self, prepared: list, original_args: tuple):
        p = self.program
        locals_ = [local_of(x) if isinstance(x, DTensor) else x for x in prepared]
        mode = local_tensor_mode()
        written = []  # (a plain argument the program writes into, each rank's copy of it)
        if mode is not None:  # in simulation every input is per rank, so no op mixes the two kinds
            # (one the program writes into a copy per rank: one tensor for all would take every
            # rank's write, where each real rank writes its own once)
            plain = locals_
            locals_ = [x if isinstance(x, LocalTensor) else
                       mode.rank_map(lambda r, x=x, copy=i in self._donated or i in self._written: x.clone()
                                     if copy else x) for i, x in enumerate(locals_)]
            written = [(plain[i], locals_[i]) for i in self._written if not isinstance(plain[i], LocalTensor)]
        device = locals_[0].device if locals_ else torch.device("cpu")
        with torch.no_grad():
            inputs = [*locals_, self._coords_tensor(device)]
            # every simulated rank's ops called directly, not through the mode; but a dispatch mode
            # of the caller's above the simulation's (a profiler, a counter) sees every op, as before
            direct = mode is not None and current_dispatch_mode() is mode
            ranks, on_ranks = self._on_ranks(mode) if direct else (None, None)
            if on_ranks is not None:
                with simulation_paused():
                    outs = run_on_ranks(on_ranks, ranks, inputs, fresh=p.donation)
            else:
                forward = self._forward() if mode is not None or self._compiled_forward is None else \
                    self._compiled_forward
                outs = list(forward(*inputs))
                for j in p.donation:  # a new tensor on the donated memory: the old object is retired
                    outs[j] = outs[j].detach()
            del inputs
            for x, copies in written:  # what every real rank holds (a replicated value): rank 0's
                blocks = local_blocks(copies)
                x.copy_(blocks[min(blocks)])
        del locals_, written
        mark_donated(p, prepared, optree.tree_leaves(original_args))
        if self._specs:  # no mesh: plain tensors, as they came
            # not from_local: no autograd Function per result (nothing here is differentiated),
            # the layouts were settled when the program was built
            outs = [dtensor_of_local(o, spec) for o, spec in zip(outs, self._specs)]
        return p.traced.out_tree.unflatten(outs)

