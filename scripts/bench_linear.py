"""The row-tile matrix kernel (gpu_worker/kernels/rowtile.py) on the dense projections of
Qwen3-Next-80B-A3B at 1-16 rows: GPU time (CUDA events, median of batches), weight bytes
per second and its share of the H200's 4.2 TB/s, next to cuBLAS on pre-widened float32
weights and the old path (widen the bf16 matrix, then cuBLAS). A GPU benchmark, < 60 s.

    python -m scripts.bench_linear --out docs/bench/linear_h200.json
    python -m scripts.bench_linear --knobs 2,4 4,2 4,3   # try other speed knobs (nw,pf)
    python -m scripts.bench_linear --graph --tiles 4,8   # device time only; 8-16 rows as
                                                         # tiles of 4 or 8 rows too

``--graph`` times CUDA-graph replays of the batch of calls (what a step's graph pays: no
host launch cost); without it the batch is launched from Python, which for small matrices
measures the launches. ``--tiles`` times rows above a tile size as several row tiles of that
size (``linear_rows(rt=)``; each tile reads the weights again, from L2 when the tiles of one
weight tile run together): same bits, another speed.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from scripts.bench_common import command_line, machine

HBM = 4.2e12  # bytes/s, the H200's HBM ceiling (read + write copy)
ROWS = (1, 2, 4, 8, 12, 16)
# (what, N, K): hidden 2048; attention 16 heads x 256 (q with its gate: 2x), 2 KV heads;
# Gated DeltaNet 16 key heads x 128, 32 value heads x 128; shared expert 512; vocab 151936
SHAPES = (
    ("attn q_proj (gated)", 8192, 2048),
    ("attn k_proj / v_proj", 512, 2048),
    ("attn o_proj", 2048, 4096),
    ("gdn in_proj_qkvz", 12288, 2048),
    ("gdn in_proj_ba", 64, 2048),
    ("gdn out_proj", 2048, 4096),
    ("shared expert gate/up, router", 512, 2048),
    ("shared expert down", 2048, 512),
    ("4096 x 2048", 4096, 2048),
    ("lm_head", 151936, 2048),
)


GRAPH = False  # --graph: time CUDA-graph replays of each batch


def gpu_us(cp, fn, reps: int, batch: int, capture: bool = True,
           graph: bool | None = None) -> float:
    """Median over ``reps`` of the CUDA-event time of ``batch`` back-to-back calls, per
    call, in microseconds (after 3 warm-up calls); with ``graph`` (None: :data:`GRAPH`) and
    ``capture`` (CuPy refuses cuBLAS calls under capture) the batch is captured once as a
    CUDA graph and each rep replays it."""
    for _ in range(3):
        fn()
    stream = cp.cuda.Stream(non_blocking=True)
    captured = (GRAPH if graph is None else graph) and capture
    graph, keep = None, []
    if captured:  # the pool holds a block per output first: no cudaMalloc while capturing
        warm = [fn() for _ in range(batch)]
        del warm
        cp.cuda.Device().synchronize()
        relaxed = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
        with stream:
            stream.begin_capture(*(() if relaxed is None else (relaxed,)))
            try:
                keep = [fn() for _ in range(batch)]  # alive while the graph replays
            finally:
                graph = stream.end_capture()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    with stream:
        for _ in range(reps):
            start.record(stream)
            if graph is not None:
                graph.launch(stream)
            else:
                for _ in range(batch):
                    fn()
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / batch)
    del keep
    return float(np.median(times))


def bench_shape(cp, what: str, N: int, K: int, dtype: str, knobs: list,
                tiles: tuple[int, ...] = ()) -> list[dict]:
    """Records of one weight shape at every row count of :data:`ROWS`."""
    from gpu_worker.kernels.bf16 import widen

    w32 = cp.random.standard_normal((N, K), dtype=cp.float32) * 0.05
    if dtype == "bf16":
        w = (w32.view(cp.uint32) >> 16).astype(cp.uint16)  # truncated to bf16: fine here
        w32 = widen(w)
    else:
        w = w32
    return [bench_rows(cp, what, w, w32, R, dtype, knobs, tiles) for R in ROWS]


def bench_rows(cp, what: str, w, w32, R: int, dtype: str, knobs: list,
               tiles: tuple[int, ...] = ()) -> dict:
    """One record: ``R`` rows through the kernel (each knob), cuBLAS on ``w32``, and (bf16)
    widening plus cuBLAS."""
    from gpu_worker.kernels.bf16 import widen
    from gpu_worker.kernels.rowtile import linear_rows

    N, K = w.shape
    nbytes = w.nbytes
    reps, batch = (7, 3) if nbytes > 64 << 20 else (15, 20)
    x = cp.random.standard_normal((R, K), dtype=cp.float32)
    rec = {"what": what, "N": N, "K": K, "weights": dtype, "rows": R,
           "weight_mb": round(nbytes / 2 ** 20, 2)}
    for nw, pf in knobs:
        us = gpu_us(cp, lambda nw=nw, pf=pf: linear_rows(x, w, nw=nw, pf=pf), reps, batch)
        key = "" if (nw, pf) == (None, None) else f"_nw{nw}_pf{pf}"
        rec["us" + key] = round(us, 2)
        rec["gbps" + key] = round(nbytes / us / 1e3, 1)
        rec["pct_hbm" + key] = round(100 * nbytes / (us * 1e-6) / HBM, 1)
    for rt in (t for t in tiles if t < R):
        us = gpu_us(cp, lambda rt=rt: linear_rows(x, w, rt=rt), reps, batch)
        rec[f"us_rt{rt}"] = round(us, 2)
        rec[f"pct_hbm_rt{rt}"] = round(100 * nbytes / (us * 1e-6) / HBM, 1)
    # cuBLAS eagerly (back-to-back launches): the reference point, not captured
    rec["cublas_f32_us"] = round(gpu_us(cp, lambda: x @ w32.T, reps, batch, False), 2)
    if dtype == "bf16":
        rec["widen_cublas_us"] = round(gpu_us(cp, lambda: x @ widen(w).T, reps, batch, False),
                                       2)
    return rec


def table(records: list[dict]) -> str:
    head = (f"{'shape':32} {'N':>6} {'K':>5} {'w':>4} {'R':>3} {'us':>8} {'GB/s':>7} "
            f"{'%HBM':>5} {'cuBLAS f32 us':>13} {'widen+cuBLAS us':>15}")
    lines = [head, "-" * len(head)]
    for r in records:
        tiles = "  ".join(f"rt{k[5:]} {v:.2f} us" for k, v in r.items() if k.startswith("us_rt"))
        lines.append(f"{r['what'][:32]:32} {r['N']:>6} {r['K']:>5} {r['weights']:>4} "
                     f"{r['rows']:>3} {r['us']:>8.2f} {r['gbps']:>7.0f} {r['pct_hbm']:>5.1f} "
                     f"{r['cublas_f32_us']:>13.2f} {r.get('widen_cublas_us', float('nan')):>15.2f}"
                     + (f"  {tiles}" if tiles else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON records here")
    ap.add_argument("--dtypes", default="bf16,f32", help="weight dtypes: bf16, f32")
    ap.add_argument("--knobs", nargs="*", default=[],
                    help="extra speed knobs to time, each 'nw,pf' (the default always runs)")
    ap.add_argument("--tiles", default="", help="row tiles to try above their size, e.g. 4,8")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays")
    ap.add_argument("--shapes", default="", help="only shapes whose name contains one of these "
                    "comma-separated words")
    args = ap.parse_args()
    import cupy as cp

    global GRAPH
    GRAPH = args.graph
    tiles = tuple(int(t) for t in args.tiles.split(",") if t)
    words = [w for w in args.shapes.split(",") if w]
    knobs = [(None, None)] + [tuple(int(v) for v in k.split(",")) for k in args.knobs]
    records = []
    for dtype in args.dtypes.split(","):
        for what, N, K in SHAPES:
            if words and not any(word in what for word in words):
                continue
            records += bench_shape(cp, what, N, K, dtype, knobs, tiles)
            cp.get_default_memory_pool().free_all_blocks()
    print(table(records))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "command": command_line(), "hbm_bytes_per_s": HBM,
                       "records": records}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
