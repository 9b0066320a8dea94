"""ndfunc: JAX's sharding model on PyTorch.

Declare a PartitionSpec per value over named mesh axes; ndfunc lays values out as DTensors on
real ranks (`nf.init()` under torchrun) or simulated ones (`nf.simulate(n)`).
"""

from ndfunc import lax as lax
from ndfunc import optim as optim
from ndfunc import random as random
from ndfunc import sharding as sharding
from ndfunc import tree as tree
from ndfunc.transforms.accumulate import accumulate as accumulate
from ndfunc.autodiff import grad as grad
from ndfunc.autodiff import value_and_grad as value_and_grad
from ndfunc.autodiff import vmap as vmap
from ndfunc.config import ParallelConfig as ParallelConfig
from ndfunc.constraints import with_logical_constraint as with_logical_constraint
from ndfunc.constraints import with_sharding_constraint as with_sharding_constraint
from ndfunc.jit import jit as jit
from ndfunc.transforms.remat import remat as remat
from ndfunc.runtime import init as init
from ndfunc.runtime import is_simulated as is_simulated
from ndfunc.runtime import rank as rank
from ndfunc.runtime import shutdown as shutdown
from ndfunc.runtime import simulate as simulate
from ndfunc.runtime import world_size as world_size
from ndfunc.shard_map import shard_map as shard_map
from ndfunc.sharding.mesh import get_mesh as get_mesh
from ndfunc.sharding.mesh import make_mesh as make_mesh
from ndfunc.sharding.mesh import set_mesh as set_mesh
from ndfunc.sharding.visualize import visualize_sharding as visualize_sharding
from ndfunc.transfer import device_get as device_get
from ndfunc.transfer import device_put as device_put
from ndfunc.transfer import make_array_from_callback as make_array_from_callback
from ndfunc.transfer import sharding_of as sharding_of
from ndfunc.transforms import fsdp as fsdp
from ndfunc.transforms import mixed_precision as mixed_precision
from ndfunc.transforms import ring_attention as ring_attention
from ndfunc.transforms import unzigzag as unzigzag
from ndfunc.transforms import zigzag as zigzag

__version__ = "0.1.0"

__all__ = [
    "ParallelConfig", "accumulate", "device_get", "device_put", "fsdp", "get_mesh", "grad", "init", "is_simulated", "jit", "lax", "mixed_precision", "optim",
    "random", "remat", "ring_attention", "unzigzag", "value_and_grad", "vmap", "zigzag",
    "make_array_from_callback", "make_mesh", "rank", "set_mesh", "shard_map", "sharding", "sharding_of", "shutdown",
    "simulate", "tree", "visualize_sharding", "with_logical_constraint", "with_sharding_constraint", "world_size",
]
