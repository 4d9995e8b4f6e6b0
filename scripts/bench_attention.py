"""Paged attention, the fused RMSNorm and the q/k norm + RoPE kernel (against the four
launches it replaced) alone at Qwen3-Next-80B-A3B's shapes on the GPU:
device time per launch (CUDA events over a CUDA graph of back-to-back launches, real clocks:
Nsight Compute's serialised replays stretch short kernels), next to the bytes they must read.
A GPU benchmark, < 30 s. ``--prefill``: instead, one 80B attention layer's prefill chunk
(512 rows after 0, 3,584 or 11,776 cached positions) through the paged kernels (its rows get
decode rows' bits) in each launch shape of ``--long-shapes`` (rows a warp, warps a block,
compile bound), against the cuBLAS matrix products long chunks used until tree 3b6c287.

    python -m scripts.bench_attention --out docs/bench/attention_h200.json
    python -m scripts.bench_attention --prefill --out docs/bench/prefill_attention_h100.json
"""

from __future__ import annotations

import argparse
import hashlib
import json

import numpy as np

from scripts.bench_common import command_line, machine
from scripts.bench_linear import HBM, gpu_us

HKV, GROUP, HD, BLOCK = 2, 8, 256, 64  # the 80B's full attention: 16 q heads, 2 kv heads


def graph_us(cp, fn) -> float:
    """Median device time of one call: 20 calls captured as one CUDA graph, replayed 9 times."""
    return gpu_us(cp, fn, reps=9, batch=20, graph=True)


