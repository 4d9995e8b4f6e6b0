"""Benchmark the CPU experts: one MoE layer through CpuExpertPool, per routing and row count.

Measures the machine's DRAM read bandwidth itself (a Numba parallel sum over 2 GiB with the
workers' thread count), then for H=2048, I in {512, 768}, E in {128, 512}, top-k in {8, 10},
rows in {1, 4, 8, 12, 16}, routing random and skewed, times ``dispatch_quantized`` (the QFUSE
path: activations arrive quantized) and reports per layer: distinct experts, weight bytes
read, wall time, worker kernel time, effective GB/s and dispatch overhead (wall - kernel).
Extra records: ``one_expert`` (every row on one expert: the cost of rows), ``shared`` (every
row on the same top-k experts, only with ``--kinds shared``: the cost of rows per expert with
every thread busy) and ``none`` (no pair on the CPU: pure dispatch overhead). Weights are
random, in each ``--format`` (int8 and int4 by default: a record's ``format``; weight bytes
are the format's stored bytes) with small fp16 scales; enough layers are cycled that the
working set is several times the L3.

    python -m scripts.bench_cpu_experts --out docs/bench/cpu_experts_h200.json
    python -m scripts.bench_cpu_experts --quick   # small sizes, for a smoke run

Workload: ``bench_cpu_workload.py``; DRAM and page-size figures: ``bench_cpu_memory.py``;
``--table``: ``bench_cpu_tables.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
from numba import get_num_threads, set_num_threads

from cpu_experts.dispatch_timer import DispatchTimer
from cpu_experts.formats import bytes_per_weight
from cpu_experts.pool import CpuExpertPool
from cpu_experts.quant import quantize
from scripts.bench_common import cpu_model
from scripts.bench_cpu_memory import dram_read_gbps, page_experiment
from scripts.bench_cpu_tables import markdown_tables
from scripts.bench_cpu_workload import ROWS, H, random_layers, routings


def expert_bytes(pool: CpuExpertPool, I: int) -> float:
    """Stored bytes of one expert (gate + up + down) in the pool's format, scales included."""
    return 3 * I * H * bytes_per_weight(pool.weight_format)


def measure(pool: CpuExpertPool, n_layers: int, ids_list: list[np.ndarray], I: int,
            warmup: int) -> dict:
    rows = ids_list[0].shape[0]
    x = np.random.default_rng(rows).standard_normal((rows, H)).astype(np.float32)
    q, d = quantize(x)
    walls, kernels, distinct, parts = [], [], [], []
    out = np.zeros((rows, H), np.float32)  # reused, as the GPU worker reuses its buffer
    pool.timer = timer = DispatchTimer()
    for i, ids in enumerate(ids_list):
        w = np.full(ids.shape, 1.0 / ids.shape[1], np.float32)
        t0 = time.perf_counter_ns()
        pool.dispatch_quantized(i % n_layers, q, d, ids, w, out=out)
        wall = time.perf_counter_ns() - t0
        if i >= warmup:
            walls.append(wall)
            kernels.append(int(pool.last_kernel_ns.max()))
            parts.append((timer.wake_ns, timer.notice_ns, timer.client_ns, timer.pre_ns))
            distinct.append(len(np.unique(ids[ids >= 0])))
    pool.timer = None
    wall_us = float(np.median(walls)) / 1e3
    kernel_us = float(np.median(kernels)) / 1e3
    wbytes = float(np.mean(distinct)) * expert_bytes(pool, I)
    return {"distinct_experts": float(np.mean(distinct)), "weight_bytes": wbytes,
            "us_per_layer": wall_us, "kernel_us": kernel_us,
            "effective_gbps": wbytes / wall_us / 1e3 if wbytes else 0.0,
            "kernel_gbps": wbytes / kernel_us / 1e3 if wbytes else 0.0,
            "dispatch_us": float(np.median(np.subtract(walls, kernels))) / 1e3,
            # where dispatch time goes: ring -> worker starts, worker ends -> seen, client work
            **{f"{name}_us": float(np.median([p[i] for p in parts])) / 1e3
               for i, name in enumerate(("wake", "notice", "client", "pre"))}}


