"""The partitioner's plans for the llama train step cost no more than they did: on three 4-axis
layouts, a table holds every node's strategy as the partitioner once chose it, and today's plan
must cost no more than that plan by today's cost model. A pin is a bound, not a plan: a search
that finds a cheaper plan passes (`python tests/test_plan_pins.py` writes the table anew, for a
change that means to raise a bound). The search's remembered answers change no plan, and a plan
given back for a graph planned before is the same as a fresh search's."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import pytest
import torch

import ndfunc as nf
from models import llama, train
from ndfunc._src.partition.planning import exact, search, solve
from ndfunc.sharding import P

pytestmark = pytest.mark.slow  # lowerings and searches of the 4-axis llama step: about a minute and a half

TABLE = pathlib.Path(__file__).parent / "data" / "plans" / "llama_tiny.json"
LAYOUTS = {"fsdp+tp": (1, 4, 1, 2), "hsdp+tp": (2, 2, 1, 2), "4d": (1, 2, 2, 2)}  # (dp_replicate, dp_shard, cp, tp)


def lowered(sizes: tuple[int, ...], n_layers: int = 2):
    cfg = dataclasses.replace(llama.LlamaConfig.tiny(), n_layers=n_layers)
    config = nf.ParallelConfig(*sizes)
    params = llama.init(cfg, nf.random.key(0))  # whole, on this one device (not once per simulated rank)
    with nf.simulate(config.total_size):
        opt = nf.optim.adamw(1e-3, weight_decay=0.1)
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        state = opt.init(params)
        sspec = nf.optim.state_shardings(state, pspec)
        n, seq = 2 * config.dp_world_size, 64
        batch = {"tokens": torch.zeros(n, seq, dtype=torch.long), "targets": torch.zeros(n, seq, dtype=torch.long),
                 "positions": torch.arange(seq).expand(n, seq).contiguous()}
        bspec = {k: config.batch_spec for k in batch}
        step = nf.jit(train.make_step(cfg, opt, config.rules), mesh=config.build_mesh(),
                      in_shardings=(pspec, sspec, bspec), out_shardings=(pspec, sspec, P()))
        return step.lower(params, state, batch).program


def table(plan) -> dict:
    return {"strategies": [[str(node), repr(s)] for node, s in plan.strategy.items()],
            "outputs": [[str(v[0]), v[1], repr(lay)] for v, lay in plan.outputs]}


def pinned_cost(problem: solve.Problem, pinned: dict) -> float:
    """What the pinned plan costs by `problem`'s cost model: each node's pinned strategy found
    among its candidates by how it prints."""
    by_node = dict(map(tuple, pinned["strategies"]))
    picks = []
    for n, node in enumerate(problem.nodes):
        want = by_node[str(node)]
        picks.append(next(i for i in range(len(problem.strategies[n])) if repr(problem.strategies[n][i]) == want))
    return problem.total(exact._chosen(problem, picks))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_plan_costs_no_more_than_the_pinned_one(name):
    """A pin is a bound: the search's plan may change, never to cost more by the cost model than
    the plan pinned for this layout; and a graph planned before gets its plan back."""
    program = lowered(LAYOUTS[name])
    args = (program.traced.graph, program.sizes, program.in_layouts, program.out_layouts)
    fresh = solve.Problem(*args).solve()
    bound = pinned_cost(solve.Problem(*args), json.loads(TABLE.read_text())[name])
    assert fresh.cost <= bound * (1 + 1e-12)
    assert table(program.plan) == table(fresh)  # what the step lowered with (a fresh or a remembered plan)
    again = lowered(LAYOUTS[name])  # the same graph traced anew: its plan is given back, node by node
    assert table(again.plan) == table(fresh)
    assert all(node.graph is again.traced.graph for node in again.plan.strategy)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_what_the_search_remembers_changes_no_answer(name):
    """Every node decided afresh, and every candidate priced afresh, where the search would read a
    remembered answer (`Problem.best`: by the node's situation, shared by nodes alike;
    `_every_local_cost`): the plan the remembering search makes, so a situation holds all that an
    answer reads."""
    program = lowered(LAYOUTS[name])
    args = (program.traced.graph, program.sizes, program.in_layouts, program.out_layouts)
    remembered = table(solve.Problem(*args).solve())
    fresh = solve.Problem(*args)
    every = fresh._every_local_cost

    def priced_afresh(n, choice):
        fresh._every.clear()
        return every(n, choice)
    fresh.best = lambda n, choice, forward=False: 0 if len(fresh.c_ins[n]) == 1 else fresh._best_uncached(
        n, choice, forward)
    fresh._every_local_cost = priced_afresh
    assert table(fresh.solve()) == remembered


def test_identical_layers_are_searched_once_and_the_plan_is_a_full_searchs(monkeypatch):
    """The many-node moves of a value in the same place of another layer are the first one's
    replayed (`Problem._improve_together`): on four layers, the plan is the one a search that
    treats every value afresh makes."""
    program = lowered(LAYOUTS["fsdp+tp"], n_layers=4)
    args = (program.traced.graph, program.sizes, program.in_layouts, program.out_layouts)
    problem = solve.Problem(*args)
    classes = problem._value_classes()
    more = lowered(LAYOUTS["fsdp+tp"], n_layers=6)  # two layers more bring almost no class of their own
    six = solve.Problem(more.traced.graph, more.sizes, more.in_layouts, more.out_layouts)._value_classes()
    assert len(set(six)) - len(set(classes)) < 0.05 * (len(six) - len(classes))
    shared = problem.solve()
    monkeypatch.setattr(solve.Problem, "_value_classes", lambda self: list(range(len(self.values))))
    alone = solve.Problem(*args).solve()
    assert table(shared) == table(alone)
    assert shared.cost == alone.cost


def test_the_first_searchs_last_phase_is_spared_only_where_it_would_not_change_the_plan(monkeypatch):
    """Where the search with late candidates admitted from the start is kept by `SECOND_FAR` before
    the first search's last phase, that phase is not run (`Problem.solve`): the plan is the one
    made with it run. Llama-3-70B's shape on 1x32x4x8, 4 layers: the second search's plan is kept
    there by about 20%."""
    cfg = llama.LlamaConfig.llama3_70b(n_layers=4)
    program = train.lower_abstract(cfg, nf.ParallelConfig(1, 32, 4, 8), seq_len=256).program
    args = (program.traced.graph, program.sizes, program.in_layouts, program.out_layouts)
    relaxed = []
    relax = solve.Problem._relax
    monkeypatch.setattr(solve.Problem, "_relax", lambda self, choice: relaxed.append(1) or relax(self, choice))
    spared = solve.Problem(*args).solve()
    assert len(relaxed) == 1  # the kept plan's only
    monkeypatch.setattr(search, "SECOND_FAR", 1.0)  # never far enough: both relaxed, as before
    both = solve.Problem(*args).solve()
    assert len(relaxed) == 3
    assert table(spared) == table(both)
    assert spared.cost == both.cost

if __name__ == "__main__":
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, sizes in LAYOUTS.items():
        p = lowered(sizes)
        out[name] = table(solve.Problem(p.traced.graph, p.sizes, p.in_layouts, p.out_layouts).solve())
        print(name, len(out[name]["strategies"]), file=sys.stderr)
    TABLE.write_text(json.dumps(out, indent=0))
