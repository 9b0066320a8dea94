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


@pytest.mark.parametrize("sizes", [(2, 2), (2, 4), (2, 2, 2, 2)])
def test_a_pointwise_op_is_asked_once_per_broadcast_pattern_and_divisibility(sizes):
    """DTensor's single-dim rule for a pointwise op reads the shapes only as they broadcast, and a
    split is kept where its ranks divide the dim: shapes alike in both share one candidate list
    (an optimizer's update over many parameter shapes), the list asking for each gives."""
    def node(*shapes):
        gm = make_fx(lambda a, b: torch.add(a, b, alpha=2))(*(torch.ones(s) for s in shapes))
        (n,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)
        return n

    def fresh(n):
        found = ops._candidates(n, sizes)
        return found.layouts, found.outs, found.ins

    ops._CACHE.clear()
    first, alike = node((16, 32), (1, 32)), node((48, 64), (1, 64))  # every dim divisible by 16
    other = node((6, 32), (1, 32))  # 6 divides by 2, not by 4 (a product of two axes on each mesh here)
    broadcast = node((16, 32), (16, 1))
    got = {n: ops.candidates(n, sizes) for n in (first, alike, other, broadcast)}
    assert got[alike] is got[first]
    assert got[other] is not got[first]
    assert got[broadcast] is not got[first]
    for n in got:
        assert (got[n].layouts, got[n].outs, got[n].ins) == fresh(n)
