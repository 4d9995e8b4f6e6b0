"""scripts/bench_draft_budget.py --device: route buffers on the GPU, as the launched path
keeps them, give the host path's per-slot experts and so its choices."""

from __future__ import annotations

import json

import pytest

from scripts import bench_draft_budget

pytest.importorskip("cupy")


def test_device_routes_give_the_host_paths_choices(tmp_path):
    small = ["--layers", "3", "--reps", "4", "--slots", "3", "--rows", "2"]
    got = {}
    for name, extra in (("host", []), ("device", ["--device"])):
        out = tmp_path / f"{name}.json"
        assert bench_draft_budget.main([*small, *extra, "--out", str(out)]) == 0
        got[name] = json.loads(out.read_text())
    assert got["device"]["experts_per_slot"] == got["host"]["experts_per_slot"]
    assert got["device"]["chosen"] == got["host"]["chosen"]
    assert got["device"]["args"]["device"] is True and got["host"]["args"]["device"] is False
    assert got["device"]["take_slot_experts_ms"] > 0
