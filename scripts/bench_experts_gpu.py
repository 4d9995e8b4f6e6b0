"""The GPU's routed experts of one MoE layer at the Qwen3-Next-80B's widths (H = 2048,
I = 512, 512 experts, top-10): the merged kernels (gpu_worker/kernels/moe_merged.py) against
the grouped ones (moe_experts.py) at 1-16 rows, device time from CUDA events next to the
bandwidth floor (distinct experts' weight bytes / 4.2 TB/s). A GPU benchmark, < 60 s.

    python -m scripts.bench_experts_gpu --out docs/bench/experts_gpu_h200.json

Device time: a spin kernel holds the stream while the host enqueues ``--iters`` calls (a
fresh random routing each, so the L2 cannot serve the next call's experts), then the events
around them time the calls back to back: the kernels and the gaps between them, not the
Python that launched them (that is ``host_us``: enqueue time per call).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from scripts.bench_common import command_line, machine

H, I, E, TOPK = 2048, 512, 512, 10
ROWS = (1, 2, 4, 8, 12, 16)
HBM_BYTES_PER_S = 4.2e12  # H200 HBM3e peak (docs/benchmarks.md)

_SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def _stacks(cp, dtype: str, seed: int) -> list:
    """Random gate, up [E, I, H] and down [E, H, I]: float32, or bf16 bits (truncated)."""
    rs = cp.random.RandomState(seed)
    out = []
    for shape in ((E, I, H), (E, I, H), (E, H, I)):
        a = rs.standard_normal(shape, dtype=cp.float32) * 0.02
        if dtype == "bf16":
            a = (a.view(cp.uint32) >> 16).astype(cp.uint16)
        out.append(a)
    return out


def _device_us(cp, spin, fn, inputs: list) -> tuple[float, float]:
    """(device us per call, host enqueue us per call) of ``fn(x)`` over ``inputs``."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    spin((1,), (1,), (np.uint64(20_000_000),))  # 20 ms: longer than enqueuing every call
    start.record()
    t0 = time.perf_counter()
    for x in inputs:
        fn(x)
    host = (time.perf_counter() - t0) / len(inputs)
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / len(inputs), host * 1e6


def bench(cp, dtype: str, iters: int, seed: int = 0) -> list[dict]:
    from gpu_worker.kernels.moe_experts import experts_grouped  # noqa: PLC0415
    from gpu_worker.kernels.moe_merged import experts_merged  # noqa: PLC0415

    spin = cp.RawKernel(_SPIN, "spin")
    stacks = _stacks(cp, dtype, seed)
    wbytes = 3 * I * H * (2 if dtype == "bf16" else 4)  # one expert's weights
    rng = np.random.default_rng(seed)
    records = []
    for rows in ROWS:
        x = cp.asarray(rng.standard_normal((rows, H), np.float32))
        w = cp.asarray(rng.random((rows, TOPK), np.float32))
        host_ids = [np.stack([rng.permutation(E)[:TOPK] for _ in range(rows)])
                    for _ in range(iters)]
        routings = [cp.asarray(ids) for ids in host_ids]
        distinct = float(np.mean([len(np.unique(ids)) for ids in host_ids]))
        floor_us = distinct * wbytes / HBM_BYTES_PER_S * 1e6
        outs = {}
        kernels = (("merged", experts_merged),  # rows per pass from rows_per_pass
                   ("merged_rc16", lambda *a: experts_merged(*a, rc=16)),
                   ("grouped", experts_grouped))
        for name, kernel in kernels:
            def call(ids, kernel=kernel, x=x, w=w, stacks=stacks):
                return kernel(x, ids, w, *stacks)
            outs[name] = call(routings[0])
            for ids in routings[:3]:  # compile and warm up
                call(ids)
            cp.cuda.Device().synchronize()
            dev_us, host_us = _device_us(cp, spin, call, routings)
            rec = {"kernel": name, "weights": dtype, "H": H, "I": I, "E": E, "topk": TOPK,
                   "rows": rows, "distinct_experts": distinct,
                   "weight_bytes": distinct * wbytes, "device_us": round(dev_us, 1),
                   "host_us": round(host_us, 1), "floor_us": round(floor_us, 1),
                   "gbps": round(distinct * wbytes / dev_us / 1e3, 1),
                   "hbm_fraction": round(floor_us / dev_us, 3)}
            print(json.dumps(rec), flush=True)
            records.append(rec)
        if not bool((outs["merged"] == outs["merged_rc16"]).all()):
            raise SystemExit(f"rows per pass changed the bits at {rows} rows")
        diff = float(cp.abs(outs["merged"] - outs["grouped"]).max())
        scale = float(cp.abs(outs["grouped"]).max())
        records[-1]["merged_vs_grouped_max_abs_diff"] = diff
        if not diff <= 1e-4 * max(scale, 1e-30):
            raise SystemExit(f"merged and grouped disagree at {rows} rows: {diff} of {scale}")
    stacks.clear()  # the weights (GBs) go before the next dtype
    cp.get_default_memory_pool().free_all_blocks()
    return records


def main() -> None:
    import cupy as cp  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--weights", default="bf16,float32", help="comma list: bf16, float32")
    args = ap.parse_args()
    t0 = time.perf_counter()
    records = []
    for dtype in args.weights.split(","):
        records += bench(cp, dtype.strip(), args.iters)
    doc = {"machine": machine(), "command": command_line(),
           "seconds": round(time.perf_counter() - t0, 1), "records": records}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
