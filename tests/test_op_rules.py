"""The op registry's own rules where they stand in for DTensor's to save time: the same strategies,
in the same order (the partitioner breaks ties by order), as asking DTensor's rule itself."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ndfunc._src.partition.planning import ops, strategies


@pytest.mark.parametrize("sizes", [(2, 2), (2, 2, 2), (4, 2)])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_the_cat_rule_gives_what_dtensors_rule_gives_pooled_over_each_inputs_layouts(sizes, dim):
    gm = make_fx(lambda a, b, c: torch.cat([a, b, c], dim))(torch.ones(8, 4, 2), torch.ones(8, 4, 2),
                                                               torch.ones(8, 4, 2))
    (node,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)
    ins, outs = strategies.tensor_inputs(node), strategies.tensor_outputs(node)
    asked = strategies.from_op_strategy(node, ins, outs, sizes)
    assert ops._cat_rule(node, sizes) == list(dict.fromkeys(asked))  # DTensor's, each once, first seen first
