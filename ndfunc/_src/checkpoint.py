"""Sharded checkpoints on torch.distributed.checkpoint (DCP): save a tree, load it into any layout.

`save(path, tree)` writes a pytree of tensors (DTensors, plain tensors) and Python scalars in DCP's
format: over real ranks each rank writes its own blocks, once per distinct block (DCP drops the
copies replicated ranks hold), and no rank gathers anything. `load(path, like)` reads it back into
the layouts of `like` (a tree of the same structure: DTensors on any mesh, plain tensors, scalars),
each rank reading only the parts of the files that its blocks overlap - DCP's resharding. So a run
saved on 4D loads on FSDP, on TP, on one device, and back, bit for bit.

In `nf.simulate(n)` one process holds every simulated rank: it writes each leaf whole (one chunk)
and loads whole leaves, laid out afterwards by `device_put`. The files are DCP's either way: what
simulation writes, real ranks load, and the other way round.

A checkpoint is atomic: it is written under a hidden sibling (`.<name>.partial`) and renamed to
`path` only when every rank's files and DCP's metadata are complete, so a crash during a save
leaves any earlier checkpoint as it was. `Manager` keeps the checkpoints of a run (`step_<N>`), the
last `keep`, and saves asynchronously where asked (`blocking=False`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import pathlib
import re
import shutil
import warnings
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from ndfunc._src.runtime import is_simulated, simulation_paused
from ndfunc._src.transfer import device_get, device_put, sharding_of
from ndfunc.tree import tree_flatten_with_path

METADATA = ".metadata"  # DCP's index of a checkpoint: written last, so a complete checkpoint has it


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked: missing, incomplete, damaged, or not this tree's."""


def _distributed() -> bool:
    """Whether real ranks take part (a process group that is not simulation's). Asked on the
    caller's thread: simulation's mode is the thread's."""
    return dist.is_initialized() and not is_simulated() and dist.get_world_size() > 1


@contextlib.contextmanager
def _outside_simulation():
    """DCP's own buffers plain, under `nf.simulate` too (`simulation_paused`), and quiet."""
    with simulation_paused(), _quiet():
        yield


