"""The step trace (daemon/step_trace.py, ``[speculation] step_trace_file``, benchmarks only):
a line per step that ran slots, matching the plans and results the worker saw, with the
adaptive budget's choice where it runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from daemon.config import load_config
from daemon.config_checks import ConfigError
from daemon.proposers.replay import read_records, write_replay_file
from gpu_worker.engine import Engine
from scripts import fit_step_trace
from scripts.bench_concurrency_serve import write_toml
from scripts.tiny_model import make_tiny_model
from tests.unit.spec_serve import serve

PROMPTS = [[5, 6, 7, 8] * 6, list(range(20, 44)), [3, 1, 4, 1, 5, 9, 2, 6], [9, 8, 7] * 5]
PROFILE = {"workloads": {"essay": {"mtp": {"p": 0.8}}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=4, tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=4, max_len=256).model


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_against(lines, worker) -> None:
    """Each line is its step's plan and result: rows, slots, drafts, accepted, emitted."""
    ran = [(p, r) for p, r in zip(worker.plans, worker.results, strict=True) if p.slots]
    assert [line["step"] for line in lines] == [p.step_id for p, _ in ran]
    for line, (plan, result) in zip(lines, ran, strict=True):
        assert line["rows"] == plan.num_rows == sum(s[1] for s in line["slots"])
        assert line["slots"] == [[int(w.kind), w.num_rows, len(w.draft_ids), r.num_accepted,
                                  len(r.token_ids)] for w, r in zip(plan.slots, result.slots,
                                                                    strict=True)]
        assert line["passes"] == result.counters["passes"]
        assert line["worker_ms"] > 0 and line["cycle_ms"] >= line["worker_ms"]
        assert set(line["timings"]) == set(result.timings_ms)


def test_plain_run_traces_every_step_without_budget(model, tmp_path):
    trace = tmp_path / "plain.steps.jsonl"
    out, worker, _ = serve(model, PROMPTS, n=[20, 14, 17, 9], step_trace_file=trace)
    lines = _lines(trace)
    _check_against(lines, worker)
    assert all("budget" not in line for line in lines)
    # every token each request emitted is in the trace, in order of the steps
    emitted = [0] * len(PROMPTS)
    for line, plan in zip(lines, [p for p in worker.plans if p.slots], strict=True):
        for s, w in zip(line["slots"], plan.slots, strict=True):
            emitted[int(w.request_id[1:])] += s[4]
    assert emitted == [len(o[0]) for o in out] == [20, 14, 17, 9]


def test_adaptive_run_traces_the_budget_choice(model, tmp_path):
    rec = tmp_path / "plain.jsonl"
    plain, _, _ = serve(model, PROMPTS, n=24, temperature=0.85, record_file=rec)
    replay = tmp_path / "replay.json"
    write_replay_file(replay, read_records(rec), workload="essay", source="mtp",
                      profile=PROFILE, seed=1)
    trace = tmp_path / "adaptive.steps.jsonl"
    out, worker, sched = serve(model, PROMPTS, n=24, mode="wide", temperature=0.85,
                               proposer="replay", replay_file=replay, num_drafts=3,
                               draft_budget="adaptive", step_trace_file=trace)
    assert out == plain
    lines = _lines(trace)
    _check_against(lines, worker)
    chose = [line for line in lines if "budget" in line]
    assert chose and any(b["budget"]["fresh"] for b in chose)
    assert any(not b["budget"]["fresh"] for b in chose)  # a kept choice
    for line in chose:
        b = line["budget"]
        drafts = [s[2] for s in line["slots"]]
        assert b["chosen"] == drafts  # what ran is what the budget chose
        assert all(c <= o or (o and c == 1) for c, o in zip(b["chosen"], b["offered"],
                                                            strict=True))
        if b["fresh"] and "forecast" in b:
            assert len(b["uniform"]) == 4 and b["forecast"][1] > 0
            # what the choice ran on: the slots' acceptance at their offered positions
            assert [len(a) for a in b["accept"]] == b["offered"]
            assert all(0 < a <= 1 for row in b["accept"] for a in row)
            assert list(b["weights"]) == ["1"] and b["weights"]["1"] >= 4  # mtp's
            assert len(b["cost"]) == 3 and b["cost"][0] > 0
    assert sum(1 for line in chose if "forecast" in line["budget"]) >= 2
    # the offline fit reads the trace: figures of the four-slot decode steps
    report = tmp_path / "fit.json"
    fit_step_trace.main([str(trace), "--out", str(report)])
    got = json.loads(report.read_text())
    four = fit_step_trace.steady(lines, 4)
    run = got["runs"]["adaptive"]
    assert run["steps"] == len(four) > 0
    assert run["rows"] == pytest.approx(sum(s["rows"] for s in four) / len(four), abs=1e-4)
    assert sum(run["drafts_chosen"].values()) == sum(
        1 for s in four if s.get("budget") for o in s["budget"]["offered"] if o) > 0
    assert got["fit"]["steps"] == len(four) and "row_ms" in got["fit"]
    # a run file that counts the first lines as the warm-up's: they are left out
    (tmp_path / "adaptive.json").write_text(json.dumps({"step_trace": {
        "warm_up_lines": len(lines) // 2}}))
    fit_step_trace.main([str(trace), "--runs", str(tmp_path), "--out", str(report)])
    later = fit_step_trace.steady(lines[len(lines) // 2:], 4)
    assert json.loads(report.read_text())["runs"]["adaptive"]["steps"] == len(later) < len(four)


def test_fit_recovers_known_costs():
    """Steps whose rest is 5 + 0.4 rows + 0.2 tokens + 3 on fresh choices (ms), plus noise."""
    rng = np.random.default_rng(0)
    lines = []
    for i in range(400):
        drafts = rng.integers(0, 4, 4)
        acc = np.minimum(drafts, rng.integers(0, 4, 4))
        rows, tokens, fresh = 4 + drafts.sum(), 4 + acc.sum(), bool(i % 8 == 0)
        cpu = 100 + 5 * rows + rng.normal(0, 3)
        rest = 5 + 0.4 * rows + 0.2 * tokens + 3 * fresh + rng.normal(0, 0.3)
        lines.append({"step": i, "cycle_ms": cpu + rest, "worker_ms": cpu + rest - 1,
                      "timings": {"cpu_experts": cpu}, "rows": int(rows), "cpu_experts": 3000,
                      "slots": [[2, 1 + int(d), int(d), int(a), 1 + int(a)]
                                for d, a in zip(drafts, acc, strict=True)],
                      "budget": {"fresh": fresh, "offered": [3] * 4,
                                 "chosen": [int(d) for d in drafts]}})
    fit = fit_step_trace.fit_rest(fit_step_trace.steady(lines, 4))
    for name, want in (("fixed_ms", 5), ("row_ms", 0.4), ("token_ms", 0.2),
                       ("fresh_choice_ms", 3)):
        assert abs(fit[name]["value"] - want) < 4 * fit[name]["se"] + 1e-9, name
        assert fit[name]["se"] < 0.2


def test_step_trace_file_is_validated(tmp_path):
    cfg = tmp_path / "cfg" / "t.toml"
    cfg.parent.mkdir()
    write_toml(cfg, {"speculation": {"step_trace_file": "s.jsonl"}})
    assert load_config(cfg).speculation.step_trace_file == tmp_path / "cfg" / "s.jsonl"
    write_toml(cfg, {"speculation": {"step_trace_file": "no/such/dir/s.jsonl"}})
    with pytest.raises(ConfigError, match="step_trace_file"):
        load_config(cfg)
