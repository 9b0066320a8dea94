"""ndfunc: JAX's sharding model on PyTorch.

Declare a PartitionSpec per value over named mesh axes; ndfunc lays values out as DTensors on
real ranks (`nf.init()` under torchrun) or simulated ones (`nf.simulate(n)`).
"""

from ndfunc import checkpoint as checkpoint
from ndfunc import lax as lax
from ndfunc import nn as nn
from ndfunc import optim as optim
from ndfunc import plan as plan
from ndfunc import random as random
from ndfunc import sharding as sharding
from ndfunc import tree as tree
from ndfunc._src.agreement import RanksDisagreeError as RanksDisagreeError
from ndfunc._src.autodiff import grad as grad
from ndfunc._src.autodiff import value_and_grad as value_and_grad
from ndfunc._src.autodiff import vmap as vmap
from ndfunc._src.config import ParallelConfig as ParallelConfig
from ndfunc._src.constraints import with_logical_constraint as with_logical_constraint
from ndfunc._src.constraints import with_sharding_constraint as with_sharding_constraint
from ndfunc._src.jit import jit as jit
from ndfunc._src.processes.watch import WorkerDiedError as WorkerDiedError
from ndfunc._src.processes.controller import processes as processes
from ndfunc._src.runtime import init as init
from ndfunc._src.runtime import is_simulated as is_simulated
from ndfunc._src.runtime import rank as rank
from ndfunc._src.runtime import shutdown as shutdown
from ndfunc._src.runtime import simulate as simulate
from ndfunc._src.runtime import world_size as world_size
from ndfunc._src.shard_map import shard_map as shard_map
from ndfunc._src.sharding.shape_dtype import ShapeDtypeStruct as ShapeDtypeStruct
from ndfunc._src.sharding.shape_dtype import eval_shape as eval_shape
from ndfunc._src.sharding.mesh import get_mesh as get_mesh
from ndfunc._src.sharding.mesh import make_mesh as make_mesh
from ndfunc._src.sharding.mesh import set_mesh as set_mesh
from ndfunc._src.trace import DataDependentError as DataDependentError
from ndfunc._src.transfer import device_get as device_get
from ndfunc._src.transfer import device_put as device_put
from ndfunc._src.transfer import make_array_from_callback as make_array_from_callback
from ndfunc._src.transfer import sharding_of as sharding_of
from ndfunc._src.transforms.accumulate import accumulate as accumulate
from ndfunc._src.transforms.remat import remat as remat
from ndfunc._src.visualize import visualize_sharding as visualize_sharding
from ndfunc.transforms import fsdp as fsdp
from ndfunc.transforms import mixed_precision as mixed_precision
from ndfunc.transforms import ring_attention as ring_attention
from ndfunc.transforms import unzigzag as unzigzag
from ndfunc.transforms import zigzag as zigzag

__version__ = "0.1.0"

__all__ = [
    "DataDependentError", "ParallelConfig", "RanksDisagreeError", "ShapeDtypeStruct", "accumulate", "checkpoint", "device_get",
    "device_put", "eval_shape", "fsdp", "get_mesh", "grad",
    "init", "is_simulated", "processes", "WorkerDiedError", "jit", "lax", "mixed_precision", "nn", "optim", "plan", "random", "remat", "ring_attention",
    "unzigzag", "value_and_grad", "vmap", "zigzag",
    "make_array_from_callback", "make_mesh", "rank", "set_mesh", "shard_map", "sharding", "sharding_of", "shutdown",
    "simulate", "tree", "visualize_sharding", "with_logical_constraint", "with_sharding_constraint", "world_size",
]
