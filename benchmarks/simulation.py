"""What `nf.simulate(n)` costs over the work: a compiled llama train step (loss, gradients, AdamW)
on n simulated ranks against n runs of one rank's local program on one device.

    python benchmarks/simulation.py [--models tiny small] [--ranks 4 8] [--repeats 5]

For each model and n: the step as simulation runs it (each rank's ops on its plain blocks, the
collectives over the ranks' lists: `ndfunc._src.simulated_program`), the same step through
torch's simulated-tensor mode op by op (what ran before, and what runs when a dispatch mode of
the caller's watches), and n times rank 0's local program on its own blocks with the simulation
off (its collectives then return at once, unreduced: the ops' own cost). Medians of `--repeats`
runs after one warm-up; ratios are the simulated step over n one-rank runs (the goal: <= 2).
4 ranks are dp_shard 2 x tp 2, 8 ranks dp_shard 2 x cp 2 x tp 2, micro-batch 2 sequences of 64
tokens per data-parallel rank. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ndfunc as nf
from models import llama, train
from ndfunc.sharding import P
from ndfunc._src.runtime import simulation_paused
from ndfunc._src.torch_compat import LocalTensor, local_blocks, local_of

LAYOUTS = {4: nf.ParallelConfig(dp_shard_size=2, tp_size=2), 8: nf.ParallelConfig(dp_shard_size=2, cp_size=2, tp_size=2)}
MODELS = {"tiny": llama.LlamaConfig.tiny, "small": llama.LlamaConfig.small}
SEQ, MICRO = 64, 2


class _Watching(TorchDispatchMode):
    """A dispatch mode above the simulation: every op goes through the simulated-tensor mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _median(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model: str, n: int, repeats: int) -> dict:
    cfg = MODELS[model]()
    config = LAYOUTS[n]
    opt = nf.optim.adamw(1e-3)

    step = train.make_loss_step(lambda params, batch: llama.loss(params, batch, cfg), opt, config.rules)
    g = torch.Generator().manual_seed(0)
    batch_size = MICRO * config.dp_world_size
    batch = {k: torch.randint(0, cfg.vocab_size, (batch_size, SEQ), generator=g) for k in ("tokens", "targets")}
    batch["positions"] = torch.arange(SEQ).expand(batch_size, SEQ).contiguous()  # as the train job's
    with nf.simulate(n):
        mesh = config.build_mesh()
        pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), config.rules)
        bspec = {k: config.batch_spec for k in batch}
        params = llama.init(cfg, nf.random.key(0))
        state = opt.init(params)
        sspec = nf.optim.state_shardings(state, pspec)
        with mesh:
            args = nf.device_put((params, state, batch), (pspec, sspec, bspec))
        jitted = nf.jit(step, mesh=mesh, in_shardings=(pspec, sspec, bspec), out_shardings=(pspec, sspec, P()))
        compiled = jitted.lower(*args).compile()
        simulated = _median(lambda: compiled(*args), repeats)
        with _Watching():
            through_mode = _median(lambda: compiled(*args), max(1, repeats // 2))
        # rank 0's local program on its own blocks, the simulation off
        _, prepared, _ = compiled._arguments.prepare(args, {})
        blocks = [local_of(x) if hasattr(x, "_local_tensor") else x for x in prepared]
        blocks = [local_blocks(x)[0].clone() if isinstance(x, LocalTensor) else x for x in blocks]
        coords = local_blocks(compiled._coords_tensor(torch.device("cpu")))[0]
        with simulation_paused(), torch.no_grad():
            one_rank = _median(lambda: compiled._forward(*blocks, coords), repeats)
    return {"model": model, "ranks": n, "simulated_s": simulated, "mode_s": through_mode, "one_rank_s": one_rank,
            "ratio": simulated / (n * one_rank), "mode_ratio": through_mode / (n * one_rank)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(MODELS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[4, 8], choices=sorted(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'model':6s} {'ranks':>5s} {'simulated':>10s} {'mode':>9s} {'one rank':>9s} {'sim/(n x one)':>14s} "
          f"{'mode/(n x one)':>15s}")
    for model in args.models:
        for n in args.ranks:
            r = measure(model, n, args.repeats)
            print(f"{r['model']:6s} {r['ranks']:5d} {r['simulated_s']:9.3f}s {r['mode_s']:8.3f}s "
                  f"{r['one_rank_s']:8.4f}s {r['ratio']:14.2f} {r['mode_ratio']:15.2f}", flush=True)


if __name__ == "__main__":
    main()
