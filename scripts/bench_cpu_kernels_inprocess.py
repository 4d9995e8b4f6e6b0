"""In-process timings of the CPU expert kernels, no pool and no DRAM-sized working set: one
expert (H=2048, I=512 and 768, weights cached after the first call) at 1/4/16 rows for every
instruction set this CPU runs (or the ones given) and each weight format (``--format``,
default int8 and int4), the cost of an empty parallel region, and
the SiLU + re-quantization stage (16 x 768) on one thread. For comparing kernel changes on a
development machine; DRAM figures come from bench_cpu_experts on the GPU machine.

    python -m scripts.bench_cpu_kernels_inprocess [--stages] [--isa avx512vnni]
        [--format int8,int4] [--out FILE.json]

``--diag`` separates the kernel from the pool on a DRAM-sized working set instead (H=2048,
I=512, top-10 of 512 random experts, weights cycled through ~1.8 GB per format, on the cores a
pool's worker gets): per format and 1/4/16 rows, each stage in-process and the whole layer
in-process; at 1 row the prefetch distance, half the threads, and tiles placed 32 and 16 bytes
past a cache line (16: every 64-byte load of a block splits across two lines); then the same
routings through a CpuExpertPool (kernel time as the worker measures it, and wall)::

    python -m scripts.bench_cpu_kernels_inprocess --diag --out $OUT/int4_diag.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from functools import cache, partial

import numba
import numpy as np
from numba import njit, prange

from cpu_experts import act, activations, kernels, shard
from cpu_experts import isa as cpu_isa
from cpu_experts.quant import quantize
from scripts.bench_common import best_us, cpu_model

H = 2048
SIZES = (512, 768)  # intermediate sizes I of the one expert


@cache
def stage_entries(isa: int):
    """The kernel's three parallel stages compiled for one instruction set (the isa argument
    must be a compile-time constant: a closure variable is one; a call from Python with a
    plain int would type the call again each time), once per process."""

    @numba.njit
    def gate_up(gu, xk, xs, xc, active, offsets, rows_of, g_u, ahead, flip, hk, hs, hc):
        kernels.gate_up_act(isa, gu, xk, xs, xc, active, offsets, rows_of, g_u, ahead, flip,
                            hk, hs, hc)

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
        xk, xs, xc = activations.decode_activations(q, d.view(np.uint16), rows, flip, int4)
        g_u = activations.empty_f32_aligned(2 * rows * I).reshape((2, rows, I))
        hk, hs = np.empty((rows, I), np.int8), np.empty((rows, I // 32), np.float32)
        hc = np.empty((rows, I // 32), np.int32)
        y = activations.empty_f32_aligned(rows * H).reshape((rows, H))
        out = np.empty((rows, H), np.float32)
        slots = np.arange(rows)
        rec = {"what": "stages_one_expert", "isa": cpu_isa.NAMES[which], "I": I, "rows": rows,
               "format": "int4" if int4 else "int8", "threads": numba.get_num_threads()}
        rec["gate_up_us"] = best_us(partial(gate_up, gu, xk, xs, xc, active, offsets,
                                            pair_row[members], g_u, kernels.PREFETCH_AHEAD,
                                            flip, hk, hs, hc))
        rec["act_1thread_us"] = best_us(partial(act.act_rows, g_u[0], g_u[1], flip, hk, hs, hc))
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


DIAG_E, DIAG_I, DIAG_K = 512, 512, 10  # bench_cpu_experts' 512:512 combo, top-10
DIAG_BYTES = 1800 << 20  # weights per format, cycled: several times any L3
DIAG_AHEAD = (0, 4096, 8192, 16384, 32768)
KINDS = {False: "random", True: "one_expert"}  # routings, as bench_cpu_workload names them


def random_tiles(fmt: str, E: int, I: int, rng) -> list[tuple[mmap.mmap, mmap.mmap]]:
    """Layers of random weights straight in the kernels' tiled layout (no quantizer: the
    timing does not depend on the values), ~DIAG_BYTES in all, in 4 KiB pages as a pool's
    shared memory has them; each array 64 bytes longer than its tiles (see :func:`tiles_at`).
    Every byte is at most 0x3B, so any 2 or 4 bytes read as a scale are finite (and int8
    weights are never -128) wherever the tiles are taken to start."""
    shapes = (shard.tiled_shape(E, 2, I, H, fmt), shard.tiled_shape(E, 1, H, I, fmt))
    n_layers = max(1, round(DIAG_BYTES / sum(int(np.prod(s)) for s in shapes)))
    layers = []
    for _ in range(n_layers):
        pair = []
        for shape in shapes:
            n = int(np.prod(shape)) + 64
            buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf.madvise(mmap.MADV_NOHUGEPAGE)
            a = np.frombuffer(buf, np.uint8)
            for lo in range(0, n, 1 << 24):
                part = a[lo:lo + (1 << 24)]
                np.bitwise_and(np.frombuffer(rng.bytes(part.size), np.uint8), 0x3B, out=part)
            del a
            pair.append(buf)
        layers.append(tuple(pair))
    return layers


def tiles_at(layers: list, fmt: str, E: int, I: int, offset: int = 0) -> list[tuple]:
    """The kernels' ``(gu, down)`` views of :func:`random_tiles`' layers, starting ``offset``
    bytes into a page (0: on a cache line, as in a shard; 16: every 64-byte load of an int4
    or int8 block straddles two lines)."""
    dt = np.uint8 if fmt == "int4" else np.int8
    shapes = (shard.tiled_shape(E, 2, I, H, fmt), shard.tiled_shape(E, 1, H, I, fmt))
    return [tuple(np.frombuffer(buf, dt, int(np.prod(s)), offset).reshape(s)
                  for buf, s in zip(pair, shapes, strict=True)) for pair in layers]


def random_ids(E: int, k: int, rows: int, rng, one_expert: bool = False) -> np.ndarray:
    if one_expert:
        return np.full((rows, 1), rng.integers(E), np.int32)
    return np.stack([rng.choice(E, k, replace=False) for _ in range(rows)]).astype(np.int32)


def diag_stages(which: int, layers: list, ids_list: list[np.ndarray], rng) -> dict:
    """Median us of each stage of ``moe_layer`` run one by one (cold weights: layer i of
    the cycle, routing i), as moe_layer runs them."""
    gate_up, down = stage_entries(which)
    times: dict[str, list[float]] = {k: [] for k in ("decode", "gate_up", "down")}
    distinct = []
    for i, ids in enumerate(ids_list):
        gu, dn = layers[i % len(layers)]
        int4 = gu.dtype == np.uint8
        flip = which == cpu_isa.ISA_AVX512VNNI and not int4
        rows, (E, _, T, _, _) = ids.shape[0], gu.shape
        Is = T * 16
        q, d = quantize(rng.standard_normal((rows, H)).astype(np.float32))
        w = np.full(ids.shape, 0.1, np.float32)
        pair_of, pair_row, active, offsets, members = kernels.group_pairs(ids, E)
        P = pair_row.shape[0]
        slot_of_pair = np.empty(P, np.int64)
        slot_of_pair[members] = np.arange(P)
        g_u = activations.empty_f32_aligned(2 * P * Is).reshape((2, P, Is))
        hk, hs = np.empty((P, Is), np.int8), np.empty((P, Is // 32), np.float32)
        hc = np.empty((P, Is // 32), np.int32)
        y, out = activations.empty_f32_aligned(P * H), np.empty((rows, H), np.float32)
        t0 = time.perf_counter_ns()
        xk, xs, xc = activations.decode_activations(q, d.view(np.uint16), rows, flip, int4)
        t1 = time.perf_counter_ns()
        gate_up(gu, xk, xs, xc, active, offsets, pair_row[members], g_u, kernels.PREFETCH_AHEAD,
                flip, hk, hs, hc)  # SiLU and h's quantization included (act.py)
        t3 = time.perf_counter_ns()
        down(dn, hk, hs, hc, active, offsets, pair_of, slot_of_pair, w, y, out,
             kernels.PREFETCH_AHEAD)
        t4 = time.perf_counter_ns()
        if i >= 3:  # the first calls compile and warm up
            for k, dt in zip(times, (t1 - t0, t3 - t1, t4 - t3), strict=True):
                times[k].append(dt / 1e3)
            distinct.append(len(active))
    med = {f"{k}_us": float(np.median(v)) for k, v in times.items()}
    gu_b, dn_b = (a[0].nbytes for a in layers[0])
    A = float(np.mean(distinct))
    return {**med, "distinct_experts": A, "stages_us": sum(med.values()),
            "gate_up_gbps": A * gu_b / med["gate_up_us"] / 1e3,
            "down_gbps": A * dn_b / med["down_us"] / 1e3}


def diag_layer(which: int, layers: list, ids_list: list[np.ndarray], rng, ahead: int) -> dict:
    """Median us of whole ``moe_layer`` calls (cold weights) and GB/s of weight bytes."""
    kernel, times, distinct = kernels.layer_kernel(which), [], []
    for i, ids in enumerate(ids_list):
        q, d = quantize(rng.standard_normal((ids.shape[0], H)).astype(np.float32))
        w, out = np.full(ids.shape, 0.1, np.float32), np.empty((ids.shape[0], H), np.float32)
        t0 = time.perf_counter_ns()
        rc = kernel(*layers[i % len(layers)], q, d.view(np.uint16), ids, w, out, ahead)
        if rc != kernels.ERR_OK:  # a layer cut short would time too little
            raise RuntimeError(f"moe_layer returned {rc}")
        if i >= 3:
            times.append((time.perf_counter_ns() - t0) / 1e3)
            distinct.append(len(np.unique(ids)))
    us = float(np.median(times))
    ebytes = sum(a[0].nbytes for a in layers[0])
    return {"layer_us": us, "distinct_experts": float(np.mean(distinct)),
            "layer_gbps": float(np.mean(distinct)) * ebytes / us / 1e3}


def diag(which: int, formats: list[str], iters: int, pool_layers: int, out: str) -> list[dict]:
    """In-process stages and layers, then the pool, per format (see the module docstring);
    the records so far are written to ``out`` after each one (a run cut short keeps them)."""
    from cpu_experts.pool import CpuExpertPool  # noqa: PLC0415
    from scripts.bench_cpu_experts import measure  # noqa: PLC0415
    from scripts.bench_cpu_workload import random_layers, routings  # noqa: PLC0415

    usable = sorted(os.sched_getaffinity(0))
    client, cores = usable[0], usable[1:] or usable  # as bench_cpu_experts: core 0 dispatches
    os.sched_setaffinity(0, cores)  # Numba's threads start here: on the workers' cores
    numba.set_num_threads(len(cores))
    rng = np.random.default_rng(0)
    E, I, K = DIAG_E, DIAG_I, DIAG_K
    _empty_region(1, np.zeros(1))  # Numba's threads start (on those cores): its layer is known
    records = [{"what": "diag_machine", "cpu": cpu_model(), "cores": len(usable),
                "threads": len(cores), "isa": cpu_isa.NAMES[which],
                "threading_layer": numba.threading_layer(),
                "prefetch_bytes": kernels.PREFETCH_AHEAD}]
    print(json.dumps(records[0]), flush=True)

    def emit(rec: dict) -> None:
        rec = {"what": "diag", "isa": cpu_isa.NAMES[which], "I": I, "E": E, **rec}
        records.append(rec)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                          for k, v in rec.items()}), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(records, f, indent=1)

    for fmt in formats:
        t0 = time.perf_counter()
        tiles = random_tiles(fmt, E, I, rng)
        layers = tiles_at(tiles, fmt, E, I)
        print(f"# {fmt}: {len(layers)} layers of random tiles in {time.perf_counter() - t0:.1f} s",
              flush=True)
        base = {"format": fmt, "layers": len(layers), "threads": len(cores)}
        for rows, one in ((1, False), (4, False), (16, False), (1, True), (16, True)):
            ids = [random_ids(E, K, rows, rng, one) for _ in range(iters + 3)]
            rec = dict(base, part="inprocess", rows=rows, routing=KINDS[one],
                       topk=ids[0].shape[1], **diag_stages(which, layers, ids, rng))
            ids = [random_ids(E, K, rows, rng, one) for _ in range(iters + 3)]
            rec.update(diag_layer(which, layers, ids, rng, kernels.PREFETCH_AHEAD))
            emit(rec)
        one_row = dict(base, rows=1, routing="random", topk=K)
        for ahead in DIAG_AHEAD:
            ids = [random_ids(E, K, 1, rng) for _ in range(iters + 3)]
            emit(dict(one_row, part="inprocess_prefetch", ahead=ahead,
                      **diag_layer(which, layers, ids, rng, ahead)))
        for threads in sorted({len(cores), max(1, len(cores) // 2)}):
            numba.set_num_threads(threads)
            ids = [random_ids(E, K, 1, rng) for _ in range(iters + 3)]
            emit(dict(one_row, part="inprocess_threads", threads=threads,
                      **diag_layer(which, layers, ids, rng, kernels.PREFETCH_AHEAD)))
        numba.set_num_threads(len(cores))
        for offset in (32, 16):  # 0 is above; 16: every 64-byte chunk load is a split load
            ids = [random_ids(E, K, 1, rng) for _ in range(iters + 3)]
            emit(dict(one_row, part="inprocess_offset", offset=offset,
                      **diag_layer(which, tiles_at(tiles, fmt, E, I, offset), ids, rng,
                                   kernels.PREFETCH_AHEAD)))
        del layers, tiles
        if not pool_layers:
            continue
        t0 = time.perf_counter()
        os.sched_setaffinity(0, [client])
        with CpuExpertPool(random_layers(E, I, pool_layers, seed=E + I, fmt=fmt), cores=[cores],
                           max_rows=64, max_k=16, isa=cpu_isa.NAMES[which],
                           weight_format=fmt) as pool:
            print(f"# {fmt}: pool of {pool_layers} layers up in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            for rows, kind in [(1, "random"), (4, "random"), (16, "random"), (1, "one_expert"),
                               (16, "one_expert")]:
                ids = routings(kind, E, K, rows, iters + 4, seed=rows * 100 + K)
                emit(dict(base, part="pool", layers=pool_layers, rows=rows, routing=kind,
                          topk=ids[0].shape[1], **measure(pool, pool_layers, ids, I, warmup=4)))
        os.sched_setaffinity(0, cores)
    print(diag_summary(records), flush=True)
    return records


def diag_summary(records: list[dict]) -> str:
    """One line per format, routing and row count: GB/s of weight bytes in-process (gate/up,
    down, whole layer) and through the pool (the worker's kernel time), and us."""
    lines = ["format routing rows | inproc gate_up down layer GB/s (layer us) | "
             "pool kernel GB/s (us)"]
    pool = {(r["format"], r["routing"], r["rows"]): r for r in records if r.get("part") == "pool"}
    for r in records:
        if r.get("part") != "inprocess":
            continue
        p = pool.get((r["format"], r["routing"], r["rows"]))
        tail = f"{p['kernel_gbps']:6.1f} ({p['kernel_us']:7.1f})" if p else "-"
        lines.append(f"{r['format']} {r['routing']:10s} {r['rows']:2d} | {r['gate_up_gbps']:6.1f} "
                     f"{r['down_gbps']:6.1f} {r['layer_gbps']:6.1f} ({r['layer_us']:7.1f}) | "
                     f"{tail}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--stages", action="store_true",
                    help="per-stage times of one expert (all threads, then one thread)")
    ap.add_argument("--isa", action="append", choices=sorted(cpu_isa.NAMES.values()),
                    help="only this instruction set (repeatable; default: all this CPU runs)")
    ap.add_argument("--format", default="int8,int4", help="weight formats (comma-separated)")
    ap.add_argument("--diag", action="store_true",
                    help="kernel vs pool on a DRAM-sized working set (module docstring)")
    ap.add_argument("--iters", type=int, default=20, help="--diag: calls per case")
    ap.add_argument("--pool-layers", type=int, default=1,
                    help="--diag: layers in the pool (0: no pool)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    isas = [cpu_isa.select(name) for name in args.isa] if args.isa else cpu_isa.available()
    if args.diag:
        diag(isas[-1], args.format.split(","), args.iters, args.pool_layers, args.out)
        return
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
                    "us": best_us(partial(act.act_rows, g, u, True, hk, hs, hc), 50)})
    for r in records:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