def measure_gpu(pool: CpuExpertPool, n_layers: int, ids_list: list[np.ndarray], I: int,
                warmup: int, path: str) -> dict:
    """The GPU worker's view of one layer on the host path: quantized activations, ids and
    weights in GPU memory -> copies to NumPy, ``dispatch_quantized``, copy back -> the
    summed CPU partials in GPU memory, stream synchronized."""
    import cupy  # noqa: PLC0415

    rows = ids_list[0].shape[0]
    x = np.random.default_rng(rows).standard_normal((rows, H)).astype(np.float32)
    q, d = quantize(x)
    q_dev, d_dev = cupy.asarray(q), cupy.asarray(d)
    stream = cupy.cuda.get_current_stream()
    host_out = np.zeros((rows, H), np.float32)
    walls, kernels = [], []
    for i, ids in enumerate(ids_list):
        ids_dev = cupy.asarray(ids, dtype=cupy.int64)  # the router's dtype
        w_dev = cupy.full(ids.shape, 1.0 / ids.shape[1], cupy.float32)
        stream.synchronize()
        t0 = time.perf_counter_ns()
        pool.dispatch_quantized(i % n_layers, q_dev.get(), d_dev.get(), ids_dev.get(),
                                w_dev.get(), out=host_out)
        out = cupy.asarray(host_out)
        stream.synchronize()
        wall = time.perf_counter_ns() - t0
        del out
        if i >= warmup:
            walls.append(wall)
            kernels.append(int(pool.last_kernel_ns.max()))
    return {"path": path,
            "us_per_layer": float(np.median(walls)) / 1e3,
            "kernel_us": float(np.median(kernels)) / 1e3,
            "dispatch_us": float(np.median(np.subtract(walls, kernels))) / 1e3}


