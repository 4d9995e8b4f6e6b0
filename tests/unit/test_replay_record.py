"""Recording plain runs for the replay proposer (daemon/proposers/replay.py ReplayRecorder,
``[speculation] record_file``) and the concurrency benchmark's helpers around it
(scripts/bench_concurrency_serve.py, scripts/bench_concurrency_report.py)."""

from __future__ import annotations

import json

import pytest

from daemon.config import load_config
from daemon.config_checks import ConfigError
from daemon.proposers.replay import (
    ReplayProposer,
    prompt_key,
    read_records,
    write_replay_file,
)
from gpu_worker.engine import Engine
from scripts.bench_concurrency_arms import arm_overrides, arm_speculation, parse_set, run_config
from scripts.bench_concurrency_report import best_fixed, summarize
from scripts.bench_concurrency_serve import (
    exactness,
    step_figures,
    write_toml,
)
from scripts.tiny_model import make_tiny_model
from tests.unit.spec_serve import serve

PROMPTS = [[5, 6, 7, 8] * 6, list(range(20, 44)), [3, 1, 4, 1, 5, 9, 2, 6]]
PROFILE = {"workloads": {"essay": {"mtp": {"p": 0.8}}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=4, tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=3, max_len=256).model


@pytest.mark.parametrize("mode,temperature", [("wide", 0.85), ("narrow", 0.0)])
def test_recorded_plain_run_replays_to_the_same_tokens(model, tmp_path, mode, temperature):
    """Plain decoding records prompt and generated ids; a replay arm fed that record gives
    exactly those tokens (and records them too), with drafts accepted."""
    rec = tmp_path / "plain.jsonl"
    plain, _, _ = serve(model, PROMPTS, n=[30, 24, 27], temperature=temperature,
                        record_file=rec)
    records = read_records(rec)
    # one line per request as it finished (the shortest first)
    assert [r["prompt_ids"] for r in records] == [PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    assert [r["continuation"] for r in records] == [plain[i][0] for i in (1, 2, 0)]
    assert {r["finish_reason"] for r in records} == {"length"}
    replay = tmp_path / "replay.json"
    stats = write_replay_file(replay, records, workload="essay", source="mtp",
                              profile=PROFILE, seed=1)
    assert stats == {"records": 3, "prompt_tokens": sum(map(len, PROMPTS)),
                     "continuation_tokens": 81}
    rec2 = tmp_path / "replayed.jsonl"
    out, worker, sched = serve(model, PROMPTS, n=[30, 24, 27], mode=mode,
                               temperature=temperature, proposer="replay", replay_file=replay,
                               record_file=rec2)
    assert out == plain
    ref = {prompt_key(r["prompt_ids"]): r["continuation"] for r in records}
    assert exactness(read_records(rec2), ref) == {"requests": 3, "equal": 3, "differ": 0,
                                                  "unknown": 0}
    assert sched.draft_plan.replay.stats["diverged"] == 0
    accepted = sum(r.num_accepted for res in worker.results for r in res.slots)
    assert accepted > 10
    # a run that sampled otherwise is caught: its records differ from the plain ones
    other, _, _ = serve(model, PROMPTS[:1], n=30, temperature=0.85, record_file=tmp_path / "o")
    changed = exactness(read_records(tmp_path / "o"), ref)
    assert changed["requests"] == 1 and changed["equal"] == (other[0] == plain[0])


def test_replay_file_keeps_the_longest_record_and_skips_a_torn_line(tmp_path):
    rec = tmp_path / "r.jsonl"
    lines = [{"prompt_ids": [1, 2], "continuation": [3]},
             {"prompt_ids": [1, 2], "continuation": [3, 4, 5]},
             {"prompt_ids": [9], "continuation": []}]
    rec.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"prompt_ids": [7')
    assert len(read_records(rec)) == 3
    path = tmp_path / "replay.json"
    write_replay_file(path, read_records(rec), workload="essay", source="mtp", profile=PROFILE)
    proposer = ReplayProposer.load(path)
    assert proposer.records == {prompt_key([1, 2]): [3, 4, 5], prompt_key([9]): []}
    assert proposer.p == 0.8 and proposer.source_name == "mtp"
    with pytest.raises(ValueError, match="replay source"):
        write_replay_file(path, [], workload="essay", source="oracle", profile=PROFILE)


def test_record_and_replay_files_in_a_toml_config(tmp_path):
    """Both keys are paths relative to the config file; a record file needs its directory."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "replay.json").write_text("{}")
    cfg = tmp_path / "cfg" / "t.toml"
    write_toml(cfg, {"speculation": {"mode": "wide", "proposer": "replay",
                                     "replay_file": "replay.json", "record_file": "r.jsonl"}})
    spec = load_config(cfg).speculation
    assert spec.replay_file == tmp_path / "cfg" / "replay.json"
    assert spec.record_file == tmp_path / "cfg" / "r.jsonl"
    write_toml(cfg, {"speculation": {"record_file": "no/such/dir/r.jsonl"}})
    with pytest.raises(ConfigError, match="record_file"):
        load_config(cfg)


def test_arms_overrides_and_run_configs(tmp_path):
    assert arm_speculation("adaptive@8", "replay") == {
        "proposer": "replay", "draft_budget": "adaptive", "mode": "wide", "num_drafts": 8}
    assert arm_speculation("off", "mtp") == {"proposer": "mtp", "mode": "off"}
    with pytest.raises(SystemExit, match="unknown arm"):
        arm_speculation("wider", "mtp")
    # a variant: the same speculation, its config keys beside it
    assert arm_speculation("adaptive@8+nopin", "replay") == arm_speculation("adaptive@8", "replay")
    assert arm_overrides("wide@3+nopin") == {"experts.pin_host": False}
    assert arm_overrides("wide@3") == {}
    with pytest.raises(SystemExit, match="unknown arm variant"):
        arm_speculation("wide+fast", "mtp")
    assert parse_set(['experts.placement="split"', "experts.cpu_workers=1",
                      "model.dtype=float64"]) == {
        "experts.placement": "split", "experts.cpu_workers": 1, "model.dtype": "float64"}
    base = {"model": {"path": "/m"}, "speculation": {"min_match": 3}}
    cfg = run_config(base, port=9, run_dir=tmp_path, speculation={"mode": "wide"})
    assert cfg["speculation"] == {"min_match": 3, "mode": "wide"} and base["speculation"] == {
        "min_match": 3}
    assert cfg["server"]["port"] == 9
    off = run_config(base, port=9, run_dir=tmp_path, speculation={"mode": "wide"},
                     overrides=arm_overrides("wide+nopin"))
    assert off["experts"] == {"pin_host": False} and "experts" not in base
    assert load_config(None, {"experts.pin_host": off["experts"]["pin_host"]}).experts.pin_host \
        is False


def test_step_figures_from_metrics_deltas():
    def samples(steps, secs, cpu_bytes, moe, cpu_s=0.0):
        return {("tandem_step_seconds_count", ()): steps, ("tandem_step_seconds_sum", ()): secs,
                ("tandem_cpu_expert_weight_bytes_total", ()): cpu_bytes,
                ("tandem_cpu_experts_seconds_per_layer_count", ()): moe,
                ("tandem_cpu_experts_seconds_total", ()): cpu_s}

    f = step_figures(samples(110, 3.0, 5e9, 108, 1.5), samples(10, 1.0, 1e9, 8, 0.3), 1e6,
                     100.0)
    assert f["steps"] == 100 and f["step_ms"] == pytest.approx(20.0)
    assert f["cpu_kernel_ms"] == pytest.approx(12.0)
    assert f["cpu_experts_per_step"] == pytest.approx(4e9 / 1e6 / 100)  # 40 a step
    assert f["cpu_floor_ms"] == pytest.approx(4e7 / 100e9 * 1e3)  # 0.4 ms
    assert f["step_over_cpu_floor"] == pytest.approx(50.0)
    assert step_figures(samples(0, 0, 0, 0), samples(0, 0, 0, 0), 1.0, 1.0) == {"steps": 0}


def test_four_stream_step_figures_count_the_steady_steps_alone():
    """The daemon's steady-decode counters, rendered and parsed as the benchmark scrapes
    them: the four-stream figures leave out the prompt step and the two-slot step."""
    from daemon.metrics import Metrics, StepStats
    from scripts.bench_common import parse_samples

    def step(slots, prompt, cpu_bytes, cpu_s, steady):
        return StepStats(seconds=steady * 0.9, rows=16, prompt_tokens=prompt, decode_tokens=16,
                         emitted=9, active_slots=slots, queue_depth=0,
                         steady_seconds=None if prompt else steady, steady_slots=slots,
                         counters={"moe_layers": 48, "gpu_experts": 1, "cpu_experts": 2,
                                   "cpu_expert_bytes": cpu_bytes}, cpu_expert_seconds=cpu_s)

    m = Metrics()
    before = parse_samples(m.render().decode())
    for s in (step(4, 0, 3e9, 0.2, 0.25), step(4, 0, 1e9, 0.1, 0.15),
              step(4, 500, 9e9, 0.9, 1.0), step(2, 0, 5e8, 0.05, 0.08)):
        m.record_step(s)
    after = parse_samples(m.render().decode())
    f = step_figures(after, before, 1e8, 100.0)
    assert f["steps"] == 4 and f["cpu_experts_per_step"] == pytest.approx(13.5e9 / 4 / 1e8)
    four = f["four_stream"]
    assert four["steps"] == 2 and four["step_ms"] == pytest.approx(200.0)
    assert four["tokens_per_step"] == 9
    assert four["cpu_experts_per_step"] == pytest.approx(20.0)  # 2e9 bytes / 1e8
    assert four["cpu_floor_ms"] == pytest.approx(20.0)  # 2e9 B at 100 GB/s
    assert four["step_over_cpu_floor"] == pytest.approx(10.0)
    assert four["cpu_kernel_ms"] == pytest.approx(150.0)


def test_summary_of_replay_runs_and_the_best_fixed_length():
    def run(arm, pair, tps, exact=True):
        return {"workload": "coding", "arm": arm, "pair": pair, "four_stream_decode_tps": tps,
                "whole_run_tps": tps / 2, "steps": {"step_ms": 10.0, "cpu_floor_ms": 1.0},
                "drafts": {"mtp": {"accepted_per_verify": tps / 100}} if arm != "off" else {},
                "exact": {"requests": 4, "equal": 4 if exact else 3}}

    arms = ["off", "narrow", "wide@1", "wide", "adaptive"]
    runs = [run(a, p, t * p) for p in (1, 2) for a, t in zip(arms, (50, 40, 60, 80, 90),
                                                              strict=True)]
    runs[-1]["exact"]["equal"] = 3
    s = summarize(runs, arms, "narrow")["coding"]
    assert s["four_stream_decode_tps"]["wide"] == 120.0
    assert s["four_stream_decode_tps_pair_ratios"]["wide"] == [2.0, 2.0]
    assert "narrow" not in s["four_stream_decode_tps_pair_ratios"]
    assert s["accepted_per_verify"]["adaptive"] == {"mtp": pytest.approx(1.35)}
    assert s["tokens_equal_plain"]["adaptive"] == [True, False]
    assert s["step_ms"]["off"] == 10.0
    assert s["four_stream_step_ms"]["off"] is None  # runs made before the steady counters
    best = best_fixed(s, arms)
    assert best["best_fixed_arm"] == "wide" and best["adaptive"] == {"adaptive": 1.125}
