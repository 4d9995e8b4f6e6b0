"""A short soak (scripts/soak.py) in the test suite: 8 clients for 14 s with random cancels and
disconnects, kills of the CPU expert worker and of the GPU worker under load, then 200 fuzzed
HTTP requests and 200 malformed ZeroMQ frames; every check of the long run must hold. With
speculation the references opt out of it, so every answer under load (drafts verified in
passes shared with other requests, workers killed mid-verify) must be plain decoding's: wide
with suffix drafts on the tiny random model (whose loops accept most drafts), and narrow with
the embedded model's trained MTP head (its experts do not fit the CPU kernels: the model
worker keeps them, and only it is killed). With the prefix cache's host tier (a 1 MB GPU tier
and GDN states of ~0.8 MB a checkpoint), prompts start from checkpoints copied out to host
memory and back under the same load and kills."""

from __future__ import annotations

import json

import pytest

from scripts import soak
from scripts.soak_daemon import ROOT

# 200 fuzzed requests are too few for a leak to show: the allocator's high-water mark still
# steps up 3-5 MB in some round (six seeds of the plain run in 8 rounds: the last half up to
# 7 % over the first), so the RSS checks get 20 % here (the long run keeps 10 %), in two
# rounds (each round's ZeroMQ fuzz waits 2 s for the answers in flight)
BASE = ["--clients", "8", "--duration", "14", "--fuzz-http", "200", "--fuzz-zmq", "200",
        "--jobs", "4", "--max-tokens", "16", "--warmup", "2", "--warmup-fuzz", "100",
        "--probe-every", "4", "--rss-tolerance", "0.2", "--fuzz-rounds", "2"]
RUNS = {
    "plain": ["--gpu-kills", "1", "--cpu-kills", "1"],
    # wide with the adaptive draft budget: its passes are wide passes of chosen lengths (the
    # fixed budget's wide soak is the documented 120 s run, docs/observability.md)
    "wide_suffix": ["--gpu-kills", "1", "--cpu-kills", "1", "--speculation", "wide",
                    "--draft-budget", "adaptive"],
    "host_tier": ["--gpu-kills", "1", "--cpu-kills", "1", "--prefix-host-mb", "64"],
    "narrow_mtp": ["--gpu-kills", "1", "--cpu-kills", "0", "--speculation", "narrow",
                   "--proposer", "mtp", "--placement", "gpu", "--model",
                   str(ROOT / "models" / "tandem-tiny")],
}


@pytest.mark.parametrize("run", list(RUNS))
def test_short_soak_passes_every_check(tmp_path, run):
    out = tmp_path / "soak.json"
    code = soak.main(BASE + RUNS[run] + ["--workdir", str(tmp_path / "work"),
                                         "--json", str(out)])
    result = json.loads(out.read_text())
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert code == 0 and not failed, (failed, {k: result[k] for k in (
        "load", "probe", "bystanders", "fuzz_http", "fuzz_zmq", "fuzz_restarts",
        "slot_watch", "rss_mb_after_warmup", "rss_mb_after_load", "rss_mb_fuzz_rounds",
        "speculation")})
    # the run did what it claims: load completed, the kills recovered, the fuzz was answered
    assert result["load"]["completed"] > 20
    kills = sorted(k["module"] for k in result["kills"])
    assert kills == (["gpu_worker.server"] if run == "narrow_mtp" else
                     ["cpu_experts.worker", "gpu_worker.server"])
    assert result["fuzz_http"]["sent"] == 200 and result["fuzz_zmq"]["sent"] == 200
    assert len(result["rss_mb_fuzz_rounds"]) == 2  # the fuzz in rounds, the RSS after each
    assert sum(result["fuzz_http"]["statuses"].values()) == 200
    assert result["slot_watch"]["states_seen"].get("queued", 0) > 0
    if run == "host_tier":  # prompts started from checkpoints copied back from host memory
        assert result["prefix_cache"]["host"]["hits"] > 0
    spec = result["speculation"]
    if run in ("plain", "host_tier"):
        assert spec["drafts"] == 0
    else:  # drafts were verified and accepted, from the source asked for
        source = "mtp" if run == "narrow_mtp" else "suffix"
        assert spec["verifies"][source] > 0 and spec["accepted"] > 0
    if run == "wide_suffix":  # the adaptive budget chose the verified drafts' lengths
        assert sum(spec["budget_choices"].values()) > 0
    else:
        assert spec["budget_choices"] == {}


@pytest.mark.parametrize("argv, says", [
    (["--placement", "gpu", "--cpu-kills", "1"], "--cpu-kills needs --placement cpu"),
    (["--draft-budget", "adaptive"], "--draft-budget adaptive needs --speculation"),
    (["--fuzz-rounds", "1"], "--fuzz-rounds needs 2 or more"),
])
def test_options_that_cannot_run_are_refused_before_a_daemon_starts(tmp_path, argv, says):
    with pytest.raises(SystemExit, match=says):
        soak.main(argv + ["--workdir", str(tmp_path / "work")])
    assert not (tmp_path / "work").exists()


# the daemon's RSS after 24 rounds of 3,000 fuzzed HTTP requests (session 36, dev VM): an
# early climb of the allocator's high-water mark, then level
MEASURED = [74.4, 79.0, 77.9, 78.0, 78.1, 77.7, 78.3, 78.3, 79.6, 80.7, 80.3, 81.1, 81.3, 81.4,
            81.7, 81.8, 81.9, 81.8, 82.3, 80.2, 80.3, 82.7, 80.5, 80.6]


@pytest.mark.parametrize("rss, ok", [
    (MEASURED, True),
    # a short soak's (session 36): the allocator's step up came late
    ([72.6, 72.7, 72.7, 72.8, 72.8, 76.0, 76.1, 78.0], True),
    # the long run's 8 rounds of 1,250 fuzzed requests each, 2 kB a request kept
    ([80.0 + 2.5 * i for i in range(8)], False),
    ([80.0, 88.0, 80.5, 81.0], True),              # a spike in the first half
    ([80.0, 80.0, 80.0, 89.0], False),             # a jump at the end
    ([80.0, 80.0, None, 80.0], False),              # the daemon gone
    ([80.0], False),                                # no halves to compare
])
def test_rss_check_reads_a_climb_not_a_plateau(rss, ok):
    assert soak.levels_off(rss, 0.10) is ok
