"""ndfunc.random against torch's own generator: 10**8 float32 normals (and uniforms) on CPU.

    python benchmarks/rng.py                       # 10**8 values, 2 threads
    python benchmarks/rng.py --n 10000000 --threads 4 --no-compile

For each sampler, the median wall time of torch's (`torch.randn` / `torch.rand`: the CPU generator,
sequential rather than counter-based per index), of ndfunc's eager kernels (torch ops over chunks of
`CHUNK` values: the reference, what the tests check), and of its `torch.compile`'d kernels
(`nfr.use_compile()`: one fused loop per chunk of `COMPILE_CHUNK` values), with ratios to torch's.
The first compiled call's time (compilation included; inductor caches it on disk for later runs) is
shown apart, and the compiled values are checked bit for bit against the eager ones.
"""



def median_seconds(fn, repeats: int) -> float:
    import statistics
    import time

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import argparse
    import time

    import torch

    from ndfunc import random as nfr

    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10**8, help="values per call")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd kernels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    key, shape = nfr.key(0), (args.n,)
    print(f"{args.n:.0e} float32 values, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"CHUNK={nfr.CHUNK}, COMPILE_CHUNK={nfr.COMPILE_CHUNK}")
    print(f"{'sampler':<10}{'torch':>10}{'eager':>10}{'ratio':>8}{'compiled':>10}{'ratio':>8}{'1st call':>10}  same bits")
    for name, native, sample in [("normal", torch.randn, lambda: nfr.normal(key, shape)),
                                 ("uniform", torch.rand, lambda: nfr.uniform(key, shape))]:
        native(args.n)  # warm up the allocator and thread pool
        t_native = median_seconds(lambda native=native: native(args.n), args.repeats)
        nfr.use_compile(False)
        eager = sample()
        t_eager = median_seconds(sample, args.repeats)
        row = f"{name:<10}{t_native:>9.3f}s{t_eager:>9.3f}s{t_eager / t_native:>8.1f}"
        if not args.no_compile:
            nfr.use_compile(True)
            start = time.perf_counter()
            compiled = sample()
            t_first = time.perf_counter() - start
            t_compiled = median_seconds(sample, args.repeats)
            same = torch.equal(compiled.view(torch.int32), eager.view(torch.int32))
            row += f"{t_compiled:>9.3f}s{t_compiled / t_native:>8.1f}{t_first:>9.1f}s  {same}"
            nfr.use_compile(False)
            del compiled
        print(row, flush=True)
        del eager


if __name__ == "__main__":
    main()
