"""`propagate_meta` on a program filled before runs only what changed: what it leaves must be what
a propagation of the same program from nothing gives (FakeTensorProp's, torch's own), and what it
keeps must be what nothing it reads changed for."""

from __future__ import annotations

import copy

import torch
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ndfunc._src.partition.program import propagate_meta
from ndfunc._src.torch_compat import FakeTensorMode

aten = torch.ops.aten
INPUTS = [((4, 8), torch.float32, torch.device("cpu")), ((8, 6), torch.float32, torch.device("cpu"))]


def _layers() -> torch.fx.GraphModule:
    """Two identical 'layers' (matmul, relu, transpose) on x @ w, and a sum."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    h = x
    for _ in range(2):
        h = g.call_function(aten.mm.default, (h, w))
        h = g.call_function(aten.relu.default, (h,))
        h = g.call_function(aten.mm.default, (h, g.call_function(aten.t.default, (w,))))
    g.output((g.call_function(aten.sum.default, (h,)), h))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _described(gm: torch.fx.GraphModule) -> list:
    def of(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.dtype, v.stride())
        return tuple(map(of, v)) if isinstance(v, (tuple, list)) else v
    return [(n.name, of(n.meta.get("val"))) for n in gm.graph.nodes if n.op != "output"]


def _from_nothing(gm: torch.fx.GraphModule, inputs) -> list:
    fresh = copy.deepcopy(gm)
    for n in fresh.graph.nodes:
        n.meta.clear()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [torch.empty(s, dtype=d, device=dev) for s, d, dev in inputs]
    FakeTensorProp(fresh, mode).propagate_dont_convert_inputs(*fakes)
    return _described(fresh)


def test_a_first_propagation_is_torchs_and_identical_layers_get_equal_values():
    gm = _layers()
    propagate_meta(gm, INPUTS)
    assert _described(gm) == _from_nothing(gm, INPUTS)


def test_a_rewired_node_and_what_reads_it_are_run_again_and_the_rest_is_kept():
    gm = _layers()
    propagate_meta(gm, INPUTS)
    kept = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    # a pass puts a transpose pair in front of the second layer's first matmul (its input, same shape)
    second = [n for n in gm.graph.nodes if n.target is aten.mm.default][2]
    with gm.graph.inserting_before(second):
        t = gm.graph.call_function(aten.t.default, (second.args[0],))
        back = gm.graph.call_function(aten.t.default, (t,))
    second.args = (back, second.args[1])
    propagate_meta(gm, INPUTS)
    assert _described(gm) == _from_nothing(gm, INPUTS)
    # the new transposes were run; the node they feed keeps what it had (the same shape and strides)
    assert t.meta["val"].shape == (8, 4)
    for n in gm.graph.nodes:
        if n.name in kept and n is not second:
            assert n.meta["val"] is kept[n.name], n.name


def test_a_change_that_changes_a_shape_reaches_every_node_downstream():
    gm = _layers()
    propagate_meta(gm, INPUTS)
    wider = [((6, 8), torch.float32, torch.device("cpu")), INPUTS[1]]
    propagate_meta(gm, wider)
    assert _described(gm) == _from_nothing(gm, wider)
    # and an op swapped for one of another result shape: a sum over rows, (6, 6) -> (1, 6)
    first = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    first.target = aten.sum.dim_IntList
    first.args = (first.args[0], [0], True)
    propagate_meta(gm, wider)
    assert _described(gm) == _from_nothing(gm, wider)
    assert first.meta["val"].shape == (1, 6) and gm.graph.find_nodes(op="output")[0].args[0][1].meta["val"].shape == (1, 8)