def measure_gpu_launched(pool: CpuExpertPool, link, n_layers: int, ids_list: list[np.ndarray],
                         I: int, path: str, per_step: int = 8) -> dict:
    """The GPU worker's view through ``PinnedRing.launch/gather``: steps of ``per_step``
    layers enqueued back to back (the GPU rings the workers and waits for them), the stream
    synchronized once per step (``end_step``). Per layer: wall / layers, the slowest worker's
    kernel time, their difference (dispatch + transfer), how long the host took to enqueue
    it (``launch_us`` + ``gather_us``), and on the GPU's clock: from ringing the workers to
    seeing them done minus their kernel time (``latency_us``: wake-up, the worker's Python
    around the kernel, notice) and from seeing them done to ringing for the next layer
    (``gap_us``: the copy, the sum and the next launch kernel). The first step is a warm-up."""
    import cupy  # noqa: PLC0415

    from cpu_experts.rings import HIST  # noqa: PLC0415

    rows = ids_list[0].shape[0]
    x = np.random.default_rng(rows).standard_normal((rows, H)).astype(np.float32)
    q, d = quantize(x)
    q_dev, d_dev = cupy.asarray(q), cupy.asarray(d)
    stream = cupy.cuda.get_current_stream()
    times = cupy.zeros((per_step, 2), cupy.uint64)
    steps = [ids_list[j:j + per_step] for j in range(0, len(ids_list) - per_step + 1, per_step)]
    cols = ("wall", "kernel", "launch", "gather", "latency", "gap")
    samples: dict[str, list[float]] = {c: [] for c in cols}
    distinct = []
    for n, step in enumerate(steps):
        dev = [(cupy.asarray(ids, dtype=cupy.int64),
                cupy.full(ids.shape, 1.0 / ids.shape[1], cupy.float32)) for ids in step]
        stream.synchronize()
        seqs, t_launch, t_gather = [], 0, 0
        t0 = time.perf_counter_ns()
        for i, (ids_dev, w_dev) in enumerate(dev):
            ta = time.perf_counter_ns()
            link.launch((n * per_step + i) % n_layers, q_dev, d_dev, ids_dev, w_dev,
                        times=times[i])
            tb = time.perf_counter_ns()
            link.gather()
            t_launch += tb - ta
            t_gather += time.perf_counter_ns() - tb
            seqs.append(link.last_seq)
        link.end_step()
        wall = time.perf_counter_ns() - t0
        if not n:
            continue
        rung = [bool((ids >= 0).any()) for ids in step]  # else the workers were not rung
        kern = [int(pool.ring.hist[:, s % HIST].max()) if r else 0 for s, r in zip(
            seqs, rung, strict=True)]
        ts = times.get().astype(np.int64)
        L = len(step)
        samples["wall"].append(wall / L)
        samples["kernel"].append(sum(kern) / L)
        samples["launch"].append(t_launch / L)
        samples["gather"].append(t_gather / L)
        if all(rung):
            samples["latency"] += [float(ts[i, 1] - ts[i, 0] - kern[i]) for i in range(L)]
            samples["gap"] += [float(ts[i + 1, 0] - ts[i, 1]) for i in range(L - 1)]
        distinct += [len(np.unique(ids[ids >= 0])) for ids in step]
    med = {c: float(np.median(v)) / 1e3 if v else float("nan") for c, v in samples.items()}
    wbytes = float(np.mean(distinct)) * expert_bytes(pool, I)
    return {"path": path, "layers_per_step": per_step, "us_per_layer": med["wall"],
            "kernel_us": med["kernel"],
            "effective_gbps": wbytes / med["wall"] / 1e3 if wbytes else 0.0,
            "dispatch_us": float(np.median(np.subtract(samples["wall"], samples["kernel"])))
            / 1e3, "enqueue_us": med["launch"] + med["gather"],
            **{f"{c}_us": med[c] for c in cols[2:]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--client-core", type=int, default=0)
    ap.add_argument("--client-cores", default="",
                    help="cores of the dispatching process (default: --client-core alone); "
                         "the workers get the others")
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--isa", default=None, help="portable | avx2 | avx512vnni (default: best)")
    ap.add_argument("--format", default="int8,int4", help="CPU weight formats to run")
    ap.add_argument("--prefetch", type=int, default=None, help="prefetch distance, bytes")
    ap.add_argument("--combos", default="", help="I:E pairs, e.g. 512:128,768:512")
    ap.add_argument("--kinds", default="random,skewed,one_expert,none",
                    help="routings to run (comma-separated)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts to run")
    ap.add_argument("--topks", default="", help="top-k values (default 8,10)")
    ap.add_argument("--gpu", action="store_true",
                    help="also time the GPU worker's path (CuPy arrays in and out): through "
                         "the pinned ring and through host copies")
    ap.add_argument("--layers-per-step", type=int, default=48,
                    help="MoE layers per step on the launched GPU paths (Qwen3-Next-80B: 48)")
    ap.add_argument("--table", default="", help="print markdown tables of a result JSON, exit")
    ap.add_argument("--pages", default="", help="write a 4 KiB vs 2 MiB page experiment here")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            print(markdown_tables(json.load(f)))
        return

    usable = sorted(os.sched_getaffinity(0))
    client = ([int(c) for c in args.client_cores.split(",")] if args.client_cores
              else [args.client_core])
    worker_cores = [c for c in usable if c not in client] or usable
    groups = [list(g) for g in np.array_split(worker_cores, args.workers)]
    dram = dram_read_gbps(len(worker_cores), (256 << 20) if args.quick else (2 << 30))
    if args.pages:
        with open(args.pages, "w") as f:
            json.dump(page_experiment(len(worker_cores), args.iters), f, indent=1)
    os.sched_setaffinity(0, client)  # the dispatching thread gets its own core(s)
    set_num_threads(1)
    machine = {"machine": platform.node(), "cpu": cpu_model(), "threads": len(worker_cores),
               "workers": args.workers, "dram_read_gbps": round(dram, 1)}
    print(json.dumps(machine), flush=True)
    combos = [(512, 16)] if args.quick else [(512, 128), (768, 128), (512, 512), (768, 512)]
    if args.combos:
        combos = [tuple(int(v) for v in c.split(":")) for c in args.combos.split(",")]
    topks = (8,) if args.quick else (8, 10)
    if args.topks:
        topks = tuple(int(v) for v in args.topks.split(","))
    kinds = args.kinds.split(",")
    rows_run = [int(v) for v in args.rows.split(",")]
    budget = (64 << 20) if args.quick else (1600 << 20)
    records = []
    for fmt, (I, E) in [(f, c) for c in combos for f in args.format.split(",")]:
        layer_bytes = 3 * E * I * H * bytes_per_weight(fmt)
        n_layers = max(1, int(-(-budget // layer_bytes)))
        t0 = time.perf_counter()
        with CpuExpertPool(random_layers(E, I, n_layers, seed=E + I, fmt=fmt), cores=groups,
                           max_rows=64, max_k=16, isa=args.isa,
                           prefetch_bytes=args.prefetch, weight_format=fmt) as pool:
            info = pool.ready_info[0]
            machine.update(isa=info["isa"], prefetch_bytes=info["prefetch_bytes"],
                           threading_layer=info["threading_layer"])
            print(f"# isa={info['isa']} weights {info['weights_mib']} MiB", flush=True)
            print(f"# {fmt} I={I} E={E}: {n_layers} layers, pool up in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            cases = [(k, r, kind) for k in topks for kind in ("random", "skewed", "shared")
                     for r in rows_run if kind in kinds]
            cases += [(1, r, "one_expert") for r in rows_run if "one_expert" in kinds]
            cases += [(8, 16, "none")] if "none" in kinds else []
            for topk, rows, kind in cases:
                ids = routings(kind, E, topk, rows, args.iters + 4, seed=rows * 100 + topk)
                rec = dict(machine, format=fmt, H=H, I=I, E=E, topk=topk, rows=rows,
                           routing=kind, **measure(pool, n_layers, ids, I, warmup=4))
                records.append(rec)
                print(f"{fmt} I={I:4d} E={E:4d} k={topk:2d} rows={rows:2d} {kind:10s} "
                      f"distinct={rec['distinct_experts']:6.1f} "
                      f"layer={rec['us_per_layer']:8.1f} us kernel={rec['kernel_us']:8.1f} us "
                      f"eff={rec['effective_gbps']:5.1f} GB/s "
                      f"dispatch={rec['dispatch_us']:5.1f} us",
                      flush=True)
            if args.gpu:
                records += gpu_cases(pool, dict(machine, format=fmt), I, E, n_layers, args.iters,
                                     [r for r in rows_run if r in (1, 16)],
                                     args.layers_per_step)
        if args.out:  # after every pool: a run cut short still leaves its records
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
    print(f"# threads={get_num_threads()} (client); done")


def gpu_cases(pool: CpuExpertPool, machine: dict, I: int, E: int, n_layers: int, iters: int,
              rows_run: list[int], per_step: int) -> list[dict]:
    """Top-8 random layers and the no-CPU-work case through both GPU paths (``--gpu``); the
    one-expert layers through the launched path."""
    import cupy  # noqa: PLC0415

    from gpu_worker.experts.pinned_ring import PinnedRing  # noqa: PLC0415

    link = PinnedRing(pool, cupy)  # one registration of the ring
    out = []
    try:
        for rows, kind in [(r, "random") for r in rows_run] + [(16, "none")] + [
                (r, "one_expert") for r in rows_run]:
            ids = routings(kind, E, 1 if kind == "one_expert" else 8, rows,
                           max(iters + 4, 3 * per_step), seed=rows * 100 + 8)
            for path in ("gpu_launch_kernel",):
                rec = dict(machine, H=H, I=I, E=E, topk=ids[0].shape[1], rows=rows,
                           routing=kind, **measure_gpu_launched(pool, link, n_layers, ids, I,
                                                                path, per_step))
                out.append(rec)
                print(f"GPU {path:22s} I={I:4d} E={E:4d} rows={rows:2d} {kind:10s} "
                      f"layer={rec['us_per_layer']:8.1f} us kernel={rec['kernel_us']:8.1f} us "
                      f"dispatch={rec['dispatch_us']:5.1f} us launch={rec['launch_us']:.0f} "
                      f"gather={rec['gather_us']:.0f} latency={rec['latency_us']:.0f} "
                      f"gap={rec['gap_us']:.0f} (host enqueue / GPU clock, us)", flush=True)
            if kind == "one_expert":
                continue
            ids = ids[:iters + 4]
            for path in ("gpu_host_copies",):
                rec = dict(machine, H=H, I=I, E=E, topk=8, rows=rows, routing=kind,
                           **measure_gpu(pool, n_layers, ids, I, 4, path))
                out.append(rec)
                split = ""
                print(f"GPU {rec['path']:16s} I={I:4d} E={E:4d} rows={rows:2d} {kind:16s} "
                      f"layer={rec['us_per_layer']:8.1f} us kernel={rec['kernel_us']:8.1f} us "
                      f"dispatch={rec['dispatch_us']:5.1f} us {split}", flush=True)
    finally:
        link.close()
    return out


if __name__ == "__main__":
    main()
