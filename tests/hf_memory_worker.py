"""Run by tests/test_hf_memory.py under torchrun: each rank loads its FSDP blocks of a checkpoint
and reports how much its memory grew. Prints one JSON line per rank."""

import json
import sys


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def main(path: str, warmup_path: str) -> None:
    import gc

    import torch

    import ndfunc as nf
    from models import hf, llama
    from ndfunc.sharding import NamedSharding, logical_to_mesh

    nf.init()
    config = nf.ParallelConfig(dp_shard_size=-1).resolve()
    mesh = config.build_mesh()

    def load(path):
        cfg = hf.config_from_hf(json.loads(open(f"{path}/config.json").read()))
        shardings = nf.tree.tree_map_with_path(
            lambda p, s: NamedSharding(mesh, s), logical_to_mesh(llama.param_axes(cfg), config.rules))
        return hf.load_llama(path, shardings)[1]

    # A first load pays one-off costs (lazy initialisation in torch, DTensor and safetensors) that
    # do not grow with the checkpoint; a small warm-up load takes them, and is reported apart.
    gc.collect()
    anon0 = rss_kib("RssAnon")
    warmup = load(warmup_path)
    gc.collect()
    anon1, hwm1 = rss_kib("RssAnon"), rss_kib("VmHWM")
    params = load(path)
    gc.collect()
    local = sum(x.to_local().numel() * x.element_size() for _, x in nf.tree.tree_flatten_with_path(params)[0])
    print(json.dumps({"rank": nf.rank(), "warmup_growth": (anon1 - anon0) * 1024,
                      "anon_growth": (rss_kib("RssAnon") - anon1) * 1024,
                      "peak_growth": (rss_kib("VmHWM") - hwm1) * 1024, "local_bytes": local}), flush=True)
    del warmup
    del params, torch
    nf.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
