"""Sharded checkpoints on torch.distributed.checkpoint (DCP): save a tree, load it into any layout.

`save(path, tree)` writes a pytree of tensors (DTensors, plain tensors) and Python scalars in DCP's
format: over real ranks each rank writes its own blocks, once per distinct block (DCP drops the
copies replicated ranks hold), and no rank gathers anything. `load(path, like)` reads it back into
the layouts of `like` (a tree of the same structure: DTensors on any mesh, plain tensors, scalars),
each rank reading only the parts of the files that its blocks overlap - DCP's resharding. So a run
saved on 4D loads on FSDP, on TP, on one device, and back, bit for bit.

In `nf.simulate(n)` one process holds every simulated rank, and it writes what the ranks would:
each distinct block once, as its own chunk of the leaf (`_Blocks`, DCP's protocol for a rank that
holds several shards), nothing gathered; it loads each block of `like`'s layout from the chunks it
overlaps. The files are DCP's either way: what simulation writes, real ranks load, and the other
way round.

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
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.tensor import DTensor

from ndfunc._src.checkpoint_index import METADATA, Reader, RefusedIndex
from ndfunc._src.forward import constructed_on_workers, on_workers
from ndfunc._src.runtime import is_simulated, simulation_paused
from ndfunc._src.torch_compat import local_blocks
from ndfunc._src.transfer import device_get, from_local, make_array_from_callback, sharding_of
from ndfunc.tree import tree_flatten_with_path


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


class _Blocks(torch.Tensor):
    """A leaf of global shape held as several blocks, by offset: what the simulated ranks hold of a
    DTensor, each distinct block once. It answers DCP's protocol for local shards (the methods a
    DTensor and torch's LocalShardsWrapper answer), so DCP writes each block as a chunk and reads
    chunks into each block; no op ever runs on the leaf itself."""

    @staticmethod
    def __new__(cls, shape: torch.Size, blocks: dict[tuple[int, ...], torch.Tensor]) -> "_Blocks":
        first = next(iter(blocks.values()))
        leaf = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=first.dtype, device=first.device)
        leaf._blocks = blocks
        return leaf

    def __create_write_items__(self, fqn: str, leaf: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(next(iter(self._blocks.values())))
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offset)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offset), block.shape),
                                                      properties=properties, size=self.shape))
                for offset, block in self._blocks.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offset), block.shape) for offset, block in self._blocks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._blocks[tuple(index.offset)]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"nf.checkpoint: {func} on a leaf held as blocks (only DCP's chunk protocol applies)")


def _offset(index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.start for s in index)


def _simulated_blocks(leaf: DTensor, copy: bool) -> _Blocks | torch.Tensor:
    """What the simulated ranks hold of `leaf`, each distinct non-empty block once (copied, for a
    save that writes in the background while the step goes on)."""
    sharding = sharding_of(leaf)
    held = local_blocks(leaf.to_local())
    blocks = {}
    for rank, index in enumerate(sharding.shard_indices(leaf.shape)):
        if _offset(index) not in blocks and held[rank].numel():
            blocks[_offset(index)] = held[rank].detach().clone() if copy else held[rank].detach()
    return _Blocks(leaf.shape, blocks) if blocks else device_get(leaf)


def _staged(flat: dict[str, Any], copy: bool = False) -> dict[str, Any]:
    """What this process writes of `flat`, taken on the caller's thread (simulation's mode is the
    thread's): over real ranks (or none) the leaves themselves, or with `copy` a host copy of each
    (a save that writes in the background while the step goes on); in simulation each DTensor as
    its simulated ranks' distinct blocks (copied, with `copy`)."""
    if not is_simulated():
        return {k: _host_copy(v) if copy and isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    with simulation_paused():
        return {k: _simulated_blocks(v, copy) if isinstance(v, DTensor) else v for k, v in flat.items()}


@on_workers
def save(path: str | os.PathLike, tree: Any) -> None:
    """Write `tree` to the checkpoint directory `path`, atomically (see the module's text); an
    existing checkpoint at `path` is replaced only once the new one is complete."""
    path = pathlib.Path(path)
    _check_replaceable(path, "save")
    flat, _ = _flat(tree)
    _write(path, _staged(flat), group=None, distributed=_distributed())


def _check_replaceable(path: pathlib.Path, call: str) -> None:
    """Refuse, before anything is written, a `path` whose replacement would lose what is there: a
    file, or a directory that is neither empty nor a checkpoint."""
    if not path.exists() or (path / METADATA).is_file() or (path.is_dir() and not any(path.iterdir())):
        return
    what = "a file" if not path.is_dir() else f"a directory with no {METADATA} (not a checkpoint)"
    raise CheckpointError(f"nf.checkpoint.{call}: {path} is {what}; a save replaces only a checkpoint, so "
                          f"nothing was written and it is as it was. Save to another path, or move it away first.")


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


@on_workers
def async_save(path: str | os.PathLike, tree: Any, *, group: Any = None) -> concurrent.futures.Future:
    """Start writing `tree` to `path` and return as soon as this rank's blocks are copied aside, so
    training goes on (and may overwrite the values: a donated step's buffers) while the write runs.

    The extra memory is that copy: what this rank holds of `tree`, in host memory, freed when the
    write ends. The checkpoint becomes visible, atomically as `save`'s, once every rank's files are
    written; `result()` of the returned future waits for that (and raises what went wrong). Every
    rank calls it. Over real ranks DCP's collectives go over `group`, a gloo group of its own so
    that they never interleave with the step's: made here when not given (pass one, or use a
    `Manager`, to reuse it across saves).
    """
    path = pathlib.Path(path)
    _check_replaceable(path, "async_save")
    flat, _ = _flat(tree)
    distributed = _distributed()
    if group is None and distributed:
        group = dist.new_group(backend="gloo")
    return _async_write(path, flat, group, distributed)


def _async_write(path: pathlib.Path, flat: dict[str, Any], group, distributed: bool,
                 then=None) -> concurrent.futures.Future:
    staged = _staged(flat, copy=True)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nf-checkpoint")
    pending = pool.submit(_write, path, staged, group, distributed, then, False)
    pool.shutdown(wait=False)  # its one thread ends with the write (and the interpreter waits for it)
    return pending


@on_workers
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
            elif simulated and isinstance(leaf, DTensor):  # each distinct block of its layout, read in place
                indices = sharding_of(leaf).shard_indices(leaf.shape)
                target[key] = _Blocks(leaf.shape, {_offset(i): torch.empty([s.stop - s.start for s in i],
                                                                           dtype=leaf.dtype) for i in indices})
            elif simulated:
                target[key] = torch.empty(leaf.shape, dtype=leaf.dtype)
            else:
                target[key] = torch.empty_like(leaf)
        try:
            dcp.load(target, storage_reader=Reader(path), no_dist=not distributed)
        except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - damage within a data file
            cause = next(iter(getattr(e, "failures", {}).values()), e)  # DCP's: (error, its frames) per rank
            cause = cause[0] if isinstance(cause, tuple) else cause
            raise CheckpointError(f"nf.checkpoint.load: {path} could not be read ({type(cause).__name__}: "
                                  f"{str(cause).splitlines()[0][:200]}); a data file is damaged. Load an earlier "
                                  f"checkpoint. Nothing was loaded into `like`.") from None
    if simulated:
        for key, leaf in flat.items():
            if isinstance(leaf, DTensor):
                blocks, used = target[key]._blocks, set()

                def block(index, blocks=blocks, used=used):  # replicas get copies: no two ranks alias
                    offset = _offset(index)
                    first = offset not in used
                    used.add(offset)
                    return blocks[offset] if first else blocks[offset].clone()

                target[key] = make_array_from_callback(leaf.shape, sharding_of(leaf), block)
    return optree.tree_unflatten(treespec, [target[k] for k in flat])


def _check(path: pathlib.Path, flat: dict[str, Any]) -> None:
    """Refuse, before anything is read, what `load` cannot fill from `path` exactly."""
    if not (path / METADATA).is_file():
        why = "does not exist" if not path.exists() else f"has no {METADATA} (an incomplete or foreign directory)"
        raise CheckpointError(f"nf.checkpoint.load: {path} {why}; a checkpoint is a directory written by "
                              f"nf.checkpoint.save. Point at a complete one (Manager.latest_step() finds the last).")
    try:
        metadata = Reader(path).read_metadata()
    except RefusedIndex as e:
        raise CheckpointError(f"nf.checkpoint.load: {path / METADATA} names {e}, which no checkpoint's index holds "
                              f"(DCP's is made of its metadata types, sizes, dtypes and paths); reading it would run "
                              f"code, so it is refused and nothing was read. Load a checkpoint written by "
                              f"nf.checkpoint.save or torch.distributed.checkpoint.save.") from None
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
            # a float saved in one precision loads into another, rounded as `Tensor.to` rounds (DCP's
            # copy into the target casts, as orbax's restore does); any other change is refused
            cast = dtype is not None and dtype.is_floating_point and leaf.dtype.is_floating_point
            if size is None or tuple(size) != tuple(leaf.shape) or (dtype != leaf.dtype and not cast):
                got = f"{str(dtype).removeprefix('torch.')}{list(size)}" if size is not None else "not a tensor"
                raise CheckpointError(
                    f"nf.checkpoint.load: {key!r} was saved as {got}, but `like` has "
                    f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}; load into a tree of the saved "
                    f"shapes (a layout may differ, a shape may not) and dtypes (a float may be another float).")