@contextlib.contextmanager
def _quiet():
    """DCP's note that it runs in one process, which is what was asked, is not repeated."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _flat(tree: Any) -> tuple[dict[str, Any], Any]:
    """The tree as DCP's flat state dict (`a.b.0`: its leaves' paths) and its structure."""
    flat = {}
    pairs, treespec = tree_flatten_with_path(tree)
    for key, leaf in pairs:
        key = key or "_"  # a tree that is one leaf
        if not isinstance(leaf, (torch.Tensor, int, float, bool, str)):
            raise TypeError(f"nf.checkpoint: leaf {key!r} is a {type(leaf).__name__}; a checkpoint holds tensors "
                            f"and Python scalars (int, float, bool, str).")
        flat[key] = leaf
    return flat, treespec


def _partial(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f".{path.name}.partial")


def _staged(flat: dict[str, Any]) -> dict[str, Any]:
    """What simulation writes: each leaf whole (a DTensor gathered from its simulated ranks)."""
    return {k: device_get(v) if isinstance(v, DTensor) else v for k, v in flat.items()}


def save(path: str | os.PathLike, tree: Any) -> None:
    """Write `tree` to the checkpoint directory `path`, atomically (see the module's text); an
    existing checkpoint at `path` is replaced only once the new one is complete."""
    path = pathlib.Path(path)
    flat, _ = _flat(tree)
    _write(path, flat if not is_simulated() else _staged(flat), group=None, distributed=_distributed())


def _write(path: pathlib.Path, flat: dict[str, Any], group, distributed: bool, then=None,
           on_this_thread: bool = True) -> None:
    """Write aside, commit; `then()` (the manager's pruning) on the coordinator before the ranks go
    on. Off the caller's thread (an asynchronous save) simulation's mode is not in force, and is
    not to be touched: it is the caller's."""
    partial = _partial(path)
    coordinator = not distributed or dist.get_rank() == 0
    if coordinator:
        shutil.rmtree(partial, ignore_errors=True)  # what a save that died before left
        partial.parent.mkdir(parents=True, exist_ok=True)
    if distributed:
        dist.barrier(group=group)
    with _outside_simulation() if on_this_thread else _quiet():
        dcp.save(flat, checkpoint_id=str(partial), process_group=group, no_dist=not distributed)
    if coordinator:  # every rank's files are written, and DCP's index with them: make it visible
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            partial.rename(path)
            shutil.rmtree(old)
        else:
            partial.rename(path)
        if then is not None:
            then()
    if distributed:
        dist.barrier(group=group)


def load(path: str | os.PathLike, like: Any) -> Any:
    """The tree saved at `path`, laid out as `like` is (same structure; each tensor leaf's shape and
    dtype as saved, its layout any: a DTensor's sharding, or a plain tensor, whole). `like` itself
    is left as it is. Refuses a path that is not a complete checkpoint, and a tree that does not
    match it (a leaf missing from the checkpoint, or saved with another shape or dtype)."""
    path = pathlib.Path(path)
    flat, treespec = _flat(like)
    _check(path, flat)
    simulated, distributed = is_simulated(), _distributed()
    target = {}
    with _outside_simulation():
        for key, leaf in flat.items():
            if not isinstance(leaf, torch.Tensor):
                target[key] = leaf
            elif simulated:  # read whole, laid out below
                target[key] = torch.empty(leaf.shape, dtype=leaf.dtype)
            else:
                target[key] = torch.empty_like(leaf)
        try:
            dcp.load(target, checkpoint_id=str(path), no_dist=not distributed)
        except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - damage within a data file
            cause = next(iter(getattr(e, "failures", {}).values()), e)  # DCP's: (error, its frames) per rank
            cause = cause[0] if isinstance(cause, tuple) else cause
            raise CheckpointError(f"nf.checkpoint.load: {path} could not be read ({type(cause).__name__}: "
                                  f"{str(cause).splitlines()[0][:200]}); a data file is damaged. Load an earlier "
                                  f"checkpoint. Nothing was loaded into `like`.") from None
    if simulated:
        for key, leaf in flat.items():
            if isinstance(leaf, DTensor):
                target[key] = device_put(target[key], sharding_of(leaf))
    return optree.tree_unflatten(treespec, [target[k] for k in flat])


def _check(path: pathlib.Path, flat: dict[str, Any]) -> None:
    """Refuse, before anything is read, what `load` cannot fill from `path` exactly."""
    if not (path / METADATA).is_file():
        why = "does not exist" if not path.exists() else f"has no {METADATA} (an incomplete or foreign directory)"
        raise CheckpointError(f"nf.checkpoint.load: {path} {why}; a checkpoint is a directory written by "
                              f"nf.checkpoint.save. Point at a complete one (Manager.latest_step() finds the last).")
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any damage to the index is the same error to the user
        raise CheckpointError(f"nf.checkpoint.load: {path / METADATA} cannot be read ({type(e).__name__}: {e}); "
                              f"the checkpoint is damaged. Load an earlier one.") from None
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():  # each rank's data file holds what the index says
        end = info.offset + info.length
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    for name, end in sorted(sizes.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"nf.checkpoint.load: {file} is missing (the checkpoint's index names it); the "
                                  f"checkpoint is incomplete. Load an earlier one.")
        if file.stat().st_size < end:
            raise CheckpointError(f"nf.checkpoint.load: {file} is {file.stat().st_size} bytes, but the index reads up "
                                  f"to byte {end}; the file is truncated. Load an earlier checkpoint.")
    saved = metadata.state_dict_metadata
    for key, leaf in flat.items():
        if key not in saved:
            raise CheckpointError(f"nf.checkpoint.load: {path} has no {key!r} (it holds {len(saved)} entries, "
                                  f"e.g. {sorted(saved)[:3]}); `like` must have the structure that was saved.")
        entry = saved[key]
        if isinstance(leaf, torch.Tensor):
            size, dtype = getattr(entry, "size", None), getattr(getattr(entry, "properties", None), "dtype", None)
            if size is None or tuple(size) != tuple(leaf.shape) or dtype != leaf.dtype:
                got = f"{str(dtype).removeprefix('torch.')}{list(size)}" if size is not None else "not a tensor"
                raise CheckpointError(
                    f"nf.checkpoint.load: {key!r} was saved as {got}, but `like` has "
                    f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}; load into a tree of the saved "
                    f"shapes and dtypes (a layout may differ, a shape may not).")


# --- a run's checkpoints ---------------------------------------------------------------------

_STEP = re.compile(r"step_(\d+)")


@dataclasses.dataclass
class Manager:
    """The checkpoints of one run in `directory`: `step_<N>` for each saved step, the last `keep`.

    `save(step, tree, blocking=False)` returns once this rank's blocks are copied aside (a copy of
    its blocks in host memory, freed when the write ends: the extra memory an asynchronous save
    costs), and writes while training goes on; the next `save`, `wait()` or `close()` waits for it
    and makes it visible. `latest_step()` is the last complete step, `restore(like, step=None)`
    loads it (the latest by default).
    """

    directory: str | os.PathLike
    keep: int | None = None
    _pending: concurrent.futures.Future | None = dataclasses.field(default=None, init=False, repr=False)
    _pool: concurrent.futures.ThreadPoolExecutor | None = dataclasses.field(default=None, init=False, repr=False)
    _group: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.directory = pathlib.Path(self.directory)
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"nf.checkpoint.Manager: keep is at least 1 (or None for all), got {self.keep}.")

    def path(self, step: int) -> pathlib.Path:
        return self.directory / f"step_{step}"

    def steps(self) -> list[int]:
        """The steps with a complete checkpoint, in order."""
        found = []
        if self.directory.is_dir():
            for p in self.directory.iterdir():
                m = _STEP.fullmatch(p.name)
                if m and (p / METADATA).is_file():
                    found.append(int(m.group(1)))
        return sorted(found)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, tree: Any, blocking: bool = True) -> None:
        self.wait()
        path = self.path(step)
        flat, _ = _flat(tree)
        distributed = _distributed()
        if blocking:
            _write(path, flat if not is_simulated() else _staged(flat), None, distributed, then=self._prune)
            return
        # copied aside now (the step may overwrite its donated inputs), written in the background
        # over a process group of its own, so training's collectives do not interleave with DCP's
        staged = _staged(flat) if is_simulated() else {
            k: _host_copy(v) if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
        if self._group is None and distributed:
            self._group = dist.new_group(backend="gloo")
        self._pool = self._pool or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nf-checkpoint")
        self._pending = self._pool.submit(_write, path, staged, self._group, distributed, self._prune, False)

    def _prune(self) -> None:
        """Drop all but the last `keep` checkpoints (on the coordinator, after a commit)."""
        if self.keep is None:
            return
        for old in self.steps()[:-self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)

    def wait(self) -> None:
        """Wait for an asynchronous save to be written and visible (its error, if it failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def restore(self, like: Any, step: int | None = None) -> Any:
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"nf.checkpoint: {self.directory} holds no complete checkpoint to restore.")
        return load(self.path(step), like)

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of what this rank holds of `x` (a DTensor keeps its layout), in host memory."""
    if isinstance(x, DTensor):
        local = x.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=x.stride())
    return x.detach().to("cpu", copy=True)
