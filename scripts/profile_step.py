"""Where a decode/verify step's device time goes, kernel by kernel, under Nsight Compute.

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \\
        --log-file "$OUT/ncu.csv" python3 -m scripts.profile_step --model qwen3-next-80b-a3b \\
        --gpu-budget whole --layouts 1x1,4x4
    python3 -m scripts.profile_step --summarize "$OUT/ncu.csv" --out "$OUT/kernels.json"

The model is built as ``scripts/bench_step.py`` builds it (eager: a graph replays the same
kernels), every slot prefilled, and one step per layout runs between
``cudaProfilerStart``/``Stop`` after two warm-up steps, each after a one-thread kernel named
``layout_SxR`` that marks where it begins, so the profile holds exactly one step of each
layout. ``--summarize`` turns ncu's CSV into per-kernel totals per layout (count, summed
duration, share), largest first: the sum next to the graph step time of bench_step
says how much of a step is kernel time and how much the gaps between kernels.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

from scripts.bench_load import parse_budget
from scripts.step_floor import model_spec, parse_layouts

MARK = "layout_"  # the name of the kernel that opens a layout's step in the profile
BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def profile(args: argparse.Namespace) -> None:
    """Run the marked steps (the profiler sees only them)."""
    import cupy  # noqa: PLC0415 (a GPU machine's)

    from scripts.bench_step import Bench, worker_config  # noqa: PLC0415

    args.backend, args.dtype, args.kv_cache_dtype, args.graphs = "cupy", None, "model", False
    args.no_graph_buckets = False  # bench_step's flag; eager passes here
    args.cpu_experts_per_layer, args.cpu_workers, args.cpu_format = 0, 0, "int8"
    args.gpu_format = "model"
    args.max_context = 4096
    bench = Bench(worker_config(args, model_spec(args.model)), args.context)
    try:
        for slots, rows in args.layouts:
            work = bench.work(slots, rows)
            bench.step_ms(work, warmup=2, steps=0)
            bench.restore(work)
            marker = cupy.RawKernel(f'extern "C" __global__ void {MARK}{slots}x{rows}() {{}}',
                                    f"{MARK}{slots}x{rows}")
            cupy.cuda.runtime.profilerStart()
            marker((1,), (1,), ())
            bench._execute(work)
            bench.sync()
            cupy.cuda.runtime.profilerStop()
            print(f"profiled {slots}x{rows}", flush=True)
    finally:
        bench.close()


def summarize(path: Path) -> dict[str, Any]:
    """Per-layout, per-kernel totals of an ncu CSV of ``gpu__time_duration.sum``."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    layouts: dict[str, dict[str, list[float]]] = {}
    for row in csv.DictReader(lines[start:]):
        metric = row.get("Metric Name")
        if metric not in ("gpu__time_duration.sum", "dram__bytes_read.sum"):
            continue
        name = re.sub(r"\(.*", "", row["Kernel Name"]).strip()
        if name.startswith(MARK) or not layouts:
            total = layouts.setdefault(name.removeprefix(MARK) if name.startswith(MARK)
                                       else "?", collections.defaultdict(lambda: [0, 0.0, 0.0]))
            if name.startswith(MARK):
                continue
        value = float(row["Metric Value"].replace(",", ""))
        if metric == "dram__bytes_read.sum":
            total[name][2] += value * BYTES.get(row["Metric Unit"], 1.0)
            continue
        total[name][0] += 1
        total[name][1] += value * UNITS[row["Metric Unit"]]
    return {"source": str(path), "layouts": {k: _totals(v) for k, v in layouts.items()}}


def _totals(total: dict[str, list[float]]) -> dict[str, Any]:
    """Launches, microseconds, share and DRAM read rate per kernel name."""
    whole = sum(us for _, us, _ in total.values())
    kernels = sorted(({"kernel": k, "launches": int(n), "us": round(us, 1),
                       "share": round(us / whole, 4) if whole else 0.0,
                       "dram_gbs": round(b / us / 1e3, 1) if us else 0.0}
                      for k, (n, us, b) in total.items()), key=lambda r: -r["us"])
    return {"launches": sum(int(n) for n, _, _ in total.values()),
            "kernel_us": round(whole, 1), "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-next-80b-a3b")
    p.add_argument("--gpu-budget", type=parse_budget, default=None)
    p.add_argument("--layouts", type=parse_layouts, default=parse_layouts("1x1"))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--summarize", type=Path, default=None, help="an ncu CSV to sum up")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.summarize is None:
        profile(args)
        return 0
    result = summarize(args.summarize)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    for layout, t in result["layouts"].items():
        print(f"{layout}: {t['launches']} launches, {t['kernel_us']} us of kernels")
        for r in t["kernels"][:25]:
            print(f"{r['us']:10.1f} us {r['share']:6.1%} {r['launches']:6d}x "
                  f"{r['dram_gbs']:7.1f} GB/s  {r['kernel'][:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
