"""How a machine's cores scale on vector arithmetic alone (issue 17's 16-row ratio).

On the lent H200/H100 machines one int4 expert's 16-row work takes ~4.6 us an item on one
thread but ~16 us an item with all 16 threads busy (docs/cpu_experts.md), though the data
sits in cache. This probe separates the machine from the kernel: each thread runs the same
float32 multiply-add loop on its own L1-resident buffer (no memory traffic, independent
accumulators, so the vector units' throughput bounds it), at each thread count in turn. If
the per-thread rate falls as threads are added, the cores share vector units or slow down
together (hyperthreads the guest does not see, other guests, a lower all-core clock), and a
kernel's multi-row speed is bounded by that, not by its code::

    python -m scripts.probe_cpu_scaling --threads 1,2,4,8,12,16 --out $OUT/cpu_scaling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numba
import numpy as np
from numba import njit, prange

WIDTH = 256  # accumulators per thread (16 AVX-512 registers of float32)


@njit(parallel=True, fastmath=True, cache=True)
def _spin(bufs: np.ndarray, iters: int) -> None:
    """bufs [T, 2 * WIDTH]: thread t runs ``iters`` x WIDTH multiply-adds on row t."""
    for t in prange(bufs.shape[0]):
        a = bufs[t]
        acc = a[:WIDTH].copy()
        for _ in range(iters):
            for j in range(WIDTH):
                acc[j] = acc[j] * np.float32(0.9999) + a[WIDTH + j]
        a[:WIDTH] = acc


def measure(threads: int, iters: int) -> float:
    """GFLOP/s per thread with ``threads`` threads busy."""
    numba.set_num_threads(threads)
    bufs = np.ones((threads, 2 * WIDTH), np.float32)
    t0 = time.perf_counter()
    _spin(bufs, iters)
    seconds = time.perf_counter() - t0
    return 2.0 * WIDTH * iters / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--iters", type=int, default=2_000_000, help="loop trips per thread")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")
              if 0 < int(t) <= numba.config.NUMBA_NUM_THREADS]
    measure(1, 1000)  # compile
    rates: dict[int, list[float]] = {t: [] for t in counts}
    for r in range(args.rounds):
        for t in counts if r % 2 == 0 else counts[::-1]:
            rates[t].append(measure(t, args.iters))
    one = statistics.median(rates[counts[0]])
    out = [{"threads": t, "gflops_per_thread": round(statistics.median(v), 2),
            "per_thread_vs_first": round(statistics.median(v) / one, 3)}
           for t, v in rates.items()]
    for rec in out:
        print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"records": out, "rounds": args.rounds, "iters": args.iters}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
