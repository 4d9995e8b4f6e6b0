"""The concurrency benchmark's replay arms end to end (scripts/bench_concurrency.py): real
servers, the plain run recorded, the replay file written, replay arms that emit exactly the
plain run's tokens (float64), and a summary with the figures docs/benchmarks.md describes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from scripts import bench_concurrency  # noqa: E402


def test_replay_arms_give_the_plain_tokens(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    assert bench_concurrency.main([
        "--proposer", "replay", "--arms", "adaptive@2,off", "--pairs", "1",
        "--essay-tokens", "16", "--coding-tokens", "6", "--file-bytes", "200,300",
        "--set", 'model.dtype="float64"', "--out-dir", str(out), "--work-dir", str(work)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arms"] == ["off", "adaptive@2"]  # off first: it records
    assert summary["model"] == "tandem-tiny" and summary["gpu_budget_gb"] is None
    assert summary["machine"]["cores"] >= 1 and summary["runs"] == 4
    for name, turns in (("essay", 4), ("coding", 24)):
        replay = json.loads((work / f"replay_{name}.json").read_text())
        assert replay["workload"] == name and replay["source"] == "mtp"
        assert len(replay["records"]) == turns + 1  # and the warm-up request
        for arm in ("off", "adaptive@2"):
            run = json.loads((out / f"{name}_{arm}_1.json").read_text())
            assert run["exact"] == {"requests": turns + 1, "equal": turns + 1, "differ": 0,
                                    "unknown": 0}, (name, arm)
            assert run["turns"] == turns and run["steps"]["steps"] > 0
            if arm != "off":
                assert run["drafts"]["mtp"]["accepted_per_verify"] > 0, (name, arm)
        entry = summary["by_workload"][name]
        assert entry["tokens_equal_plain"] == {"off": [True], "adaptive@2": [True]}
        assert set(entry["four_stream_decode_tps_pair_ratios"]) == {"adaptive@2"}
