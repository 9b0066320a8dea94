"""ND-parallel layout planning: closed forms for Llama-shaped transformers (dense or mixtures of experts),
and any step's program.

`plan`: give it a model shape, a cluster and a batch; it enumerates the layouts
(dp_replicate x dp_shard x cp x tp) with the options that matter (remat, FSDP reshard and prefetch,
micro-batch), drops those that do not fit memory and ranks the rest by predicted step time. Pure
functions of numbers: no process group, no tensors. `python -m ndfunc.plan --model llama3-8b
--gpus 128 --gpu h100 --global-batch 1024 --seq-len 8192` prints the table.

`plan_step`: give it a function that lowers your step over stand-ins for a layout, and the layouts
to check; it replays each rank's program on the cluster (`program_time`) and ranks them.

Example:
    >>> from ndfunc.plan import Cluster, TransformerShape, plan
    >>> p = plan(TransformerShape.named("llama3-70b"), cluster=Cluster.of("h100", 64), global_batch=64,
    ...          seq_len=8192)
    >>> p.best.fits and p.best.layout.num_gpus
    64
"""

from ndfunc._src.planner.cluster import Cluster as Cluster
from ndfunc._src.planner.cluster import Device as Device
from ndfunc._src.planner.cluster import Link as Link
from ndfunc._src.planner.cluster import gpu_names as gpu_names
from ndfunc._src.planner.estimate import Efficiency as Efficiency
from ndfunc._src.planner.estimate import Estimate as Estimate
from ndfunc._src.planner.estimate import StepTime as StepTime
from ndfunc._src.planner.estimate import estimate as estimate
from ndfunc._src.planner.layout import Layout as Layout
from ndfunc._src.planner.layout import Options as Options
from ndfunc._src.planner.memory import Memory as Memory
from ndfunc._src.planner.memory import memory_per_rank as memory_per_rank
from ndfunc._src.planner.model import TransformerShape as TransformerShape
from ndfunc._src.planner.model import model_names as model_names
from ndfunc._src.planner.search import Plan as Plan
from ndfunc._src.planner.search import plan as plan
from ndfunc._src.replay.steps import StepEstimate as StepEstimate
from ndfunc._src.replay.steps import StepPlan as StepPlan
from ndfunc._src.replay.steps import plan_step as plan_step
from ndfunc._src.replay.timeline import ProgramTime as ProgramTime
from ndfunc._src.replay.timeline import program_time as program_time

__all__ = [
    "Cluster", "Device", "Efficiency", "Estimate", "Layout", "Link", "Memory", "Options", "Plan", "ProgramTime",
    "StepEstimate", "StepPlan", "StepTime", "TransformerShape", "estimate", "gpu_names", "memory_per_rank",
    "model_names", "plan", "plan_step", "program_time",
]
