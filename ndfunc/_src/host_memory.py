"""Host memory between steps: freed blocks stay with the process, as a caching allocator keeps them.

A training step on CPU allocates and frees the same blocks every step: activations, gathered
parameters, gradient buckets, tens of MB. glibc's malloc maps each block above its mmap threshold
(128 KiB at first, raised as such blocks are freed) afresh and unmaps it when it is freed, and
trims free memory off the top of its heap past its trim threshold (twice the mmap threshold, once
that has moved). The next step then takes those pages again, one fault each, zeroed by the kernel:
on the FSDP benchmark's llama (`benchmarks/fsdp.py`), 5,300 faults per rank and step, and 5% of
the step's CPU time (a few hundred faults with the thresholds below).

`keep_freed_memory()` sets both thresholds (`mallopt`): blocks below 32 MiB come from the heap,
and up to 256 MiB free at its top stays mapped, so a step reuses the pages the last one freed.
PyTorch's CUDA caching allocator keeps device memory for the same reason, and PyTorch's CPU tuning
guide gets the same effect by preloading jemalloc or tcmalloc. The price: memory a step freed
stays resident until the next takes it (the benchmark's peak resident set did not grow). The
setting is process-wide and replaces any `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` from
the environment; `nf.init()` makes it for a gloo world (`keep_host_memory=False` leaves malloc as
it is).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's own ceiling for its moving threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 256 * 2**20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # glibc only: musl and macOS have no mallopt thresholds
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Keep blocks below 32 MiB, and up to 256 MiB of free heap, mapped between steps; whether
    this C library took both settings (glibc does; elsewhere nothing changes)."""
    libc = _glibc()
    if libc is None:
        return False
    # setting either one fixes both (glibc stops moving the mmap threshold): set both
    mmap = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trim = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mmap and trim)
