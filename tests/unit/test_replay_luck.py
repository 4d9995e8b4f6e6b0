"""The replay's luck: how the replay proposer's fixed draws compare with its profile's rate,
offline for fixed arms (scripts/replay_luck.py) and from a run's step trace for any arm
(scripts/bench_concurrency_serve.acceptance_luck), and the two agreeing on a served run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from daemon.proposers.replay import read_records, write_replay_file
from gpu_worker.engine import Engine
from scripts import replay_luck
from scripts.bench_concurrency_serve import acceptance_luck
from scripts.tiny_model import make_tiny_model
from tests.unit.spec_serve import serve

PROMPTS = [[5, 6, 7, 8] * 6, list(range(20, 44)), [3, 1, 4, 1, 5, 9, 2, 6], [9, 8, 7] * 5]


def _records(n: int, length: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"prompt_ids": [int(i), 7, 8], "continuation": rng.integers(1, 90, length).tolist()}
            for i in range(n)]


def test_certain_and_impossible_drafts_are_never_lucky():
    records = _records(3, 40)
    sure = replay_luck.fixed_luck(records, 1.0, 3, seed=0)
    # every verify accepts its drafts: tokens 2..40 of each record (the first is the prompt's)
    assert sure["tokens"] == 3 * 39 and sure["luck"] == 1.0
    never = replay_luck.fixed_luck(records, 0.0, 3, seed=0)
    assert never["tokens"] == 3 * 39 == never["verifies"] + 3  # the last token has no room
    assert never["luck"] == 1.0


def test_luck_averages_out_over_seeds_but_not_within_one():
    records = _records(8, 128)
    lucks = np.array([[replay_luck.fixed_luck(records, 0.879, k, s)["luck"] for k in (1, 2, 3)]
                      for s in range(24)])
    assert abs(lucks.mean() - 1.0) < 0.01
    assert lucks.std() > 0.005  # one seed's draws are off the rate by more than that


def test_a_run_traces_the_luck_the_offline_walk_finds(tmp_path):
    """A fixed arm served through the scheduler (wide, 2 drafts, replay): the luck its trace
    gives over every decode slot equals the offline walk of the same replay file and seed."""
    path = make_tiny_model(tmp_path / "m", "qwen3_next", seed=4, tokenizer=False)
    model = Engine.from_dir(path, dtype="float64", max_slots=4, max_len=256).model
    rec = tmp_path / "plain.jsonl"
    serve(model, PROMPTS, n=30, temperature=0.85, record_file=rec)
    replay = tmp_path / "replay.json"
    write_replay_file(replay, read_records(rec), workload="essay", source="mtp",
                      profile={"workloads": {"essay": {"mtp": {"p": 0.8}}}}, seed=3)
    trace = tmp_path / "wide2.steps.jsonl"
    serve(model, PROMPTS, n=30, mode="wide", temperature=0.85, proposer="replay",
          replay_file=replay, num_drafts=2, step_trace_file=trace)
    got = acceptance_luck(trace, 0, 0.8, slots=None)
    offline = replay_luck.fixed_luck(json.loads(replay.read_text())["records"], 0.8, 2, 3)
    assert got["tokens"] == offline["tokens"] == 4 * 29
    assert got["expected_tokens"] == pytest.approx(offline["expected_tokens"])
    assert got["luck"] == offline["luck"]
    # the four-slot decode steps alone: a part of it
    four = acceptance_luck(trace, 0, 0.8)
    assert 0 < four["slot_steps"] < got["slot_steps"]


def test_the_cli_writes_each_seed_and_length(tmp_path):
    replay = tmp_path / "r.json"
    write_replay_file(replay, _records(2, 30), workload="essay", source="mtp",
                      profile={"workloads": {"essay": {"mtp": {"p": 0.7}}}}, seed=5)
    out = tmp_path / "luck.json"
    assert replay_luck.main([str(replay), "--drafts", "1,3", "--seeds", "0-2",
                             "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rate"] == 0.7 and data["file_seed"] == 5
    assert set(data["by_seed"]) == {"0", "1", "2"}
    assert set(data["by_seed"]["1"]) == {"k=1", "k=3"}
    replay_luck.main([str(replay), "--out", str(out)])
    assert set(json.loads(out.read_text())["by_seed"]) == {"5"}
