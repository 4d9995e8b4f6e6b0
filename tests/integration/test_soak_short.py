"""A short soak (scripts/soak.py) in the test suite: 8 clients for 20 s with random cancels and
disconnects, one kill of a CPU expert worker and one of the GPU worker under load, then 200
fuzzed HTTP requests and 200 malformed ZeroMQ frames; every check of the long run must hold."""

from __future__ import annotations

import json

from scripts import soak


def test_short_soak_passes_every_check(tmp_path):
    out = tmp_path / "soak.json"
    code = soak.main(["--clients", "8", "--duration", "20", "--gpu-kills", "1",
                      "--cpu-kills", "1", "--fuzz-http", "200", "--fuzz-zmq", "200",
                      "--jobs", "4", "--max-tokens", "16", "--warmup", "2", "--warmup-fuzz", "100",
                      "--probe-every", "4", "--workdir", str(tmp_path / "work"),
                      "--json", str(out)])
    result = json.loads(out.read_text())
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert code == 0 and not failed, (failed, {k: result[k] for k in (
        "load", "probe", "bystanders", "fuzz_http", "fuzz_zmq", "fuzz_restarts",
        "slot_watch", "rss_mb_after_warmup", "rss_mb_at_end")})
    # the run did what it claims: load completed, both kills recovered, the fuzz was answered
    assert result["load"]["completed"] > 20
    assert sorted(k["module"] for k in result["kills"]) == ["cpu_experts.worker",
                                                            "gpu_worker.server"]
    assert result["fuzz_http"]["sent"] == 200 and result["fuzz_zmq"]["sent"] == 200
    assert result["slot_watch"]["states_seen"].get("queued", 0) > 0
