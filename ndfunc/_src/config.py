"""ParallelConfig: the four parallel dimensions of a run, with Accelerate's names.

Mesh axes, outer to inner: `dp_replicate`, `dp_shard`, `cp`, `tp` (TP innermost, so on the
fastest links). Every axis is always built; a size-1 axis costs nothing.

Data-parallel world size is `dp_replicate * dp_shard`: TP and CP peers work on the same samples
(each holds part of the model, or part of each sequence), exactly as Accelerate's data loader
splits batches. The ND-parallel guide's "effective batch = ... / tp_size" reads as if TP ranks
drew samples of their own; they do not, so the effective batch is
`micro_batch * grad_accum * dp_replicate * dp_shard`, whatever `cp` and `tp` are.
"""

from __future__ import annotations

import dataclasses
import math
import os

from ndfunc._src.sharding.mesh import AbstractMesh, Mesh, make_mesh
from ndfunc._src.sharding.partition_spec import PartitionSpec
from ndfunc._src.sharding.rules import LogicalRules

AXES = ("dp_replicate", "dp_shard", "cp", "tp")
_FIELDS = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")
_ENV = {f: f"PARALLELISM_CONFIG_{f[: -len('_size')].upper()}_SIZE" for f in _FIELDS}


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the four parallel dimensions; `dp_shard_size=-1` takes what the others leave.

    Field names and environment variables are Accelerate's; unlike Accelerate's constructor, this
    one never reads the environment behind your back: `ParallelConfig.from_env()` does, on request.

    Example:
        >>> cfg = ParallelConfig(dp_shard_size=2, cp_size=2, tp_size=2)
        >>> cfg.total_size, cfg.dp_world_size, cfg.effective_batch_size(4, 8)
        (8, 2, 64)
    """

    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    cp_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"ParallelConfig.sequence_parallel must be a bool, got {self.sequence_parallel!r}.")
        for field in _FIELDS:
            size = getattr(self, field)
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"ParallelConfig.{field} must be an int, got {size!r}.")
            if size == -1 and field == "dp_shard_size":
                continue
            if size < 1:
                extra = " (or -1 to take the rest of the world)" if field == "dp_shard_size" else ""
                raise ValueError(f"ParallelConfig.{field} must be >= 1{extra}, got {size}.")

    @classmethod
    def from_env(cls, environ=None) -> "ParallelConfig":
        """Sizes from `PARALLELISM_CONFIG_{DP_REPLICATE,DP_SHARD,CP,TP}_SIZE` (unset: 1)."""
        environ = os.environ if environ is None else environ
        sizes = {}
        for field, var in _ENV.items():
            if var in environ:
                try:
                    sizes[field] = int(environ[var])
                except ValueError:
                    raise ValueError(f"{var}={environ[var]!r} is not an integer.") from None
        return cls(**sizes)

    @property
    def is_resolved(self) -> bool:
        return self.dp_shard_size != -1

    def resolve(self, world_size: int | None = None) -> "ParallelConfig":
        """This config with `dp_shard_size=-1` filled in, checked against the world size.

        Args:
            world_size: the number of ranks; by default `nf.world_size()`.
        """
        if world_size is None:
            from ndfunc._src.runtime import world_size as current_world_size

            world_size = current_world_size()
        others = self.dp_replicate_size * self.cp_size * self.tp_size
        config = self
        if not self.is_resolved:
            if world_size % others:
                raise ValueError(
                    f"dp_shard_size=-1 takes the rest of the world, but world size {world_size} is "
                    f"not divisible by dp_replicate({self.dp_replicate_size}) x cp({self.cp_size}) x "
                    f"tp({self.tp_size}) = {others}."
                )
            config = dataclasses.replace(self, dp_shard_size=world_size // others)
        if config.total_size != world_size:
            raise ValueError(
                f"dp_replicate({config.dp_replicate_size}) x dp_shard({config.dp_shard_size}) x "
                f"cp({config.cp_size}) x tp({config.tp_size}) = {config.total_size}, but the world "
                f"has {world_size} ranks; choose sizes whose product is {world_size} "
                f"(or dp_shard_size=-1 to fill the rest)."
            )
        return config

    def _require_resolved(self, what: str) -> None:
        if not self.is_resolved:
            raise ValueError(
                f"ParallelConfig.{what} needs every size, but dp_shard_size is -1; call "
                f".resolve(world_size) first (build_mesh() resolves against the current world)."
            )

    @property
    def sizes(self) -> dict[str, int]:
        """Mesh axis -> size, in mesh order."""
        return dict(zip(AXES, (getattr(self, f) for f in _FIELDS)))

    @property
    def total_size(self) -> int:
        self._require_resolved("total_size")
        return math.prod(self.sizes.values())

    @property
    def dp_world_size(self) -> int:
        """Ranks that see different samples: dp_replicate x dp_shard (TP and CP peers share)."""
        self._require_resolved("dp_world_size")
        return self.dp_replicate_size * self.dp_shard_size

    def build_mesh(self) -> Mesh:
        """The four-axis mesh `('dp_replicate', 'dp_shard', 'cp', 'tp')` over the current ranks."""
        return make_mesh(self.resolve().sizes)

    def build_abstract_mesh(self) -> AbstractMesh:
        """The same four axes as names and sizes only (every size given: nothing to resolve against),
        for planning a step on ranks this process does not have (`nf.ShapeDtypeStruct`).

        Example:
            >>> nf.ParallelConfig(dp_replicate_size=2, dp_shard_size=64, tp_size=8).build_abstract_mesh()
            AbstractMesh({'dp_replicate': 2, 'dp_shard': 64, 'cp': 1, 'tp': 8})
        """
        self._require_resolved("build_abstract_mesh")
        return AbstractMesh(self.sizes)

    @property
    def rules(self) -> LogicalRules:
        """Default logical axis rules: FSDP over `('dp_shard', 'cp')`, TP over `tp`, the batch over
        the data-parallel axes and the sequence over `cp`. With `sequence_parallel`, a sequence in a
        tensor that leaves `tp` free (the residual stream between layers) is split over `cp` and
        `tp`: Megatron's sequence parallelism, as torchtitan's TP runs it. Norms then run on 1/tp of
        the tokens and a layer's saved input is 1/tp the size (Llama 3 70B at dp_shard 32 x tp 8,
        16 sequences of 8,192 a rank, every layer recomputed: a 56 GiB peak, not 229), for more
        bytes moved as the partitioner plans it today (1.5x Megatron's on 8-way TP alone), so it
        is asked for, not the default. Rules are priorities, as Flax's: a dim takes the first rule
        whose axes are still free, so a sequence beside heads or an MLP dim (which take `tp`
        first) falls back to `cp`."""
        batch, fsdp = ("batch", ("dp_replicate", "dp_shard")), ("embed", ("dp_shard", "cp"))
        tp = [("vocab", "tp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp")]
        if not self.sequence_parallel:
            return [batch, ("seq", "cp"), *tp, fsdp]
        return [batch, *tp, ("seq", ("cp", "tp")), ("seq", "cp"), fsdp]

    @property
    def batch_spec(self) -> PartitionSpec:
        """Tokens `(batch, seq)`: batch over the data-parallel axes, sequence over `cp`."""
        return PartitionSpec(("dp_replicate", "dp_shard"), "cp")

    def effective_batch_size(self, micro_batch_size: int, gradient_accumulation_steps: int = 1) -> int:
        """Samples per optimizer step: micro batch x accumulation steps x dp_world_size."""
        for name, value in (("micro_batch_size", micro_batch_size),
                            ("gradient_accumulation_steps", gradient_accumulation_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        return micro_batch_size * gradient_accumulation_steps * self.dp_world_size

    @staticmethod
    def scale_lr(base_lr: float, base_batch_size: int, batch_size: int, rule: str = "linear") -> float:
        """The learning rate for `batch_size`, given one tuned at `base_batch_size`.

        `'linear'` (Goyal et al. 2017, for SGD): lr x batch/base. `'sqrt'` (Krizhevsky 2014; the
        usual choice for Adam): lr x sqrt(batch/base).
        """
        if base_batch_size < 1 or batch_size < 1:
            raise ValueError(f"batch sizes must be >= 1, got base_batch_size={base_batch_size}, batch_size={batch_size}.")
        ratio = batch_size / base_batch_size
        if rule == "linear":
            return base_lr * ratio
        if rule == "sqrt":
            return base_lr * math.sqrt(ratio)
        raise ValueError(f"scale_lr rule must be 'linear' or 'sqrt', got {rule!r}.")
