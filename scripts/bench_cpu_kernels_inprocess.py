"""In-process timings of the CPU expert kernels, no pool and no DRAM-sized working set: one
expert (H=2048, I=512 and 768, weights cached after the first call) at 1/4/16 rows for every
instruction set this CPU runs (or the ones given) and each weight format (``--format``,
default int8 and int4), the cost of an empty parallel region, and
the SiLU + re-quantization stage (16 x 768) on one thread. For comparing kernel changes on a
development machine; DRAM figures come from bench_cpu_experts on the GPU machine.

    python -m scripts.bench_cpu_kernels_inprocess [--stages] [--isa avx512vnni]
        [--format int8,int4] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import numba
import numpy as np
from numba import njit, prange

from cpu_experts import isa as cpu_isa
from cpu_experts import kernels, shard
from cpu_experts.quant import quantize
from scripts.bench_common import best_us

H = 2048
SIZES = (512, 768)  # intermediate sizes I of the one expert


def stage_entries(isa: int):
    """The kernel's three parallel stages compiled for one instruction set (the isa argument
    must be a compile-time constant: a closure variable is one)."""

    @numba.njit
    def gate_up(gu, xk, xs, xc, active, offsets, rows_of, g_u, ahead):
        kernels._gate_up_stage(isa, gu, xk, xs, xc, active, offsets, rows_of, g_u, ahead)

    @numba.njit
    def down(w, hk, hs, hc, active, offsets, pair_of, slot_of_pair, weights, y, out, ahead):
        kernels._down_combine_stage(isa, w, hk, hs, hc, active, offsets, pair_of, slot_of_pair,
                                    weights, y, out, ahead)

    return gate_up, down


@njit(nogil=True, parallel=True)
def _empty_region(n: int, a) -> None:
    for i in prange(n):
        a[i] += 1.0


def empty_region_us() -> float:
    """An empty parallel region with one item per thread: each stage pays this once."""
    n = numba.get_num_threads()
    a = np.zeros(n)
    return best_us(partial(_empty_region, n, a), 50)


def stage_times(which: int, weights, I: int, rng, rows_list=(1, 4, 16)) -> list[dict]:
    """Per-stage times of one expert (every row on expert 0): where the cost of rows goes."""
    gate_up, down = stage_entries(which)
    gu, dn = weights
    int4 = gu.dtype == np.uint8
    flip = which == cpu_isa.ISA_AVX512VNNI and not int4
    records = []
    for rows in rows_list:
        q, d = quantize(rng.standard_normal((rows, H)).astype(np.float32))
        ids, w = np.zeros((rows, 1), np.int32), np.ones((rows, 1), np.float32)
        pair_of, pair_row, active, offsets, members = kernels.group_pairs(ids, 1)
        xk, xs, xc = kernels._decode_activations(q, d.view(np.uint16), rows, flip, int4)
        g_u = kernels.empty_f32_aligned(2 * rows * I).reshape((2, rows, I))
        hk, hs = np.empty((rows, I), np.int8), np.empty((rows, I // 32), np.float32)
        hc = np.empty((rows, I // 32), np.int32)
        y = kernels.empty_f32_aligned(rows * H).reshape((rows, H))
        out = np.empty((rows, H), np.float32)
        slots = np.arange(rows)
        rec = {"what": "stages_one_expert", "isa": cpu_isa.NAMES[which], "I": I, "rows": rows,
               "format": "int4" if int4 else "int8", "threads": numba.get_num_threads()}
        rec["gate_up_us"] = best_us(partial(gate_up, gu, xk, xs, xc, active, offsets,
                                            pair_row[members], g_u, kernels.PREFETCH_AHEAD))
        rec["act_us"] = best_us(partial(kernels._act_stage, g_u[0], g_u[1], flip, hk, hs, hc))
        rec["down_us"] = best_us(partial(down, dn, hk, hs, hc, active, offsets, pair_of, slots,
                                         w, y, out, kernels.PREFETCH_AHEAD))
        rec["layer_us"] = best_us(partial(kernels.layer_kernel(which), gu, dn, q,
                                          d.view(np.uint16), ids, w, out,
                                          kernels.PREFETCH_AHEAD))
        records.append(rec)
    return records


def expert_weights(I: int, rng, fmt: str = "int8") -> tuple[np.ndarray, np.ndarray]:
    """One expert's tiled gate/up and down (shard.py) in format ``fmt``, in memory."""
    ql = shard.quantize_layer(*(rng.standard_normal(s).astype(np.float32) * 0.03
                                for s in ((1, I, H), (1, I, H), (1, H, I))), fmt)
    manifest, size = shard.plan_shard({0: ql}, {0: (0, I)}, fmt)
    buf = bytearray(size)
    shard.write_shard(buf, manifest, {0: ql}, {0: (0, I)})
    return shard.views(buf, manifest)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--stages", action="store_true",
                    help="per-stage times of one expert (all threads, then one thread)")
    ap.add_argument("--isa", action="append", choices=sorted(cpu_isa.NAMES.values()),
                    help="only this instruction set (repeatable; default: all this CPU runs)")
    ap.add_argument("--format", default="int8,int4", help="weight formats (comma-separated)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    isas = [cpu_isa.select(name) for name in args.isa] if args.isa else cpu_isa.available()
    records = [{"what": "empty_parallel_region", "threads": numba.get_num_threads(),
                "us": empty_region_us()}]
    for fmt, I in [(f, i) for i in SIZES for f in args.format.split(",")]:
        weights = expert_weights(I, rng, fmt)
        for which in isas:
            kernel = kernels.layer_kernel(which)
            for rows in (1, 4, 16):
                q, d = quantize(rng.standard_normal((rows, H)).astype(np.float32))
                ids, w = np.zeros((rows, 1), np.int32), np.ones((rows, 1), np.float32)
                out = np.empty((rows, H), np.float32)
                us = best_us(partial(kernel, *weights, q, d.view(np.uint16), ids, w, out,
                                     kernels.PREFETCH_AHEAD))
                records.append({"what": "one_expert", "isa": cpu_isa.NAMES[which], "I": I,
                                "format": fmt, "rows": rows,
                                "threads": numba.get_num_threads(), "us": us,
                                "gmac_per_s": 3 * I * H * rows / us / 1e3})
            if args.stages:
                for threads in (numba.get_num_threads(), 1):
                    numba.set_num_threads(threads)
                    records += stage_times(which, weights, I, rng)
                numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(1)
    g = rng.standard_normal((16, 768)).astype(np.float32) * 3
    u = rng.standard_normal((16, 768)).astype(np.float32)
    hk, hs = np.empty((16, 768), np.int8), np.empty((16, 24), np.float32)
    hc = np.empty((16, 24), np.int32)
    records.append({"what": "silu_requant_16x768", "threads": 1,
                    "us": best_us(partial(kernels._act_stage, g, u, True, hk, hs, hc), 50)})
    for r in records:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
