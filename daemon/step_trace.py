"""A JSON line per step (benchmarks only: ``[speculation] step_trace_file``, any mode): what
the step ran and what it cost, for studying the draft budget's cost model offline
(scripts/fit_step_trace.py) on the figures the machine gave, step by step, where /metrics
gives sums.

One line per step that ran slots::

    {"step": 17, "cycle_ms": 161.2, "worker_ms": 158.9, "timings": {...}, "passes": 1,
     "rows": 16, "cpu_experts": 4506, "slots": [[kind, rows, drafts, accepted, emitted], ...],
     "budget": {"fresh": true, "offered": [3, 3, 3, 3], "chosen": [3, 3, 2, 3],
                "forecast": [4480.2, 150.3], "uniform": [0.93, 0.99, 1.0, 0.98],
                "accept": [[0.95, 0.9, 0.88], ...], "weights": {"1": 16.0},
                "cost": [11.3, 0.2, 0.0298]}}

``cycle_ms`` runs from the step's planning to the end of its commit (the decode TPS's clock,
docs/observability.md, steady decode); ``worker_ms`` is the worker's round trip (the budget's
step time); ``timings`` the worker's parts (``StepResult.timings_ms``); ``kind`` 1 prefill,
2 decode (``protocol.messages.WorkKind``). ``budget`` (adaptive only): whether the step's
draft counts were chosen afresh or kept (daemon/draft_adaptive.py), the counts offered
(trimmed) and chosen, and for a fresh wide choice its forecast (CPU experts, ms) and what
it predicted of every drafted slot at k = 1..4 drafts, over the chosen counts' tokens per ms,
and what it ran on: each slot's acceptance at its offered draft positions (raised by the
optimism), the request weight of each draft source (daemon/draft_accept.request_weight) and
the step cost's constants (fixed, row, expert ms).
The file is line-buffered: each step's line is written as the step ends.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from protocol.messages import StepPlan, StepResult


class StepTrace:
    """Appends step lines (module doc) to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None

    @classmethod
    def of(cls, spec: Any) -> StepTrace | None:
        """The trace a config's speculation section asks for (None: no ``step_trace_file``)."""
        path = getattr(spec, "step_trace_file", None)
        return cls(path) if path is not None else None

    def add(self, plan: StepPlan, result: StepResult, seconds: float, cycle_s: float | None,
            budget: dict | None) -> None:
        if not plan.slots:
            return
        line: dict[str, Any] = {
            "step": plan.step_id,
            "cycle_ms": None if cycle_s is None else round(cycle_s * 1e3, 4),
            "worker_ms": round(seconds * 1e3, 4),
            "timings": {k: round(float(v), 4) for k, v in result.timings_ms.items()},
            "passes": int(result.counters.get("passes", 1)), "rows": plan.num_rows,
            "cpu_experts": int(result.counters.get("cpu_experts", 0)),
            "slots": [[int(w.kind), w.num_rows, len(w.draft_ids), r.num_accepted,
                       len(r.token_ids)] for w, r in zip(plan.slots, result.slots,
                                                         strict=True)]}
        if budget is not None:
            line["budget"] = budget
        if self._file is None:
            self._file = self.path.open("a", buffering=1)
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
