"""AMX against AVX-512 VNNI on one int4 expert, alternately in one process (issue 17's 16-row
ratio): per round, each thread count and each instruction set in turn (the order flips every
round), the stages of one expert (H=2048, I=512) at 1 and 16 rows, so a slow or noisy machine
slows both alike. Prints one JSON record per measurement, then the medians over rounds per
(instruction set, threads, rows) with the layer's 16 / 1 ratio, and the CPU's topology (how
many hardware threads share a core: AMX has one tile unit per core)::

    python -m scripts.bench_amx_vnni --rounds 5 --threads 16,8 --out $OUT/amx_vnni.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numba
import numpy as np

from cpu_experts import isa as cpu_isa
from scripts.bench_cpu_kernels_inprocess import expert_weights, stage_times

I = 512
KEYS = ("gate_up_us", "down_us", "layer_us")


def topology() -> dict:
    """Logical CPUs, and the hardware threads of CPU 0's core (Linux sysfs)."""
    sib = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    return {"logical_cpus": numba.config.NUMBA_NUM_THREADS,
            "cpu0_siblings": sib.read_text().strip() if sib.exists() else None}


def summarize(records: list[dict]) -> list[dict]:
    """Medians over rounds per (isa, threads, rows), and each layer's 16-row / 1-row ratio."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["isa"], r["threads"], r["rows"]), []).append(r)
    out = []
    for (name, threads, rows), recs in sorted(groups.items()):
        out.append({"isa": name, "threads": threads, "rows": rows, "rounds": len(recs),
                    **{k: round(statistics.median(r[k] for r in recs), 1) for k in KEYS}})
    one_row = {(o["isa"], o["threads"]): o["layer_us"] for o in out if o["rows"] == 1}
    for rec in out:
        one = one_row.get((rec["isa"], rec["threads"]))
        if rec["rows"] != 1 and one:
            rec["layer_ratio_to_1_row"] = round(rec["layer_us"] / one, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="16,8", help="thread counts (comma-separated)")
    ap.add_argument("--isa", default="amx,avx512vnni",
                    help="instruction sets (comma-separated); those this CPU lacks are skipped")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    can = {cpu_isa.NAMES[i]: i for i in cpu_isa.available()}
    isas = [can[n] for n in args.isa.split(",") if n in can]
    if not isas:
        raise SystemExit(f"none of {args.isa} runs on this CPU (it runs {', '.join(can)})")
    threads = [min(int(t), numba.config.NUMBA_NUM_THREADS) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    weights = expert_weights(I, rng, "int4")
    for which in isas:  # compile (and warm) every entry before any timing
        stage_times(which, weights, I, rng, rows_list=(1, 16))
    records = []
    for r in range(args.rounds):
        for t in threads:
            numba.set_num_threads(t)
            for which in (isas if r % 2 == 0 else isas[::-1]):
                for rec in stage_times(which, weights, I, rng, rows_list=(1, 16)):
                    rec["round"] = r
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
    result = {"topology": topology(), "summary": summarize(records), "records": records}
    print(json.dumps({"topology": result["topology"]}))
    for rec in result["summary"]:
        print(json.dumps(rec))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
