"""What the MTP head's drafting adds to a decode step, eager and as one CUDA graph.

    python -m scripts.bench_mtp --model qwen3-next-80b-a3b --gpu-budget whole --drafts 3 \\
        --out docs/bench/mtp_h100.json

The model is built as ``python -m gpu_worker.server`` builds it (scripts/bench_step.py's
``Bench``). A configs/models name gets an MTP head (``mtp_num_hidden_layers: 1``: the real
checkpoints have one; the synthetic config does not, so the step benchmark runs without it).
Per slot count the record holds the median synchronized wall time of a decode step (one row
per slot, no drafts to verify) without drafting, with ``--drafts`` MTP drafts per slot drafted
eagerly (k head passes of Python-launched kernels, each ending in a host wait for its argmax:
gpu_worker/mtp_drafter.py) and, on CuPy with CUDA graphs, drafted by the graph of
gpu_worker/mtp_graph.py; the difference is the drafting's cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from scripts.bench_common import command_line, machine
from scripts.bench_load import parse_budget
from scripts.bench_step import Bench, worker_config
from scripts.step_floor import model_spec

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"


def with_mtp(spec: str, work: Path) -> str:
    """A synthetic spec whose config has an MTP head: a configs/models name's config with
    ``mtp_num_hidden_layers`` 1, written into ``work``; any other spec as it is."""
    if not (MODELS / f"{spec}.json").is_file():
        return model_spec(spec)
    config = json.loads((MODELS / f"{spec}.json").read_text())
    config["mtp_num_hidden_layers"] = config.get("mtp_num_hidden_layers") or 1
    path = work / f"{spec}-mtp.json"
    path.write_text(json.dumps(config))
    return f"synthetic:{path}"


def measure(bench: Bench, slots: int, drafts: int, steps: int, warmup: int) -> dict[str, Any]:
    """One slot count's record: step ms without drafting, drafting eagerly, by graph."""
    plain = bench.work(slots, 1)
    drafting = [dataclasses.replace(w, mtp_drafts=drafts) for w in plain]
    graphs = bench.runner.graphs
    rec: dict[str, Any] = {"slots": slots, "drafts": drafts}
    arms = [("step_ms", plain, True), ("eager_ms", drafting, False)]
    if graphs is not None:
        arms.append(("graph_ms", drafting, True))
    for name, work, graph in arms:
        if graphs is not None:
            graphs.mtp.enabled = graph
        before = dict(graphs.totals) if graphs is not None else {}
        times, res = bench.step_ms(work, warmup, steps)
        rec[name] = statistics.median(times)
        if graphs is not None and work is drafting:
            rec[f"{name[:-3]}_counts"] = {k: v - before.get(k, 0) for k, v in
                                          graphs.totals.items() if k.startswith("mtp_")}
        if work is drafting:
            rec[f"{name[:-3]}_drafts"] = [len(r.drafts) for r in res.slots]
    for name in ("eager_ms", "graph_ms"):
        if name in rec:
            rec[f"{name[:-3]}_drafting_ms"] = rec[name] - rec["step_ms"]
    if graphs is not None:
        graphs.mtp.enabled = True
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-next-80b-a3b",
                   help="a configs/models name (given an MTP head) or a worker model spec")
    p.add_argument("--gpu-budget", type=parse_budget, default=None)
    p.add_argument("--backend", choices=("cupy", "numpy"), default="cupy")
    p.add_argument("--dtype", default=None)
    p.add_argument("--slots", default="1,2,3,4")
    p.add_argument("--drafts", type=int, default=3)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    slot_counts = [int(s) for s in args.slots.split(",")]
    args.layouts = [(max(slot_counts), 1 + args.drafts)]  # what worker_config sizes
    for name, value in (("kv_cache_dtype", "model"), ("cpu_format", "int8"),
                        ("gpu_format", "model"), ("cpu_experts_per_layer", 0),
                        ("cpu_workers", 0), ("max_context", args.context + 64),
                        ("graphs", args.backend == "cupy"), ("no_graph_buckets", False)):
        setattr(args, name, value)
    with tempfile.TemporaryDirectory() as work:
        cfg = worker_config(args, with_mtp(args.model, Path(work)))
        bench = Bench(cfg, args.context)
    try:
        if bench.model.mtp is None:
            print("bench_mtp: the model has no MTP head", file=sys.stderr)
            return 2
        records = []
        for slots in slot_counts:
            records.append(measure(bench, slots, args.drafts, args.steps, args.warmup))
            print(json.dumps(records[-1]), flush=True)
    finally:
        bench.close()
    result = {"benchmark": "bench_mtp", "machine": machine(),
              "command": command_line() if argv is None else " ".join(argv),
              "model": args.model, "gpu_budget_gb": args.gpu_budget,
              "load_seconds": bench.load_seconds, "records": records}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
