"""The machine's memory as the CPU experts see it: DRAM read bandwidth (a Numba parallel sum)
and whether 2 MiB pages change the layer kernel's streaming rate."""

from __future__ import annotations

import json
import time

import numpy as np
from numba import njit, prange, set_num_threads

from cpu_experts.quant import quantize
from scripts.bench_common import timings
from scripts.bench_cpu_workload import H, random_layers, routings


@njit(parallel=True, cache=True)
def _parallel_sum(a):
    s = 0
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def dram_read_gbps(threads: int, nbytes: int = 2 << 30) -> float:
    """Best of 5 parallel sums over ``nbytes`` of uint64 (read bandwidth, cold caches)."""
    set_num_threads(threads)
    a = np.ones(nbytes // 8, np.uint64)
    _parallel_sum(a[:1024])
    best = min(timings(lambda _: _parallel_sum(a), range(5))[0])
    return nbytes / best / 1e9


def page_experiment(threads: int, iters: int, I: int = 768, E: int = 128) -> list[dict]:
    """The layer kernel called in-process (no pool) on the same tiled weights in 4 KiB pages
    and in anonymous memory advised for 2 MiB pages: does the page size change the streaming
    rate? 1 row, top-8 random routing, enough layers to exceed the L3."""
    import mmap

    from cpu_experts import isa as cpu_isa
    from cpu_experts import kernels, shard

    set_num_threads(threads)
    layers = random_layers(E, I, 3, seed=1)
    manifest, size = shard.plan_shard(layers, {k: (0, I) for k in layers})
    kernel = kernels.layer_kernel(cpu_isa.select())
    x = np.random.default_rng(0).standard_normal((1, H)).astype(np.float32)
    q, d = quantize(x)
    out = np.empty((1, H), np.float32)
    results = []
    for pages in ("4k", "2m"):
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if pages == "4k":
            buf.madvise(mmap.MADV_NOHUGEPAGE)
        else:
            buf.madvise(mmap.MADV_HUGEPAGE)
        shard.write_shard(buf, manifest, layers, {k: (0, I) for k in layers})
        views = shard.views(buf, manifest)
        ids_list = routings("random", E, 8, 1, iters + 4, seed=3)
        times = []
        for i, ids in enumerate(ids_list):
            t0 = time.perf_counter_ns()
            kernel(*views[i % len(views)], q, d.view(np.uint16), ids,
                   np.ones(ids.shape, np.float32), out, kernels.PREFETCH_AHEAD)
            if i >= 4:
                times.append(time.perf_counter_ns() - t0)
        us = float(np.median(times)) / 1e3
        wbytes = 8 * 3 * I * H * (1 + 4 / 32)
        rec = {"pages": pages, "I": I, "E": E, "rows": 1, "topk": 8, "threads": threads,
               "kernel_us": us, "kernel_gbps": wbytes / us / 1e3,
               "huge_kib": _smaps_anon_huge_kib()}
        print("# pages", json.dumps(rec), flush=True)
        results.append(rec)
        del views  # the mapping goes with its last view
    return results


def _smaps_anon_huge_kib() -> int:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1

