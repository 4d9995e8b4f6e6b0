"""What the steps of benchmark runs cost beyond their CPU experts, from their step traces
(daemon/step_trace.py; scripts/bench_concurrency.py writes ``<run>.steps.jsonl`` beside each
run's records).

For the decode-only steps of ``--slots`` slots (the four-stream windows' kind of step), per
run: the mean rows, tokens, CPU experts, cycle ms (planning to commit), worker ms and CPU
expert ms, and what is left of the cycle and of the worker's step once the CPU experts'
time is taken out (``rest``). Over all runs' steps together, a least-squares fit of the
cycle's rest on (1, rows, emitted tokens, steps that chose afresh): what a row, a token and a
fresh choice of the adaptive budget cost, each with its standard error. For the adaptive
runs, what the fresh choices predicted of every drafted slot at k = 1..4 drafts over the
chosen counts (``uniform``, means) and how their forecasts of the step's CPU experts and
worker time compare with the steps'::

    python -m scripts.fit_step_trace WORK_DIR/essay_*.steps.jsonl --runs OUT_DIR --out FILE.json

(``--runs``: the benchmark's run files, whose ``step_trace`` counts the warm-up's lines,
which are left out.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from protocol.messages import WorkKind
from scripts.bench_common import emit_json

DECODE = int(WorkKind.DECODE)


def steady(lines: list[dict], slots: int) -> list[dict]:
    """The decode-only steps of ``slots`` slots (a step without CPU experts: 0 ms of them)."""
    return [s for s in lines if len(s["slots"]) == slots
            and all(x[0] == DECODE for x in s["slots"]) and s.get("cycle_ms")]


def cpu_ms(step: dict) -> float:
    return float(step["timings"].get("cpu_experts", 0.0))


def run_figures(steps: list[dict]) -> dict:
    """Means over one run's steady steps (module doc)."""
    def mean(f) -> float:
        return round(float(np.mean([f(s) for s in steps])), 4)
    out = {"steps": len(steps), "rows": mean(lambda s: s["rows"]),
           "tokens": mean(lambda s: sum(x[4] for x in s["slots"])),
           "cpu_experts": mean(lambda s: s["cpu_experts"]),
           "cycle_ms": mean(lambda s: s["cycle_ms"]), "worker_ms": mean(lambda s: s["worker_ms"]),
           "cpu_ms": mean(cpu_ms),
           "cycle_rest_ms": mean(lambda s: s["cycle_ms"] - cpu_ms(s)),
           "worker_rest_ms": mean(lambda s: s["worker_ms"] - cpu_ms(s)),
           "daemon_ms": mean(lambda s: s["cycle_ms"] - s["worker_ms"])}
    chose = [s["budget"] for s in steps if s.get("budget")]
    if chose:
        fresh = [b for b in chose if b["fresh"]]
        out["fresh_choices"] = len(fresh)
        out["drafts_chosen"] = {str(k): int(v) for k, v in zip(*np.unique(
            [c for b in chose for c, o in zip(b["chosen"], b["offered"], strict=True) if o],
            return_counts=True), strict=True)}
        uniform = [b["uniform"] for b in fresh if "uniform" in b]
        if uniform:
            out["uniform"] = [round(float(v), 4) for v in np.mean(uniform, axis=0)]
        pairs = [(s["budget"]["forecast"], s) for s in steps
                 if s.get("budget", {}).get("forecast") and s["cpu_experts"]]
        if pairs:
            out["union_error"] = round(float(np.mean(
                [f[0] / s["cpu_experts"] - 1 for f, s in pairs])), 4)
            out["worker_ms_error"] = round(float(np.mean(
                [f[1] / s["worker_ms"] - 1 for f, s in pairs])), 4)
    return out


def fit_rest(steps: list[dict]) -> dict:
    """The cycle's rest (cycle - CPU expert ms) on (1, rows, tokens, fresh choice): each
    coefficient and its standard error."""
    X = np.array([[1.0, s["rows"], sum(x[4] for x in s["slots"]),
                   float(bool(s.get("budget", {}).get("fresh")))] for s in steps])
    y = np.array([s["cycle_ms"] - cpu_ms(s) for s in steps])
    keep = X.std(axis=0) > 0
    keep[0] = True
    X = X[:, keep]
    theta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ theta
    dof = max(len(y) - X.shape[1], 1)
    cov = np.linalg.pinv(X.T @ X) * float(resid @ resid) / dof
    names = [n for n, k in zip(("fixed_ms", "row_ms", "token_ms", "fresh_choice_ms"), keep,
                               strict=True) if k]
    return {"steps": len(y), "residual_sd_ms": round(float(np.sqrt(resid @ resid / dof)), 3),
            **{n: {"value": round(float(v), 4), "se": round(float(np.sqrt(cov[i, i])), 4)}
               for i, (n, v) in enumerate(zip(names, theta, strict=True))}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--runs", type=Path, default=None, help="the benchmark's --out-dir: each "
                   "trace's run file there says how many of its lines are the warm-up's")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    runs, pooled = {}, []
    for path in args.traces:
        name = path.name.removesuffix(".steps.jsonl")
        skip = 0
        if args.runs is not None and (args.runs / f"{name}.json").is_file():
            run = json.loads((args.runs / f"{name}.json").read_text())
            skip = (run.get("step_trace") or {}).get("warm_up_lines", 0)
        lines = [json.loads(x) for x in path.read_text().splitlines()[skip:] if x.strip()]
        steps = steady(lines, args.slots)
        if steps:
            runs[name] = run_figures(steps)
            pooled += steps
    if not pooled:
        raise SystemExit(f"no decode-only steps of {args.slots} slots in the traces")
    out = {"slots": args.slots, "runs": runs, "fit": fit_rest(pooled)}
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
