"""scripts/bench_plan_host.py on the tiny model: both arms serve their requests and are
timed."""

from __future__ import annotations

import json

from scripts import bench_plan_host


def test_both_arms_are_served_and_timed(tmp_path):
    out = tmp_path / "plan.json"
    assert bench_plan_host.main(["--pairs", "1", "--requests", "2", "--tokens", "6",
                                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["budget"] for r in data["runs"]] == ["fixed", "adaptive"]
    for r in data["runs"]:
        assert r["steps"] >= 3 and r["plan_us"] > 0 and r["commit_us"] > 0
    assert set(data["medians"]) == {"fixed", "adaptive"}