def bench_attention(cp, slots: int, rows: int, context: int, partition: int,
                    min_blocks: int = 1) -> dict:
    from gpu_worker.kernels import paged_attention as pa
    from gpu_worker.kv_cache import KVCache

    positions = context + rows
    blocks = slots * -(-positions // BLOCK) + 1
    kv = KVCache(cp, 1, blocks, BLOCK, HKV, HD, np.dtype(np.float32))
    for s in range(slots):
        kv.reserve(s, 0, positions)
    kv.k[...] = cp.random.standard_normal(kv.k.shape, dtype=cp.float32)
    kv.v[...] = cp.random.standard_normal(kv.v.shape, dtype=cp.float32)
    n = slots * rows
    meta = np.array([[i, i // rows, context + i % rows] for i in range(n)], np.int32).T.copy()
    meta, tables = cp.asarray(meta), kv.device_tables()
    q = cp.random.standard_normal((n, HKV * GROUP, HD), dtype=cp.float32)
    out = cp.empty_like(q)
    scale = np.float32(HD ** -0.5)
    us = graph_us(cp, lambda: pa.paged_attention(q, kv, 0, meta, tables, out, scale,
                                                 max_position=positions, partition=partition,
                                                 min_blocks=min_blocks))
    nbytes = slots * 2 * positions * HKV * HD * 4  # each slot's K and V once
    return {"what": "paged_attention", "slots": slots, "rows_per_slot": rows,
            "context": context, "partition": partition, "min_blocks": min_blocks,
            "us": round(us, 2),
            "bytes": nbytes, "floor_us": round(nbytes / HBM * 1e6, 2)}


def bench_prefill(cp, start: int, rows: int, shape: tuple[int, int, int] | None) -> dict:
    """One layer's attention for a ``rows``-row prefill chunk at positions start.. of one
    slot (K/V written, as the model does): the paged kernels with ``shape`` (rows a warp,
    warps a block, compile bound: attention.LONG_*), or the matrix products (None). The
    output's hash goes in the record: every shape must give the same bits."""
    from gpu_worker.kernels import paged_attention as pa
    from gpu_worker.kv_cache import KVCache
    from gpu_worker.model import attention
    from gpu_worker.model.batch import RaggedBatch
    from gpu_worker.model.ops import Ops

    positions = start + rows
    cp.random.seed(start)
    kv = KVCache(cp, 1, -(-positions // BLOCK) + 1, BLOCK, HKV, HD, np.dtype(np.float32))
    kv.reserve(0, 0, positions)
    kv.k[...] = cp.random.standard_normal(kv.k.shape, dtype=cp.float32)
    kv.v[...] = cp.random.standard_normal(kv.v.shape, dtype=cp.float32)
    batch = RaggedBatch.build([(0, start, np.zeros(rows, np.int64))])
    ops, scale = Ops(cp, np.float32), np.float32(HD ** -0.5)
    q = cp.random.standard_normal((rows, HKV * GROUP, HD), dtype=cp.float32)
    k, v = (cp.random.standard_normal((rows, HKV, HD), dtype=cp.float32) for _ in range(2))
    if shape is not None:
        (attention.LONG_ROWS_PER_WARP, attention.LONG_BLOCK_WARPS,
         attention.LONG_MIN_BLOCKS) = shape
        fn = lambda: attention._paged(ops, q, k, v, batch, kv, 0, scale)  # noqa: E731
    else:
        def fn():
            pa.write_kv(kv, 0, k, v, attention._step_meta(cp, kv, batch).write,
                        kv.device_tables())
            return attention._segment(ops, q, kv, 0, batch.segments[0], scale)
    out = cp.asnumpy(fn())
    us = gpu_us(cp, fn, reps=5, batch=3, graph=False)  # cuBLAS: no capture
    return {"what": "prefill_attention", "path": "paged" if shape else "matrix_products",
            "shape": "x".join(map(str, shape)) if shape else None,
            "rows": rows, "start": start, "us": round(us, 1),
            "us_per_row": round(us / rows, 2), "sha1": hashlib.sha1(out.tobytes()).hexdigest()}


def bench_norm(cp, rows: int, H: int, add: bool) -> dict:
    from gpu_worker.kernels.fused_norm import add_rms_norm_rows, rms_norm_rows

    x, r = (cp.random.standard_normal((rows, H), dtype=cp.float32) for _ in range(2))
    w = cp.ones(H, cp.float32)
    fn = ((lambda: add_rms_norm_rows(x, r, w, 1e-6, zero_centered=True)) if add
          else (lambda: rms_norm_rows(x, w, 1e-6, zero_centered=True)))
    us = graph_us(cp, fn)
    nbytes = rows * H * 4 * (4 if add else 2)
    return {"what": "add_rms_norm" if add else "rms_norm", "rows": rows, "H": H,
            "us": round(us, 2), "bytes": nbytes, "floor_us": round(nbytes / HBM * 1e6, 3)}


def bench_qk_norm_rope(cp, rows: int, fused: bool) -> dict:
    """The 80B's q/k norms and partial RoPE (a quarter of 256 rotated, zero-centred norms):
    one qk_norm_rope launch, or the four it replaced (two norms, two RoPEs)."""
    from gpu_worker.kernels.fused_norm import rms_norm_rows
    from gpu_worker.kernels.fused_rope import rope
    from gpu_worker.kernels.qk_norm_rope import qk_norm_rope

    q = cp.random.standard_normal((rows, HKV * GROUP, HD), dtype=cp.float32)
    k = cp.random.standard_normal((rows, HKV, HD), dtype=cp.float32)
    w = cp.zeros(HD, cp.float32)
    cos, sin = (cp.random.standard_normal((rows, HD // 4), dtype=cp.float32) for _ in range(2))
    if fused:
        fn = lambda: qk_norm_rope(q, k, w, w, cos, sin, 1e-6, zero_centered=True)  # noqa: E731
    else:
        def fn():
            for x in (q, k):
                rope(rms_norm_rows(x, w, 1e-6, zero_centered=True), cos, sin)
    us = graph_us(cp, fn)
    nbytes = (q.size + k.size) * 4 * 2  # read and written once
    return {"what": "qk_norm_rope" if fused else "qk_norm_rope_four_launches", "rows": rows,
            "us": round(us, 2), "bytes": nbytes, "floor_us": round(nbytes / HBM * 1e6, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON records here")
    ap.add_argument("--partitions", default="64")
    ap.add_argument("--min-blocks", default="1,2", help="the attention kernel's compile bound "
                    "(blocks per SM ptxas must fit), each timed")
    ap.add_argument("--prefill", action="store_true", help="the prefill chunk's paths only")
    ap.add_argument("--long-shapes", default="1x8x2,2x8x1,2x8x2,2x4x1,4x8x1,4x4x1",
                    help="--prefill: the paged launches' rows a warp x warps a block x "
                    "compile bound, each timed")
    args = ap.parse_args()
    import cupy as cp

    records = []
    if args.prefill:
        shapes = [tuple(int(x) for x in t.split("x")) for t in args.long_shapes.split(",")]
        for start in (0, 3584, 11776):
            for shape in (*shapes, None):
                records.append(bench_prefill(cp, start, 512, shape))
                print(records[-1], flush=True)
    for part in (() if args.prefill else (int(p) for p in args.partitions.split(","))):
        for minb in (int(b) for b in args.min_blocks.split(",")):
            for slots, rows, context in ((1, 1, 512), (4, 4, 512), (1, 1, 4096),
                                         (4, 4, 4096), (1, 1, 32768)):
                records.append(bench_attention(cp, slots, rows, context, part, minb))
                print(records[-1], flush=True)
    for rows in (() if args.prefill else (1, 16)):
        for H, add in ((2048, False), (2048, True), (256, False), (4096, False)):
            records.append(bench_norm(cp, rows * (16 if H == 256 else 1), H, add))
            print(records[-1], flush=True)
        for fused in (True, False):
            records.append(bench_qk_norm_rope(cp, rows, fused))
            print(records[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "command": command_line(), "records": records},
                      f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
