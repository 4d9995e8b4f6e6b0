"""The GPU's routed experts of one MoE layer: the per-expert loop against the grouped kernels
(gpu_worker/kernels/moe_experts.py), wall time per layer as a Python-driven step sees it
(enqueue + run, synchronized after each layer). A GPU benchmark.

    python -m scripts.bench_gpu_experts --out docs/bench/gpu_experts_h200.json

``--model`` also decodes with the tiny test models (every expert on the GPU) through
``Engine.generate``, the loop (``GROUPED_MAX_ROWS = 0``) against the grouped kernels.
"""

from __future__ import annotations

import argparse
import json
import platform

import numpy as np

from scripts.bench_common import greedy_ms_per_token, timings, tiny_checkpoint


def _time(cp, routings: list, fn) -> tuple[float, object]:
    """Median wall microseconds of ``fn(ids)`` synchronized, after 3 warm-up calls; the last
    output."""
    times, out = timings(fn, routings, warmup=3, sync=cp.cuda.Device().synchronize)
    return float(np.median(times)) * 1e6, out


def model_decode(tokens: int = 100) -> list[dict]:
    """ms per decoded token of the tiny models on CuPy, loop vs grouped experts."""
    from gpu_worker.engine import Engine  # noqa: PLC0415
    from gpu_worker.model import moe  # noqa: PLC0415

    limit, out = moe.GROUPED_MAX_ROWS, []
    for arch in ("qwen3_moe", "qwen3_next"):
        path = tiny_checkpoint(arch)
        engine = Engine.from_dir(path, backend="cupy", max_slots=1, max_len=tokens + 64)
        got = {}
        for name, rows in (("loop", 0), ("grouped", limit), ("loop", 0), ("grouped", limit)):
            moe.GROUPED_MAX_ROWS = rows
            got.setdefault(name, []).append(greedy_ms_per_token(engine, tokens, warmup_tokens=4))
        moe.GROUPED_MAX_ROWS = limit
        rec = {"arch": arch, "tokens": tokens,
               **{f"{n}_ms_per_token": [round(ms, 2) for ms, _ in v] for n, v in got.items()},
               "same_tokens": got["loop"][0][1] == got["grouped"][0][1]}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def main() -> None:
    import cupy as cp  # noqa: PLC0415

    from gpu_worker.kernels.moe_experts import experts_grouped  # noqa: PLC0415
    from gpu_worker.model.moe import experts_loop  # noqa: PLC0415
    from gpu_worker.model.ops import Ops  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--model", action="store_true")
    args = ap.parse_args()
    H, I = 2048, 512
    ops = Ops(cp, np.float32)
    records = []
    for E, k in ((128, 8), (512, 10)):
        rng = np.random.default_rng(E)
        layer = tuple(cp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
                      for shape in ((E, I, H), (E, I, H), (E, H, I)))
        for rows in (1, 4, 16, 64, 256, 512):
            x = cp.asarray(rng.standard_normal((rows, H), np.float32))
            routings = [cp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(rows)]))
                        for _ in range(args.iters + 3)]
            w = cp.asarray(rng.random((rows, k), np.float32))
            distinct = float(np.mean([len(np.unique(cp.asnumpy(r))) for r in routings]))
            loop_us, a = _time(cp, routings, lambda ids, x=x, w=w, layer=layer:
                               experts_loop(ops, *layer, x, ids, w))
            grouped_us, b = _time(cp, routings, lambda ids, x=x, w=w, layer=layer:
                                  experts_grouped(x, ids, w, *layer))
            wbytes = distinct * 3 * I * H * 4
            rec = {"machine": platform.node(), "H": H, "I": I, "E": E, "topk": k, "rows": rows,
                   "distinct_experts": distinct, "weight_bytes": wbytes,
                   "loop_us": round(loop_us, 1), "grouped_us": round(grouped_us, 1),
                   "grouped_gbps": round(wbytes / grouped_us / 1e3, 1),
                   "max_abs_diff": float(cp.abs(a - b).max())}
            print(json.dumps(rec), flush=True)
            records.append(rec)
        layer = None
        cp.get_default_memory_pool().free_all_blocks()
    if args.model:
        records += model_decode()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
