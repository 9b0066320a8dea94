"""Run by tests/test_gpu.py under `torchrun --nproc-per-node 1`: ndfunc's NCCL path on one GPU.

`nf.init()` joins torchrun's world (NCCL, this process on GPU LOCAL_RANK); a mesh of one rank is
a CUDA mesh; `device_put` puts CPU and CUDA values on it as CUDA blocks and `device_get` gives
them back whole; the jitted llama step on it equals the same step eager on CUDA and on CPU; and
the program that runs is the one lowered: no gloo all-to-all form, no oneDNN matmul, with the
oneDNN rewrite switched on as on an AMD host. Any failure raises, so torchrun exits non-zero.
"""

import optree
import torch
import torch.distributed as dist
from helpers import arange  # this folder is first on sys.path under torchrun
from test_gpu import FP32_ACROSS_DEVICES, assert_close, cpu_kernel_calls, llama_case, on

import ndfunc as nf
from models import train
from ndfunc._src.partition.backends import cpu_kernels as kernels
from ndfunc.sharding import NamedSharding, P


def main() -> None:
    torch.set_float32_matmul_precision("highest")  # fp32 matmuls in fp32, not TF32
    kernels.ONEDNN_MATMUL = True  # read when a step is compiled: a CUDA mesh must still say no
    nf.init()
    assert dist.get_backend() == "nccl" and nf.world_size() == 1, (dist.get_backend(), nf.world_size())
    mesh = nf.make_mesh(dp=1)
    assert mesh.device_type == "cuda", mesh

    for full in (arange((8, 4)), arange((8, 4)).cuda()):
        x = nf.device_put(full, NamedSharding(mesh, P("dp")))
        assert x.to_local().device.type == "cuda", x.to_local().device
        back = nf.device_get(x)
        assert back.device.type == "cuda" and torch.equal(back.cpu(), full.cpu())

    cfg, opt, params, batch = llama_case()
    step = train.make_step(cfg, opt)
    state = opt.init(params)
    on_cpu = step(params, state, batch)
    args = on("cuda", (params, state, batch))
    eager = step(*args)
    replicated = lambda tree: optree.tree_map(lambda _: NamedSharding(mesh, P()), tree)  # noqa: E731
    p, s = (nf.device_put(t, replicated(t)) for t in args[:2])
    jitted = nf.jit(step, mesh=mesh, donate_argnums=(0, 1))
    lowered = jitted.lower(p, s, args[2])
    got = nf.device_get(jitted(p, s, args[2]))
    assert all(x.device.type == "cuda" for x in optree.tree_leaves(got))
    assert_close(got, eager, **FP32_ACROSS_DEVICES)
    assert_close(got, on_cpu, **FP32_ACROSS_DEVICES)
    compiled = lowered.compile()
    assert compiled.runs is lowered.program.local and not cpu_kernel_calls(compiled.runs)
    print("rank 0: nccl world of one ok", flush=True)
    nf.shutdown()


if __name__ == "__main__":
    main()