# --- a run's checkpoints ---------------------------------------------------------------------

_STEP = re.compile(r"step_(\d+)")


@dataclasses.dataclass
class Manager:
    """The checkpoints of one run in `directory`: `step_<N>` for each saved step, the last `keep`.

    `save(step, tree, blocking=False)` is an `async_save` (over one gloo group the manager keeps):
    it returns once this rank's blocks are copied aside and writes while training goes on; the
    next `save`, `wait()` or `close()` waits for it to be written and visible. `latest_step()` is the last complete step, `restore(like, step=None)`
    loads it (the latest by default).
    """

    directory: str | os.PathLike
    keep: int | None = None
    _pending: concurrent.futures.Future | None = dataclasses.field(default=None, init=False, repr=False)
    _group: Any = dataclasses.field(default=None, init=False, repr=False)

    def __new__(cls, *args, **kwargs):  # under nf.processes, a manager on every rank
        remote = constructed_on_workers(cls, args, kwargs)
        return super().__new__(cls) if remote is None else remote

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
        _check_replaceable(path, "Manager.save")
        flat, _ = _flat(tree)
        distributed = _distributed()
        if blocking:
            _write(path, _staged(flat), None, distributed, then=self._prune)
            return
        if self._group is None and distributed:
            self._group = dist.new_group(backend="gloo")
        self._pending = _async_write(path, flat, self._group, distributed, then=self._prune)

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

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of what this rank holds of `x` (a DTensor keeps its layout), in host memory."""
    if isinstance(x, DTensor):
        local = x.to_local().detach().to("cpu", copy=True)
        return from_local(local, x.device_mesh, x.placements, x.shape)
    return x.detach().to("cpu", copy=True)
