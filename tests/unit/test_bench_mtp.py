"""scripts/bench_mtp.py on the NumPy backend (no CUDA graphs: the plain and eager arms): a tiny
Qwen3-Next with its MTP head, every slot drafting what it was asked for; a configs/models
name gets an MTP head in its synthetic config."""

from __future__ import annotations

import json

from scripts import bench_mtp
from scripts.tiny_model import make_tiny_model


def test_the_drafting_cost_per_slot_count(tmp_path):
    path = make_tiny_model(tmp_path / "m", "qwen3_next", seed=1, tokenizer=False)
    out = tmp_path / "mtp.json"
    assert bench_mtp.main(["--model", str(path), "--backend", "numpy", "--slots", "1,2",
                           "--drafts", "2", "--context", "8", "--steps", "2", "--warmup", "1",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["slots"] for r in result["records"]] == [1, 2]
    for rec in result["records"]:
        assert rec["step_ms"] > 0 and rec["eager_ms"] > 0 and "graph_ms" not in rec
        assert rec["eager_drafts"] == [2] * rec["slots"]
        assert rec["eager_drafting_ms"] == rec["eager_ms"] - rec["step_ms"]


def test_a_model_name_gets_an_mtp_head(tmp_path):
    spec = bench_mtp.with_mtp("qwen3-next-80b-a3b", tmp_path)
    config = json.loads((tmp_path / "qwen3-next-80b-a3b-mtp.json").read_text())
    assert spec == f"synthetic:{tmp_path / 'qwen3-next-80b-a3b-mtp.json'}"
    assert config["mtp_num_hidden_layers"] == 1 and config["hidden_size"] == 2048
    assert bench_mtp.with_mtp("/some/dir", tmp_path) == "/some/dir"
