"""Ranks agree on what they run, or say why not.

Over real ranks every process traces and compiles its own copy of a step. One started with other
flags (another layout, another learning rate baked into the program) would wait forever in a
collective the others never call, or train silently into another model. So before a compiled step
first runs, the ranks compare a fingerprint of it - a hash per field: the mesh, the arguments'
shapes and dtypes, their layouts, the static arguments, the traced program (its constants
included) - in one all-gather of a few integers, and a difference is an error on every rank that
names the ranks and the fields that differ.
"""

from __future__ import annotations

import hashlib
import re

import torch
import torch.distributed as dist

from ndfunc._src.runtime import is_simulated
from ndfunc._src.torch_compat import group_size


class RanksDisagreeError(RuntimeError):
    """Ranks were about to run different programs (see `ndfunc._src.agreement`)."""


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # an object's repr names where it lives: not what it is


def fingerprint(program, statics) -> dict[str, str]:
    """What must be the same on every rank, field by field (as text, addresses left out; hashed to
    compare)."""
    mesh = program.mesh
    fields = {
        "mesh": repr((tuple(mesh.axis_names), tuple(mesh.axis_sizes))),
        "argument shapes and dtypes": repr(program.traced.in_specs),
        "argument layouts": repr(program.in_layouts),
        "static arguments": repr(statics),
        "program": _groups_by_axis(program.traced.graph_module.code, mesh),
    }
    return {k: _ADDRESS.sub("", v) for k, v in fields.items()}


_QUOTED = re.compile(r"'([^']*)'")


def _groups_by_axis(code: str, mesh) -> str:
    """`code` with the process groups its collectives name (a shard_map region's: each rank's own
    group along an axis, so a name that differs from rank to rank) written as the mesh axis they
    span, or as their size."""
    axes = {}
    device_mesh = getattr(mesh, "device_mesh", None)
    for i, name in enumerate(mesh.axis_names):
        try:
            axes[device_mesh.get_group(i).group_name] = f"axis {name}"
        except Exception:  # noqa: BLE001 - a mesh without groups (abstract, or size 1): nothing to name
            pass

    def named(match: re.Match) -> str:
        text = match.group(1)
        if text in axes:
            return f"'{axes[text]}'"
        try:
            return f"'a group of {group_size(text)}'"
        except Exception:  # noqa: BLE001 - not a group's name: an argument like 'sum'
            return match.group(0)

    return "\n".join(_QUOTED.sub(named, line) if "_c10d_functional" in line else line for line in code.splitlines())


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check(name: str, program, statics) -> None:
    """Raise `RanksDisagreeError` on every rank unless all ranks hold the same fingerprint; a
    no-op in simulation and in a world of one."""
    if not dist.is_initialized() or is_simulated() or dist.get_world_size() == 1:
        return
    fields = fingerprint(program, statics)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([_hash(v) for v in fields.values()], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size() * len(fields), dtype=torch.int64, device=device)
    dist.all_gather_single(every, mine)
    every = every.cpu().view(dist.get_world_size(), len(fields))
    names = list(fields)
    differ = [(r, names[j]) for r in range(1, every.shape[0]) for j in range(len(names)) if every[r, j] != every[0, j]]
    if differ:
        said = "; ".join(f"rank {r}'s {field}" for r, field in differ[:8]) + ("; ..." if len(differ) > 8 else "")
        raise RanksDisagreeError(
            f"{name}: the ranks are about to run different programs: {said} differ(s) from rank 0's. Every rank must "
            f"call the step with the same mesh, argument shapes, dtypes and layouts, static arguments and program: "
            f"start every rank with the same command line and configuration (this rank is {dist.get_rank()}).")
