"""Benchmark the CPU experts: one MoE layer through CpuExpertPool, per routing and row count.

Measures the machine's DRAM read bandwidth itself (a Numba parallel sum over 2 GiB with the
workers' thread count), then for H=2048, I in {512, 768}, E in {128, 512}, top-k in {8, 10},
rows in {1, 4, 8, 12, 16}, routing random and skewed, times ``dispatch_quantized`` (the QFUSE
path: activations arrive quantized) and reports per layer: distinct experts, weight bytes
read, wall time, worker kernel time, effective GB/s and dispatch overhead (wall - kernel).
Extra records: ``one_expert`` (every row on one expert: the cost of rows) and ``none`` (no
pair on the CPU: pure dispatch overhead). Weights are random int8 with small fp16 scales;
enough layers are cycled that the working set is several times the L3.

    python scripts/bench_cpu_experts.py --out docs/bench/cpu_experts_h200.json
    python scripts/bench_cpu_experts.py --quick   # small sizes, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
from numba import get_num_threads, njit, prange, set_num_threads

from cpu_experts.pool import CpuExpertPool
from cpu_experts.quant import quantize
from cpu_experts.shard import QuantizedLayer

H = 2048
ROWS = (1, 4, 8, 12, 16)


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
    best = min(_timed(_parallel_sum, a) for _ in range(5))
    return nbytes / best / 1e9


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def random_layers(E: int, I: int, n_layers: int, seed: int) -> dict[int, QuantizedLayer]:
    rng = np.random.default_rng(seed)

    def q(shape):  # the canonical quantizer's range: [-127, 127]
        return np.maximum(np.frombuffer(rng.bytes(int(np.prod(shape))), np.int8),
                          np.int8(-127)).reshape(shape)

    table = (rng.random(4099, np.float32) * 1e-3 + 1e-4).astype(np.float16)

    def s(shape):  # scale values do not change the timing: tile a small random table
        return np.resize(table, shape)

    return {l: QuantizedLayer(q((E, I, H)), s((E, I, H // 32)), q((E, I, H)), s((E, I, H // 32)),
                              q((E, H, I)), s((E, H, I // 32))) for l in range(n_layers)}


def routings(kind: str, E: int, topk: int, rows: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "none":
        return [np.full((rows, topk), -1, np.int32) for _ in range(n)]
    if kind == "one_expert":
        return [np.full((rows, 1), rng.integers(E), np.int32) for _ in range(n)]
    p = None
    if kind == "skewed":  # Zipf-like popularity, a fresh ranking per layer
        p = 1.0 / np.arange(1, E + 1) ** 1.2
        p /= p.sum()
    out = []
    for _ in range(n):
        perm = rng.permutation(E)
        ids = np.stack([perm[rng.choice(E, topk, replace=False, p=p)] for _ in range(rows)])
        out.append(ids.astype(np.int32))
    return out


def measure(pool: CpuExpertPool, n_layers: int, ids_list: list[np.ndarray], I: int,
            warmup: int) -> dict:
    rows = ids_list[0].shape[0]
    x = np.random.default_rng(rows).standard_normal((rows, H)).astype(np.float32)
    q, d = quantize(x)
    walls, kernels, distinct, parts = [], [], [], []
    out = np.zeros((rows, H), np.float32)  # reused, as the GPU worker reuses its buffer
    for i, ids in enumerate(ids_list):
        w = np.full(ids.shape, 1.0 / ids.shape[1], np.float32)
        t0 = time.perf_counter_ns()
        pool.dispatch_quantized(i % n_layers, q, d, ids, w, out=out)
        wall = time.perf_counter_ns() - t0
        if i >= warmup:
            walls.append(wall)
            kernels.append(int(pool.last_kernel_ns.max()))
            parts.append((pool.last_wake_ns, pool.last_notice_ns, pool.last_client_ns,
                          pool.last_pre_ns))
            distinct.append(len(np.unique(ids[ids >= 0])))
    expert_bytes = 3 * I * H * (1 + 4 / 32)  # int8 weights + float32 block scales, as stored
    wall_us = float(np.median(walls)) / 1e3
    kernel_us = float(np.median(kernels)) / 1e3
    wbytes = float(np.mean(distinct)) * expert_bytes
    return {"distinct_experts": float(np.mean(distinct)), "weight_bytes": wbytes,
            "us_per_layer": wall_us, "kernel_us": kernel_us,
            "effective_gbps": wbytes / wall_us / 1e3 if wbytes else 0.0,
            "kernel_gbps": wbytes / kernel_us / 1e3 if wbytes else 0.0,
            "dispatch_us": float(np.median(np.subtract(walls, kernels))) / 1e3,
            # where dispatch time goes: ring -> worker starts, worker ends -> seen, client work
            **{f"{name}_us": float(np.median([p[i] for p in parts])) / 1e3
               for i, name in enumerate(("wake", "notice", "client", "pre"))}}


def measure_gpu(pool: CpuExpertPool, link, n_layers: int, ids_list: list[np.ndarray], I: int,
                warmup: int, path: str) -> dict:
    """The GPU worker's view of one layer: quantized activations, ids and weights in GPU
    memory -> the summed CPU partials in GPU memory, stream synchronized. ``link``: through
    the pinned ring (gpu_worker/cpu_link.py); None: the host path (copies to NumPy,
    ``dispatch_quantized``, copy back)."""
    import cupy  # noqa: PLC0415

    rows = ids_list[0].shape[0]
    x = np.random.default_rng(rows).standard_normal((rows, H)).astype(np.float32)
    q, d = quantize(x)
    q_dev, d_dev = cupy.asarray(q), cupy.asarray(d)
    stream = cupy.cuda.get_current_stream()
    host_out = np.zeros((rows, H), np.float32)
    walls, kernels, splits = [], [], []
    for i, ids in enumerate(ids_list):
        ids_dev = cupy.asarray(ids, dtype=cupy.int64)  # the router's dtype
        w_dev = cupy.full(ids.shape, 1.0 / ids.shape[1], cupy.float32)
        stream.synchronize()
        t0 = time.perf_counter_ns()
        if link is not None:
            link.stage(q_dev, d_dev, ids_dev, w_dev)
            t1 = time.perf_counter_ns()
            link.start(i % n_layers, *ids.shape)
            t2 = time.perf_counter_ns()
            out = link.collect()
            t3 = time.perf_counter_ns()
        else:
            pool.dispatch_quantized(i % n_layers, q_dev.get(), d_dev.get(), ids_dev.get(),
                                    w_dev.get(), out=host_out)
            out = cupy.asarray(host_out)
        stream.synchronize()
        wall = time.perf_counter_ns() - t0
        del out
        if i >= warmup:
            walls.append(wall)
            kernels.append(int(pool.last_kernel_ns.max()))
            if link is not None:  # stage, start, wake, notice, collect (after seen), sync
                splits.append((t1 - t0, t2 - t1, pool.last_wake_ns, pool.last_notice_ns,
                               t3 - pool.last_seen_ns, t0 + wall - t3))
    rec = {"path": path,
           "us_per_layer": float(np.median(walls)) / 1e3,
           "kernel_us": float(np.median(kernels)) / 1e3,
           "dispatch_us": float(np.median(np.subtract(walls, kernels))) / 1e3}
    for j, name in enumerate(("stage", "start", "wake", "notice", "collect", "sync")):
        if splits:
            rec[f"{name}_us"] = float(np.median([sp[j] for sp in splits])) / 1e3
    return rec


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
    expert_bytes = 3 * I * H * (1 + 4 / 32)
    wbytes = float(np.mean(distinct)) * expert_bytes
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
    machine = {"machine": platform.node(), "cpu": _cpu_model(), "threads": len(worker_cores),
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
    for I, E in combos:
        layer_bytes = 3 * E * I * H
        n_layers = max(1, -(-budget // layer_bytes))
        t0 = time.perf_counter()
        with CpuExpertPool(random_layers(E, I, n_layers, seed=E + I), cores=groups,
                           max_rows=64, max_k=16, isa=args.isa,
                           prefetch_bytes=args.prefetch) as pool:
            info = pool.ready_info[0]
            machine.update(isa=info["isa"], prefetch_bytes=info["prefetch_bytes"],
                           threading_layer=info["threading_layer"])
            print(f"# isa={info['isa']} weights {info['weights_mib']} MiB", flush=True)
            print(f"# I={I} E={E}: {n_layers} layers, pool up in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            cases = [(k, r, kind) for k in topks for kind in ("random", "skewed") for r in rows_run
                     if kind in kinds]
            cases += [(1, r, "one_expert") for r in rows_run if "one_expert" in kinds]
            cases += [(8, 16, "none")] if "none" in kinds else []
            for topk, rows, kind in cases:
                ids = routings(kind, E, topk, rows, args.iters + 4, seed=rows * 100 + topk)
                rec = dict(machine, H=H, I=I, E=E, topk=topk, rows=rows, routing=kind,
                           **measure(pool, n_layers, ids, I, warmup=4))
                records.append(rec)
                print(f"I={I:4d} E={E:4d} k={topk:2d} rows={rows:2d} {kind:10s} "
                      f"distinct={rec['distinct_experts']:6.1f} "
                      f"layer={rec['us_per_layer']:8.1f} us kernel={rec['kernel_us']:8.1f} us "
                      f"eff={rec['effective_gbps']:5.1f} GB/s "
                      f"dispatch={rec['dispatch_us']:5.1f} us",
                      flush=True)
            if args.gpu:
                records += gpu_cases(pool, machine, I, E, n_layers, args.iters,
                                     [r for r in rows_run if r in (1, 16)],
                                     args.layers_per_step)
        if args.out:  # after every pool: a run cut short still leaves its records
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
    print(f"# threads={get_num_threads()} (client); done")


def gpu_cases(pool: CpuExpertPool, machine: dict, I: int, E: int, n_layers: int, iters: int,
              rows_run: list[int], per_step: int) -> list[dict]:
    """Top-8 random layers and the no-CPU-work case through every GPU path (``--gpu``); the
    one-expert layers through the launched paths."""
    import cupy  # noqa: PLC0415

    from gpu_worker.cpu_link import PinnedRing  # noqa: PLC0415

    link = PinnedRing(pool, cupy)  # one registration of the ring; its two modes set per path
    # in / out: a kernel on the mapped ring or a DMA copy (PinnedRing's kernel_in/kernel_out)
    paths = {f"gpu_pinned_{a}_{b}": (a == "kernel", b == "kernel")
             for a, b in (("kernel", "memcpy"), ("kernel", "kernel"), ("memcpy", "memcpy"))}
    paths["gpu_host_copies"] = None
    launched = {"gpu_launch_memcpy": False, "gpu_launch_kernel": True}  # kernel_out
    out = []
    try:
        for rows, kind in [(r, "random") for r in rows_run] + [(16, "none")] + [
                (r, "one_expert") for r in rows_run]:
            ids = routings(kind, E, 1 if kind == "one_expert" else 8, rows,
                           max(iters + 4, 3 * per_step), seed=rows * 100 + 8)
            for path, kernel_out in launched.items():
                link.kernel_in, link.kernel_out = True, kernel_out
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
            for path, modes in paths.items():
                if modes is not None:
                    link.kernel_in, link.kernel_out = modes
                rec = dict(machine, H=H, I=I, E=E, topk=8, rows=rows, routing=kind,
                           **measure_gpu(pool, link if modes else None, n_layers, ids, I, 4,
                                         path))
                out.append(rec)
                split = " ".join(f"{n}={rec[n + '_us']:.0f}" for n in
                                 ("stage", "start", "wake", "notice", "collect", "sync")
                                 if n + "_us" in rec)
                print(f"GPU {rec['path']:16s} I={I:4d} E={E:4d} rows={rows:2d} {kind:16s} "
                      f"layer={rec['us_per_layer']:8.1f} us kernel={rec['kernel_us']:8.1f} us "
                      f"dispatch={rec['dispatch_us']:5.1f} us {split}", flush=True)
    finally:
        link.close()
    return out


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


def markdown_tables(records: list[dict]) -> str:
    """The tables of docs/cpu_experts.md: layers at top-k 8, the cost of rows on one expert,
    and the dispatch overhead with no CPU work."""
    gpu = [r for r in records if "path" in r]
    records = [r for r in records if "path" not in r]
    lines = ["| I | E | routing | rows | distinct experts | weight MB | us/layer | kernel us | "
             "eff. GB/s | dispatch us (wake / notice / client / pre) |", "|" + "---|" * 10]
    for r in records:
        if r["topk"] == 8 and r["routing"] in ("random", "skewed") and r["rows"] in (1, 4, 16):
            lines.append(
                f"| {r['I']} | {r['E']} | {r['routing']} | {r['rows']} | "
                f"{r['distinct_experts']:.1f} | {r['weight_bytes'] / 1e6:.0f} | "
                f"{r['us_per_layer']:.0f} | {r['kernel_us']:.0f} | {r['effective_gbps']:.1f} | "
                f"{r['dispatch_us']:.0f} ({r.get('wake_us', 0):.0f} / "
                f"{r.get('notice_us', 0):.0f} / {r.get('client_us', 0):.0f} / "
                f"{r.get('pre_us', 0):.0f}) |")
    lines += ["", "| I | E | " + " | ".join(f"{n} row{'s' * (n > 1)}" for n in ROWS)
              + " | 16 / 1 |", "|" + "---|" * (len(ROWS) + 3)]
    one: dict[tuple[int, int], dict[int, float]] = {}
    for r in records:
        if r["routing"] == "one_expert":
            one.setdefault((r["I"], r["E"]), {})[r["rows"]] = r["us_per_layer"]
    for (i, e), by_rows in one.items():
        cells = " | ".join(f"{by_rows.get(n, float('nan')):.0f}" for n in ROWS)
        lines.append(f"| {i} | {e} | {cells} | {by_rows[16] / by_rows[1]:.2f} |")
    lines += ["", "| I | E | no CPU pair, 16 rows: us/layer | kernel us | dispatch us |",
              "|---|---|---|---|---|"]
    for r in records:
        if r["routing"] == "none":
            lines.append(f"| {r['I']} | {r['E']} | {r['us_per_layer']:.0f} | "
                         f"{r['kernel_us']:.0f} | {r['dispatch_us']:.0f} |")
    launched = [r for r in gpu if r["path"].startswith("gpu_launch")]
    synced = [r for r in gpu if not r["path"].startswith("gpu_launch")]
    if launched:
        lines += ["", "| I | E | routing | rows | path | us/layer | kernel us | dispatch + "
                  "transfer us | host enqueue us | GPU clock: latency / gap us |",
                  "|" + "---|" * 10]
        for r in launched:
            lines.append(f"| {r['I']} | {r['E']} | {r['routing']} | {r['rows']} | "
                         f"{r['path']} | {r['us_per_layer']:.0f} | {r['kernel_us']:.0f} | "
                         f"{r['dispatch_us']:.0f} | {r['enqueue_us']:.0f} | "
                         f"{r['latency_us']:.0f} / {r['gap_us']:.0f} |")
    if synced:
        lines += ["", "| I | E | routing | rows | path | us/layer | kernel us | dispatch + "
                  "transfer us |", "|" + "---|" * 8]
        for r in synced:
            lines.append(f"| {r['I']} | {r['E']} | {r['routing']} | {r['rows']} | {r['path']} | "
                         f"{r['us_per_layer']:.0f} | {r['kernel_us']:.0f} | "
                         f"{r['dispatch_us']:.0f} |")
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
