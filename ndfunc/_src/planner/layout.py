"""A candidate layout (the four mesh axis sizes) and the options a run picks on top of it.

Mesh axes, outer to inner: `dp_replicate`, `dp_shard`, `cp`, `tp`, as `nf.ParallelConfig` builds
them; ranks lie row-major, so tp's ranks are neighbours and the outer axes stride over them.
FSDP shards parameters over `dp_shard x cp` together (torchtitan's `dp_shard_cp` mesh): cp ranks
hold the same weights, so sharding over them too is free memory.
"""

from __future__ import annotations

import dataclasses
import math

from ndfunc._src import collective_cost
from ndfunc._src.collective_cost import Link, Machine
from ndfunc._src.planner.cluster import Cluster
from ndfunc._src.planner.model import TransformerShape, check_remat
from ndfunc._src.sharding.mesh import AbstractMesh

AXES = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Sizes of the four mesh axes; their product is the number of GPUs.

    Example:
        >>> lay = Layout(dp_shard=32, tp=8)
        >>> lay, lay.num_gpus, lay.fsdp_size, lay.dp_size
        (Layout(dp_shard=32, tp=8), 256, 32, 32)
        >>> lay.axis_sizes  # dp_replicate, dp_shard, cp, tp
        (1, 32, 1, 8)
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"Layout.{axis} must be an int >= 1, got {size!r}.")

    def __repr__(self) -> str:
        sizes = [f"{axis}={getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1]
        return f"Layout({', '.join(sizes)})"

    def __str__(self) -> str:
        """`dp_shard 32 x tp 8`, as tables show it; size-1 axes are left out (their collectives are
        the identity)."""
        parts = [f"{axis} {getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1]
        return " x ".join(parts) or "single"

    @property
    def num_gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks drawing different sequences: `dp_replicate x dp_shard` (cp and tp peers share)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards parameters and optimizer state over: `dp_shard x cp`."""
        return self.dp_shard * self.cp

    @property
    def axis_sizes(self) -> tuple[int, int, int, int]:
        """The four sizes in mesh order: `nf.ParallelConfig(*layout.axis_sizes)`."""
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def mesh(self) -> AbstractMesh:
        return AbstractMesh(dict(zip(AXES, self.axis_sizes)))

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along `axis`: the product of the inner axes' sizes."""
        return math.prod(getattr(self, inner) for inner in AXES[AXES.index(axis) + 1 :])

    def group(self, axis: str) -> tuple[str, ...]:
        """The mesh axes a collective over `axis` runs over: `fsdp`'s are `dp_shard` and `cp`."""
        return ("dp_shard", "cp") if axis == "fsdp" else (axis,)

    def machine(self, cluster: Cluster) -> Machine:
        """The link each mesh axis crosses on `cluster` (`collective_cost.machine`)."""
        return collective_cost.machine(dict(zip(AXES, self.axis_sizes)), cluster)

    def link(self, axis: str, cluster: Cluster) -> Link:
        """The link `axis` crosses; for `fsdp` the flattened `dp_shard x cp` group."""
        return self.machine(cluster).link(self.group(axis))[1]

    def crosses_nodes(self, axis: str, cluster: Cluster) -> bool:
        """Whether `axis` (or `fsdp`, the flattened `dp_shard x cp` group) spans nodes."""
        return self.machine(cluster).link(self.group(axis))[0] == "inter"

    def check(self, model: TransformerShape, cluster: Cluster, global_batch: int, seq_len: int) -> None:
        """Raise `ValueError` unless this layout can run `model` on `cluster` at this batch."""
        if self.num_gpus != cluster.num_gpus:
            raise ValueError(f"{self!r} uses {self.num_gpus} GPUs; the cluster has {cluster.num_gpus}.")
        if self.tp > cluster.gpus_per_node or model.n_kv_heads % self.tp:
            raise ValueError(
                f"{self!r}: tp {self.tp} must divide n_kv_heads {model.n_kv_heads} and fit in a node of "
                f"{cluster.gpus_per_node} GPUs (its collectives are not overlapped, so they stay on NVLink)."
            )
        if seq_len % self.cp:
            raise ValueError(f"{self!r}: cp {self.cp} must divide seq_len {seq_len}.")
        if global_batch % self.dp_size:
            raise ValueError(
                f"{self!r}: global batch {global_batch} must be a multiple of dp_replicate x dp_shard = {self.dp_size}."
            )


@dataclasses.dataclass(frozen=True)
class Options:
    """What a run chooses besides the layout.

    Args:
        remat: 'none', 'selective' (keep matmul outputs: `save_dots`) or 'full'.
        micro_batch: sequences per data-parallel rank per forward/backward.
        grad_accum: micro-batches per step; `micro_batch * grad_accum * dp_size` = global batch.
        reshard_after_forward: FSDP frees gathered weights after forward and gathers them again
            for backward (one more all-gather, `n_layers` fewer gathered layers held).
        prefetch: FSDP gathers the next layer while this one computes (two layers in flight);
            without it every all-gather waits.
        float8: layer linears run in fp8 (torchao's float8 training; the output projection stays
            bf16, as torchtitan leaves it).
        compute_bytes: bytes of an element of the compute dtype, what gathered weights and
            activations move and occupy: 2 under bf16 mixed precision, 4 in fp32 throughout.

    Example:
        >>> Options("full", micro_batch=1)
        Options(remat='full', micro_batch=1, grad_accum=1, reshard_after_forward=True, prefetch=True, float8=False, compute_bytes=2)
    """

    remat: str = "selective"
    micro_batch: int = 1
    grad_accum: int = 1
    reshard_after_forward: bool = True
    prefetch: bool = True
    float8: bool = False
    compute_bytes: int = 2

    def __post_init__(self) -> None:
        check_remat(self.remat)
        if self.compute_bytes not in (2, 4):
            raise ValueError(f"Options.compute_bytes is 2 (bf16) or 4 (fp32), got {self.compute_bytes!r}.")
        for field in ("micro_batch", "grad_accum"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Options.{field} must be an int >= 1, got {value!r}.")

    def __str__(self) -> str:
        flags = [self.remat, f"mb {self.micro_batch}"]
        if self.grad_accum > 1:
            flags.append(f"accum {self.grad_accum}")
        if not self.reshard_after_forward:
            flags.append("no-reshard")
        if not self.prefetch:
            flags.append("no-prefetch")
        if self.float8:
            flags.append("fp8")
        return " ".join(flags)
