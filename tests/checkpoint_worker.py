"""Run by tests/test_checkpoint.py under torchrun: 4 real processes over gloo.

Saves the llama tiny() parameters and Adam state laid out dp_shard 2 x tp 2 (blocking, with
async_save, then asynchronously through a Manager), loads both on FSDP x4 and whole on every rank, and checks every
value against the single-process tree the test built from the same seed. Any failure raises.
"""

import pathlib
import sys

import optree
import torch

import ndfunc as nf
from models import llama
from ndfunc.sharding import NamedSharding, P


def make_tree():
    """The tiny llama's parameters and AdamW state (seed 0, one update so the moments are not
    zeros) and a step count."""
    cfg = llama.LlamaConfig.tiny()
    params = llama.init(cfg, nf.random.key(0))
    opt = nf.optim.adamw(1e-3)
    state = opt.init(params)
    grads = optree.tree_map(lambda p: torch.cos(p * 3.0), params)
    updates, state = opt.update(grads, state, params)
    return {"params": nf.optim.apply_updates(params, updates), "opt": state, "step": 7}


def shardings_for(tree, config: nf.ParallelConfig):
    """The NamedShardings `config`'s rules give the tree on its mesh (made here: inside the world)."""
    mesh = config.build_mesh()
    pspec = nf.sharding.logical_to_mesh(llama.param_axes(llama.LlamaConfig.tiny()), config.rules)
    sspec = nf.optim.state_shardings(tree["opt"], pspec)
    named = lambda specs: optree.tree_map(lambda s: NamedSharding(mesh, s), specs,  # noqa: E731
                                          is_leaf=lambda s: isinstance(s, P))
    return {"params": named(pspec), "opt": named(sspec), "step": None}


def laid_out(tree, shardings):
    return {k: tree[k] if shardings[k] is None else nf.device_put(tree[k], shardings[k]) for k in tree}


def same(a, b) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


def main(directory: str) -> None:
    nf.init()
    rank = nf.rank()
    root = pathlib.Path(directory)
    tree = make_tree()
    sharded = laid_out(tree, shardings_for(tree, nf.ParallelConfig(dp_shard_size=2, tp_size=2)))
    nf.checkpoint.save(root / "blocking", sharded)
    nf.checkpoint.async_save(root / "async", sharded).result()
    with nf.checkpoint.Manager(root / "run", keep=2) as manager:
        for step in (1, 2, 3):
            manager.save(step, sharded, blocking=False)
        manager.wait()
        assert manager.steps() == [2, 3], manager.steps()
    fsdp = shardings_for(tree, nf.ParallelConfig(dp_shard_size=4))
    for name in ("blocking", "async", "run/step_3"):
        got = nf.checkpoint.load(root / name, laid_out(tree, fsdp))
        assert got["params"]["embed"].placements == fsdp["params"]["embed"].placements
        assert same(nf.device_get(got), tree), name
        whole = nf.checkpoint.load(root / name, tree)  # plain tensors: every rank reads all of it
        assert same(whole, tree), name
    print(f"rank {rank}: checkpoint ok", flush=True)
    nf.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
