"""The op registry's own rules where they stand in for DTensor's to save time: the same strategies,
in the same order (the partitioner breaks ties by order), as asking DTensor's rule itself."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ndfunc._src.partition.planning import ops, strategies


JOINS = {"cat": (torch.cat, torch.ops.aten.cat.default, ops._cat_rule),
         "stack": (torch.stack, torch.ops.aten.stack.default, ops._stack_rule)}


@pytest.mark.parametrize("join", list(JOINS))
@pytest.mark.parametrize("sizes", [(2, 2), (2, 2, 2), (4, 2)])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_the_cat_and_stack_rules_give_what_dtensors_rule_gives_pooled_over_each_inputs_layouts(join, sizes, dim):
    fn, op, rule = JOINS[join]
    gm = make_fx(lambda a, b, c: fn([a, b, c], dim))(torch.ones(8, 4, 2), torch.ones(8, 4, 2), torch.ones(8, 4, 2))
    (node,) = gm.graph.find_nodes(op="call_function", target=op)
    ins, outs = strategies.tensor_inputs(node), strategies.tensor_outputs(node)
    asked = strategies.from_op_strategy(node, ins, outs, sizes)
    assert rule(node, sizes) == list(dict.fromkeys(asked))  # DTensor's, each once, first seen first


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


def _step_of_every_by_axis_op(x, w):
    """One of each op the registry asks axis by axis: reductions by sum, slices, splits, transposes,
    copies, and views that only rename dims or add and drop ones of size 1."""
    a, b = torch.split(x, 3, dim=1)  # (6, 3, 10, 12) each, then sliced
    y = a[:, :, 2:8].sum(dim=(1,), keepdim=True) + b[:, :, :6].sum(dim=1, keepdim=True)
    z = y.permute(0, 3, 2, 1).squeeze(-1).transpose(1, 2).unsqueeze(0).clone()
    m = torch.mm(w.t(), w).contiguous().detach()
    return z.sum(), torch.empty_like(m).fill_(1.0) + m.sum()


@pytest.mark.parametrize("sizes", [(2, 2), (2, 3), (2, 2, 2), (2, 2, 2, 2)])
def test_rules_asked_axis_by_axis_give_what_asking_every_layout_gives(sizes, monkeypatch):
    """The registry asks some of DTensor's rules once per placement of each mesh axis, not once per
    layout (thousands on four axes), and makes the product: the same strategies, in the same order,
    as DTensor's rule asked for every layout of the input."""
    gm = make_fx(_step_of_every_by_axis_op)(torch.ones(6, 6, 10, 12), torch.ones(12, 8))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and (
        n.target in strategies.AXIS_BY_AXIS or n.target in (torch.ops.aten.permute.default,
                                                            torch.ops.aten.squeeze.dim,
                                                            torch.ops.aten.transpose.int,
                                                            torch.ops.aten.unsqueeze.default))]
    assert {n.target for n in nodes} >= strategies.AXIS_BY_AXIS - {  # (a trace drops a contiguous no-op)
        torch.ops.aten.alias.default, torch.ops.aten.zero_.default, torch.ops.aten.contiguous.default}
    by_axis = {n: ops._candidates(n, sizes) for n in nodes}
    monkeypatch.setattr(strategies, "AXIS_BY_AXIS", frozenset())  # every layout asked, each answer DTensor's
    monkeypatch.setattr(strategies, "renames_dims_only", lambda rules: False)
    for n, got in by_axis.items():
        assert isinstance(got, strategies.Fitted), n.target
        every = ops._candidates(n, sizes)
        assert list(got) == list(every), n.target
        assert got.layouts == every.layouts, n.target  # numbered alike too


