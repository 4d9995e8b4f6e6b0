"""scripts/bench_mtp.py on the device: a tiny bf16 Qwen3-Next drafts eagerly and by the MTP
graph (gpu_worker/mtp_graph.py), the graph replayed, every slot with its drafts."""

from __future__ import annotations

import json

import pytest

from scripts import bench_mtp
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")


def test_a_tiny_model_drafts_by_graph(tmp_path):
    path = make_tiny_model(tmp_path / "m", "qwen3_next", seed=1, tokenizer=False)
    out = tmp_path / "mtp.json"
    assert bench_mtp.main(["--model", str(path), "--slots", "1,3", "--drafts", "3",
                           "--context", "8", "--steps", "3", "--warmup", "2",
                           "--out", str(out)]) == 0
    for rec in json.loads(out.read_text())["records"]:
        assert rec["eager_drafts"] == rec["graph_drafts"] == [3] * rec["slots"]
        assert rec["graph_counts"]["mtp_graph_replays"] >= 3, rec
        assert rec["eager_counts"]["mtp_graph_replays"] == 0
