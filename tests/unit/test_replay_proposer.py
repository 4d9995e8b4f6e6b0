"""The replay proposer (benchmarks only, daemon/proposers/replay.py): plain decoding's tokens
whatever its draws, and accept lengths that follow the acceptance profile."""

from __future__ import annotations

import json

import pytest

from daemon.config import SpeculationSection
from daemon.config_checks import ConfigError
from daemon.proposers.replay import (
    ReplayProposer,
    expected_accepted,
    profile_rate,
    prompt_key,
    rate_for_mean,
)
from gpu_worker.engine import Engine
from protocol.messages import DraftSource
from scripts.tiny_model import make_tiny_model
from tests.unit.spec_serve import serve

PROMPTS = [[5, 6, 7, 8] * 6, list(range(20, 44)), [3, 1, 4, 1, 5, 9, 2, 6]]
N = 60
DRAFTS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=4, tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=3, max_len=256).model


def _replay_file(tmp_path, plain, p: float, source: str = "mtp") -> SpeculationSection:
    profile = {"workloads": {"essay": {source: {"p": p}}}}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    data = {"workload": "essay", "source": source, "seed": 3, "profile": "profile.json",
            "records": [{"prompt_ids": pr, "continuation": out}
                        for pr, (out, _) in zip(PROMPTS, plain, strict=True)]}
    path = tmp_path / "replay.json"
    path.write_text(json.dumps(data))
    return path


def _accepted(worker) -> tuple[int, int]:
    """(drafted verifications, accepted drafts) over a served run."""
    verifies = accepted = 0
    for plan, result in zip(worker.plans, worker.results, strict=True):
        by_slot = {r.slot: r for r in result.slots}
        for w in plan.slots:
            if len(w.draft_ids) == DRAFTS and w.slot in by_slot:
                verifies += 1
                accepted += by_slot[w.slot].num_accepted
    return verifies, accepted


def test_rate_for_mean_inverts_the_expected_accepted_count():
    for mean in (0.3, 1.0, 2.2, 3.5):
        assert expected_accepted(rate_for_mean(mean, 4), 4) == pytest.approx(mean, abs=1e-9)
    assert rate_for_mean(9.0, 4) == pytest.approx(1.0)
    with pytest.raises(KeyError, match="coding/suffix"):
        profile_rate({"workloads": {"coding": {"mtp": {"p": 0.5}}}}, "coding", "suffix")


@pytest.mark.parametrize("mode,temperature,p", [("wide", 0.0, 0.7), ("narrow", 0.85, 0.5),
                                                ("wide", 0.85, 0.9)])
def test_replay_gives_plain_tokens_and_follows_the_profile(model, tmp_path, mode,
                                                            temperature, p):
    plain, _, _ = serve(model, PROMPTS, n=N, temperature=temperature)
    path = _replay_file(tmp_path, plain, p)
    out, worker, sched = serve(model, PROMPTS, n=N, mode=mode, temperature=temperature,
                               proposer="replay", replay_file=path, num_drafts=DRAFTS)
    assert out == plain
    replay = sched.draft_plan.replay
    assert replay.stats["unknown_prompt"] == replay.stats["diverged"] == 0
    assert replay.stats["cut"] > 0
    verifies, accepted = _accepted(worker)
    assert verifies >= 30
    # each draw is a truncated geometric: sd <= 1.5 per verify; 4 sd of the mean of >= 30
    assert accepted / verifies == pytest.approx(expected_accepted(p, DRAFTS),
                                                abs=4 * 1.5 / verifies ** 0.5)
    sources = {int(s) for plan in worker.plans for w in plan.slots for s in w.draft_sources}
    assert sources <= {int(DraftSource.MTP)}


def test_unknown_prompts_and_divergence_get_no_drafts(model, tmp_path):
    plain, _, _ = serve(model, PROMPTS, n=20)
    wrong = [([t + 1 for t in out], r) for out, r in plain]  # a record the run never follows
    wrong[2] = plain[2]
    path = _replay_file(tmp_path, wrong, 1.0, source="suffix")
    data = json.loads(path.read_text())
    data["records"] = data["records"][1:]  # prompt 0: no record
    path.write_text(json.dumps(data))
    out, worker, sched = serve(model, PROMPTS, n=20, mode="wide", proposer="replay",
                               replay_file=path)
    assert out == plain
    stats = sched.draft_plan.replay.stats
    assert stats["unknown_prompt"] > 0 and stats["diverged"] > 0 and stats["proposals"] > 0
    assert stats["cut"] == 0  # p = 1: only the record's end stops a draft


def test_config_needs_a_replay_file(tmp_path):
    with pytest.raises(ConfigError, match="replay_file"):
        SpeculationSection(mode="wide", proposer="replay")
    with pytest.raises(ConfigError, match="replay_file"):
        SpeculationSection(mode="wide", proposer="replay", replay_file=tmp_path / "none.json")
    assert prompt_key([1, 2]) != prompt_key([2, 1])
    assert isinstance(ReplayProposer({}, 0.5).draw("k", 3, 4), int)


def test_the_recorded_profile_has_every_workload_and_source():
    from daemon.config_sections import REPO_ROOT

    profile = json.loads((REPO_ROOT / "docs/bench/acceptance_profile.json").read_text())
    for workload in ("essay", "coding"):
        for source in ("mtp", "suffix"):
            entry = profile["workloads"][workload][source]
            assert 0.0 < profile_rate(profile, workload, source) < 1.0
            assert expected_accepted(entry["p"], profile["num_drafts"]) == pytest.approx(
                entry["accepted_per_verify"], abs=2e-3)
