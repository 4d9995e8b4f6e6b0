"""Decode speed of a CuPy model with every expert on a CPU worker, per dispatch path and core
layout (a GPU benchmark; the machine's CPU count decides what "reserved" means).

Arms: ``host`` / ``launched`` (gpu_worker/experts/) x core layouts:

* ``shared``: the worker on every usable core, this process unpinned;
* ``default``: :func:`cpu_experts.cores.default_core_groups` (cores 0-1 kept for this process
  on machines of 8+ cores), this process unpinned;
* ``pinned``: the default groups, this process pinned to the first reserved core.

Every arm must give the same greedy tokens (checked: ``same_tokens``).

    python -m scripts.bench_model_dispatch --out docs/bench/model_dispatch_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform

from cpu_experts.cores import default_core_groups, reserved_cores
from gpu_worker.engine import Engine
from scripts.bench_common import greedy_ms_per_token, tiny_checkpoint


def run(path: str, tokens: int, dispatch: str, cores: list[list[int]],
        host: set[int]) -> tuple[float, list[int]]:
    """Milliseconds per decoded token (after a warm-up request) and the tokens."""
    os.sched_setaffinity(0, host)
    engine = Engine.from_dir(path, backend="cupy", placement="cpu", cpu_workers=len(cores),
                             cpu_cores=cores, max_slots=1, max_len=tokens + 64)
    try:
        if dispatch == "host":
            engine.placement.use_host_path()
        return greedy_ms_per_token(engine, tokens, warmup_tokens=8)
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    path = tiny_checkpoint("qwen3_moe", moe_intermediate=64, std=0.1)
    usable = sorted(os.sched_getaffinity(0))
    reserved = reserved_cores(usable)
    layouts = {"shared": ([usable], set(usable)),
               "default": (default_core_groups(1), set(usable))}
    if reserved:
        layouts["pinned"] = (default_core_groups(1), {reserved[0]})
    records, first = [], None
    for name, (cores, host) in layouts.items():
        for dispatch in ("host", "launched"):
            ms, out = run(path, args.tokens, dispatch, cores, host)
            first = out if first is None else first
            rec = {"machine": platform.node(), "cpus": len(usable), "layout": name,
                   "worker_cores": f"{cores[0][0]}-{cores[0][-1]}",
                   "host_cores": "all" if host == set(usable) else sorted(host),
                   "dispatch": dispatch, "tokens": args.tokens, "ms_per_token": round(ms, 2),
                   "same_tokens": out == first}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
