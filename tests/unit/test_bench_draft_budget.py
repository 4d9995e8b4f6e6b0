"""scripts/bench_draft_budget.py runs at a small shape and writes its record."""

from __future__ import annotations

import json

from scripts.bench_draft_budget import main


def test_the_budget_benchmark_times_both_parts(tmp_path):
    out = tmp_path / "b.json"
    assert main(["--layers", "3", "--experts", "32", "--topk", "4", "--cpu", "28",
                 "--reps", "3", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["take_slot_experts_ms"] > 0 and record["choose_ms"] > 0
    assert sorted(record["experts_per_slot"]) == ["0", "1", "2", "3"]
    assert len(record["chosen"]) == 4 and all(0 <= n <= 3 for n in record["chosen"])


def test_the_steps_that_read_routes_are_timed_apart_with_their_copies(tmp_path):
    from gpu_worker.experts import counters  # noqa: PLC0415

    packed_runs = counters._packed_runs
    out = tmp_path / "b.json"
    assert main(["--layers", "3", "--experts", "32", "--topk", "4", "--cpu", "28",
                 "--reps", "4", "--no-reuse", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["routes_read"] == "4 of 4 steps"  # --no-reuse: every step reads
    assert record["take_read_ms"] > record["take_copy_ms"] > 0
    assert counters._packed_runs is packed_runs  # the timing wrapper is taken out again
