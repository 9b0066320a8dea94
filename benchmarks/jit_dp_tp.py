"""DP x TP (2 x 2) on 4 processes: nf.jit's step against the same strategy done PyTorch's own way.

    torchrun --standalone --nproc-per-node 4 benchmarks/jit_dp_tp.py [--model mid] [--steps 5]

PyTorch's way, as torchtitan does it: the Hugging Face `LlamaForCausalLM` with the same weights
(written by `models.hf.save_llama`), tensor parallelism by `parallelize_module` over the `tp` axis
(q/k/v and the MLP's up projections column-wise, o and down row-wise: one all-reduce each for
attention and MLP, attention on local heads), data parallelism by all-reducing the gradients over
`dp` after backward in one bucket (what DDP does, without overlapping it with backward),
`torch.optim.AdamW`.
nf.jit gets the same layouts by logical rules (heads, kv_heads and mlp over tp, batch over dp;
embeddings and norms replicated) and partitions the whole step itself. Both see the same batches;
their losses are printed side by side. Reported on rank 0: median seconds per step and the ratio
nf.jit / PyTorch (below 1: nf.jit is faster).
On an AMD CPU nf.jit runs its fp32 matmuls as oneDNN's where PyTorch's `mm` runs MKL's AVX2 path
(ndfunc._src.partition.backends.cpu_kernels); run with NDFUNC_ATEN_MATMUL=1 to give both sides the same kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _llama import CONFIGS, setup
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import ndfunc as nf
from models import hf, llama
from ndfunc.sharding import NamedSharding, P

RULES = [("batch", "dp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp")]


def native(cfg, path: str, mesh: nf.sharding.Mesh, lr: float, wd: float):
    """A step function for the Hugging Face model, tensor-parallel over tp, data-parallel over dp."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
    tp_mesh, dp_group = mesh.device_mesh["tp"], mesh.device_mesh.get_group("dp")
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, eps=1e-8)
    dp = mesh.axis_size("dp")

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["tokens"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
        loss.backward()
        # DDP's all-reduce of gradients over dp, in one bucket as DDP packs them
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_group)
        flat.div_(dp)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        return total / dp

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mid", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    nf.init()
    rank = nf.rank()
    assert nf.world_size() == 4, "run with torchrun --nproc-per-node 4"
    cfg, params, batches = setup(args.model, args.batch, args.seq, args.steps)
    mesh = nf.make_mesh(dp=2, tp=2)
    lr, wd = 1e-3, 0.1

    # PyTorch's way: the checkpoint written once, read by every rank
    path = os.path.join(tempfile.gettempdir(), f"ndfunc-bench-{args.model}")
    if rank == 0:
        hf.save_llama(path, cfg, params)
    dist.barrier()
    native_step = native(cfg, path, mesh, lr, wd)
    dp_rank = mesh.coordinate(rank)[0]
    per_dp = args.batch // 2

    def native_batch(b):
        return {k: v[dp_rank * per_dp:(dp_rank + 1) * per_dp] for k, v in b.items()}

    # nf.jit
    opt = nf.optim.adamw(lr, weight_decay=wd)

    def step(params, state, batch):
        loss, grads = nf.value_and_grad(llama.loss)(params, batch, cfg)
        updates, state = opt.update(grads, state, params)
        return nf.optim.apply_updates(params, updates), state, loss

    pspec = nf.sharding.logical_to_mesh(llama.param_axes(cfg), RULES)
    bspec = nf.sharding.logical_to_mesh(("batch", None), RULES)
    state = opt.init(params)
    sspec = nf.optim.state_shardings(state, pspec)
    named = lambda specs: optree.tree_map(lambda s: NamedSharding(mesh, s), specs,  # noqa: E731
                                          is_leaf=lambda s: isinstance(s, P))
    jitted = nf.jit(step, mesh=mesh, in_shardings=(pspec, sspec, bspec), out_shardings=(pspec, sspec, P()),
                    donate_argnums=(0, 1))
    carry = [nf.device_put(params, named(pspec)), nf.device_put(state, named(sspec))]
    placed = [nf.device_put(b, {k: NamedSharding(mesh, bspec) for k in b}) for b in batches]

    def jit_step(i):
        carry[0], carry[1], loss = jitted(carry[0], carry[1], placed[i])
        return nf.device_get(loss)

    t0 = time.perf_counter()
    losses = {"jit": [float(jit_step(0))], "torch": [float(native_step(native_batch(batches[0])))]}
    first = time.perf_counter() - t0
    times = {"jit": [], "torch": []}
    for i in range(1, args.steps + 1):  # interleaved, so drift hits both alike
        for label, fn in (("torch", lambda: native_step(native_batch(batches[i]))), ("jit", lambda: jit_step(i))):
            dist.barrier()
            start = time.perf_counter()
            losses[label].append(float(fn()))
            times[label].append(time.perf_counter() - start)
    if rank == 0:
        t_jit, t_torch = statistics.median(times["jit"]), statistics.median(times["torch"])
        n = sum(x.numel() for x in optree.tree_leaves(params)) / 1e6
        print(f"{args.model} ({n:.1f}M params), batch {args.batch} x {args.seq}, DP x TP 2 x 2 on 4 gloo processes")
        print(f"  PyTorch (parallelize_module + bucketed dp all-reduce + AdamW): {t_torch * 1e3:8.1f} ms/step")
        print(f"  nf.jit:                                                       {t_jit * 1e3:8.1f} ms/step  "
              f"(first call, tracing and partitioning included: {first:.1f} s)")
        print(f"  ratio nf.jit / PyTorch: {t_jit / t_torch:.2f}")
        print(f"  losses torch: {' '.join(f'{x:.4f}' for x in losses['torch'])}")
        print(f"  losses jit:   {' '.join(f'{x:.4f}' for x in losses['jit'])}")
        comm = jitted.lower(carry[0], carry[1], placed[0]).cost_analysis()
        print(f"  nf.jit per step per rank: {comm['collectives']}, {comm['comm_bytes']['total'] / 1e6:.2f} MB sent")
    nf.shutdown()


if __name__ == "__main__":
    main()
