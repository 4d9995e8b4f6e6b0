"""scripts/probe_cpu_scaling.py: one record per thread count, rates relative to the first."""

import json

from scripts.probe_cpu_scaling import main


def test_the_probe_writes_a_rate_per_thread_count(tmp_path):
    out = tmp_path / "s.json"
    assert main(["--threads", "1,2,999", "--iters", "2000", "--rounds", "1",
                 "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert [r["threads"] for r in records] == [1, 2]  # more than the machine has: left out
    assert records[0]["per_thread_vs_first"] == 1.0
    assert all(r["gflops_per_thread"] > 0 for r in records)