def test_a_product_of_rules_is_walked_once_per_rules_and_divisibility():
    """The product of one rule per mesh axis reads the shapes only as which products of the axes'
    sizes divide each split dim: ops with the same rules over shapes alike in that share one list,
    the list a walk of their own makes."""
    sizes = (2, 2, 2)  # blocks of 2, 4 or 8

    def add_of(*shapes):
        gm = make_fx(torch.add)(*(torch.ones(s) for s in shapes))
        (n,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)
        return n

    first, alike, other = add_of((8, 4), (8, 4)), add_of((16, 12), (16, 12)), add_of((8, 6), (8, 6))
    strategies._COMBINED.clear()
    got = {n: strategies.from_dtensor(n, strategies.tensor_inputs(n), strategies.tensor_outputs(n), sizes)
           for n in (first, alike, other)}
    assert got[alike] is got[first]
    assert got[other] is not got[first]  # 6 is split in two, not in four
    for n, found in got.items():
        strategies._COMBINED.clear()
        fresh = strategies.from_dtensor(n, strategies.tensor_inputs(n), strategies.tensor_outputs(n), sizes)
        assert fresh is not found
        assert (fresh.layouts, fresh.outs, fresh.ins) == (found.layouts, found.outs, found.ins)


def _product_by_hand(codes, cut, shapes, sizes, n_outs, empty, n_checked):
    """What `strategies._combined` makes, by `itertools.product` and dicts: each combination of one
    rule per axis whose splits divide the dims (with tensors held to their shapes only, each
    strategy once: the first), the layouts numbered as the strategies read them (inputs, then the
    outputs made)."""
    import itertools

    n_real = len(shapes) - n_checked
    reads = [*range(n_outs, n_real), *(t for t in range(n_outs) if not empty[t])]
    numbered, outs, ins, seen = {}, [], [], set()
    for combo in itertools.product(*(range(len(rules)) for rules in codes)):
        blocks = {}
        for axis, r in enumerate(combo):
            for t, d in cut[axis][r]:
                blocks[t, d] = blocks.get((t, d), 1) * sizes[axis]
        if any(shapes[t][d] % n for (t, d), n in blocks.items()):
            continue
        keys = [tuple(codes[axis][r][t] for axis, r in enumerate(combo)) for t in range(len(shapes))]
        if n_checked and tuple(keys[:n_real]) in seen:  # (two combinations alike otherwise: two rows alike)
            continue
        seen.add(tuple(keys[:n_real]))
        at = [-1] * n_real
        for t in reads:
            at[t] = numbered.setdefault(keys[t], len(numbered))
        outs.append(tuple(at[:n_outs]))
        ins.append(tuple(at[n_outs:]))
    placements = strategies._PLACEMENTS_BY_CODE
    return [tuple(placements[c] for c in key) for key in numbered], outs, ins


def test_a_product_of_rules_keeps_what_divides_in_product_order():
    # random rows of placements per axis (some axes with none), outputs the op leaves empty,
    # tensors held to their shapes only: the product (walked as arrays, remembered) against one by hand
    import random

    from torch.distributed.tensor import Partial, Replicate, Shard

    places = [Replicate(), Shard(0), Shard(1), Partial()]
    code = [strategies._placement_code(p) for p in places]
    rng = random.Random(0)
    for trial in range(400):
        k, n = rng.randint(1, 4), rng.randint(1, 4)
        n_outs = rng.randint(0, n)
        n_checked = rng.randint(0, n - n_outs)
        sizes = tuple(rng.choice([2, 3, 4]) for _ in range(k))
        empty = [rng.random() < 0.2 for _ in range(n_outs)]
        shapes = [None if t < n_outs and empty[t] else tuple(rng.choice([1, 2, 4, 6, 8, 12]) for _ in range(2))
                  for t in range(n)]
        codes, cut = [], []
        for _ in range(k):
            rows = [[rng.randrange(4) for _ in range(n)] for _ in range(rng.randint(0 if trial % 20 == 0 else 1, 5))]
            codes.append([[code[c] for c in row] for row in rows])
            cut.append([[(t, places[c].dim) for t, c in enumerate(row) if c in (1, 2) and shapes[t] is not None]
                        for row in rows])
        got = strategies._combined(codes, cut, shapes, sizes, n_outs, empty, n_checked)
        assert (got.layouts, got.outs, got.ins) == _product_by_hand(codes, cut, shapes, sizes, n_outs, empty, n_checked)
