"""The sharding vocabulary: meshes, PartitionSpecs, NamedShardings, rules. Pure where possible."""

from ndfunc._src.sharding.errors import DuplicateAxisError as DuplicateAxisError
from ndfunc._src.sharding.errors import IndivisibleError as IndivisibleError
from ndfunc._src.sharding.errors import RankError as RankError
from ndfunc._src.sharding.errors import ShardingError as ShardingError
from ndfunc._src.sharding.errors import ShardingWarning as ShardingWarning
from ndfunc._src.sharding.errors import UnknownAxisError as UnknownAxisError
from ndfunc._src.sharding.mesh import AbstractMesh as AbstractMesh
from ndfunc._src.sharding.mesh import Mesh as Mesh
from ndfunc._src.sharding.mesh import get_mesh as get_mesh
from ndfunc._src.sharding.mesh import make_mesh as make_mesh
from ndfunc._src.sharding.mesh import set_mesh as set_mesh
from ndfunc._src.sharding.named_sharding import NamedSharding as NamedSharding
from ndfunc._src.sharding.partition_spec import P as P
from ndfunc._src.sharding.partition_spec import PartitionSpec as PartitionSpec
from ndfunc._src.sharding.placements import placements_to_spec as placements_to_spec
from ndfunc._src.sharding.placements import spec_to_placements as spec_to_placements
from ndfunc._src.sharding.rules import axis_rules as axis_rules
from ndfunc._src.sharding.rules import logical_spec as logical_spec
from ndfunc._src.sharding.rules import logical_to_mesh as logical_to_mesh
from ndfunc._src.sharding.rules import match_rules as match_rules
from ndfunc._src.visualize import visualize_sharding as visualize_sharding

__all__ = [
    "AbstractMesh", "DuplicateAxisError", "IndivisibleError", "Mesh", "NamedSharding", "P",
    "PartitionSpec", "RankError", "ShardingError", "ShardingWarning", "UnknownAxisError", "axis_rules", "get_mesh",
    "logical_spec", "logical_to_mesh", "make_mesh", "match_rules", "placements_to_spec", "set_mesh",
    "spec_to_placements", "visualize_sharding",
]
