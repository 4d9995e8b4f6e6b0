"""scripts/bench_step.py and scripts/step_floor.py: the floor's arithmetic, what a step touched,
and real runs on a tiny Qwen3-Next (NumPy backend, experts split with a CPU worker, then all
on the backend) whose records must hold every field the H200 run records, with a floor that
matches one computed by hand from the config's shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from gpu_worker.model_config import ModelConfig
from gpu_worker.weights_spec import expected_tensors
from scripts import bench_step
from scripts.step_floor import (
    default_dram_gbs,
    distinct_per_layer,
    dram_rate,
    floor_ms,
    hbm_rate,
    merge,
)
from scripts.tiny_model import make_tiny_model

FIELDS = ("model", "gpu_budget_gb", "graphs", "slots", "rows_per_slot", "step_ms", "floor_ms",
          "host_ms", "distinct_experts_gpu", "distinct_experts_cpu", "ratio")


def test_the_floor_is_the_slower_of_hbm_and_dram():
    f = floor_ms(4.2e9, 42e6, hbm_tbs=4.2, dram_gbs=84)  # 1 ms of HBM, 0.5 ms of DRAM
    assert f == pytest.approx({"gpu_floor_ms": 1.0, "cpu_floor_ms": 0.5, "floor_ms": 1.0})
    f = floor_ms(4.2e9, 168e6, hbm_tbs=4.2, dram_gbs=84)
    assert f["floor_ms"] == pytest.approx(2.0) and f["cpu_floor_ms"] == f["floor_ms"]


def test_distinct_experts_per_side():
    on_cpu = {3: np.arange(8) >= 4}  # experts 4..7 live on the CPU
    ids = {3: np.array([[1, 5], [5, 6], [1, 2]])}
    assert distinct_per_layer(ids, on_cpu) == {3: (2, 2)}  # GPU {1, 2}, CPU {5, 6}
    assert distinct_per_layer(ids, None) == {3: (4, 0)}


def test_layouts_and_model_specs():
    assert bench_step.parse_layouts("1x1, 4x5") == [(1, 1), (4, 5)]
    assert len(bench_step.parse_layouts(None)) == 20
    with pytest.raises(Exception, match="SLOTSxROWS"):
        bench_step.parse_layouts("4by5")
    assert bench_step.model_spec("qwen3-next-80b-a3b") == "synthetic:qwen3-next-80b-a3b"
    assert bench_step.model_spec("synthetic:qwen3-30b-a3b?skew=0") == \
        "synthetic:qwen3-30b-a3b?skew=0"


def test_the_dram_rate_comes_from_the_h200_cpu_expert_run(tmp_path):
    rate, source = default_dram_gbs()
    assert 60 < rate < 200 and "kernel_gbps" in source and "E 512" in source
    rate, source = default_dram_gbs(tmp_path / "missing.json")
    assert rate > 0 and "default" in source


def test_the_floor_rates_can_be_this_machines(tmp_path):
    """--dram-gbs takes a number or this machine's bench_cpu_experts JSON (its int8 1-row
    random record at the 80B's shape); a file without that record is an error, not the
    H200's rate in disguise."""
    assert dram_rate("93.5") == (93.5, "--dram-gbs")
    record = {"H": 2048, "I": 512, "E": 512, "topk": 10, "rows": 1, "routing": "random",
              "format": "int8", "kernel_gbps": 117.25, "dram_read_gbps": 150.0}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps([{**record, "rows": 16}, record]))
    rate, source = dram_rate(str(path))
    assert rate == 117.25 and "cpu.json" in source and "150.0" in source
    path.write_text(json.dumps([{**record, "routing": "shared"}, {**record, "format": "int4"}]))
    with pytest.raises(SystemExit, match="no int8"):
        dram_rate(str(path))
    assert dram_rate(None) == default_dram_gbs()
    assert hbm_rate("3.1", "numpy") == (3.1, "--hbm-tbs")
    with pytest.raises(SystemExit, match="cupy"):
        hbm_rate("measure", "numpy")


def test_append_replaces_a_rerun_and_keeps_the_rest():
    rec = {"model": "m", "gpu_budget_gb": 32, "graphs": False, "cpu_format": "int8",
           "slots": 1, "rows_per_slot": 1, "run": 0}
    old = {"runs": [{"command": "a"}], "records": [rec, {**rec, "slots": 2}]}
    new = {"runs": [{"command": "b"}], "records": [{**rec, "step_ms": 1.0}]}
    out = merge(old, new)
    assert [r["command"] for r in out["runs"]] == ["a", "b"]
    assert [(r["slots"], r["run"]) for r in out["records"]] == [(2, 0), (1, 1)]
    assert merge(None, new) is new


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3_next", seed=9,
                           tokenizer=False)


def _run(tiny: Path, out: Path, *extra: str) -> dict:
    rc = bench_step.main(["--model", str(tiny), "--backend", "numpy", "--cpu-workers", "1",
                          "--steps", "2", "--warmup", "1", "--host-runs", "1",
                          "--context", "40", "--max-context", "128", "--out", str(out),
                          *extra])
    assert rc == 0
    return json.loads(out.read_text())


def _hand_floor(cfg: ModelConfig, rec: dict, dram_gbs: float) -> tuple[float, float]:
    """GPU bytes and floor_ms of a float32 tiny record, from the config's shapes alone."""
    H, I, f32 = cfg.hidden_size, cfg.moe_intermediate_size, 4
    rows = rec["slots"] * rec["rows_per_slot"]
    dense = sum(math.prod(s) * f32 for n, s in expected_tensors(cfg, include_mtp=False).items()
                if ".mlp.experts." not in n and n != "model.embed_tokens.weight")
    dense += rows * H * f32  # the embedding rows looked up
    positions = rec["slots"] * (rec["context"] + rec["rows_per_slot"])
    kv = positions * len(cfg.full_attention_layers) * 2 * cfg.num_key_value_heads \
        * cfg.head_dim * f32
    per_gdn = ((cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim
               + cfg.linear_num_value_heads * cfg.linear_key_head_dim
               * cfg.linear_value_head_dim) * f32
    states = rec["slots"] * len(cfg.linear_attention_layers) * per_gdn
    moe = sum(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers))
    gpu = dense + kv + states + rec["distinct_experts_gpu"] * moe * 3 * I * H * f32
    cpu = rec["distinct_experts_cpu"] * moe * 3 * I * H * (1 + 2 / 32)  # int8 + fp16 / 32
    return gpu, max(gpu / 4.2e12, cpu / (dram_gbs * 1e9)) * 1e3


@pytest.mark.timeout(120)
def test_split_and_whole_runs_record_every_field(tiny, tmp_path):
    out = tmp_path / "step.json"
    result = _run(tiny, out, "--gpu-budget", "whole", "--cpu-experts-per-layer", "4",
                  "--layouts", "1x1,2x3")
    cfg = ModelConfig.from_file(tiny / "config.json")
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    assert result["machine"]["cores"] and "bench_step" in result["command"]
    (run,) = result["runs"]
    assert run["experts_cpu_per_layer"] == [4] and run["dram_gbs"] > 0
    one, wide = result["records"]
    assert [(r["slots"], r["rows_per_slot"]) for r in (one, wide)] == [(1, 1), (2, 3)]
    for r in (one, wide):
        assert all(r[f] is not None for f in FIELDS if f != "gpu_budget_gb"), r
        assert r["gpu_budget_gb"] is None and r["graphs"] is False
        assert r["floor_ms"] > 0 and r["step_ms"] > 0 and r["host_ms"] > 0
        assert r["host_exact"] is True  # NumPy: the forward's time is all host work
        assert r["ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        total = r["distinct_experts_gpu"] + r["distinct_experts_cpu"]
        assert 1 <= total <= E and 0 < r["distinct_experts_cpu"] <= 4
        # the placement's own counters of a timed step agree with the recorded routing
        assert r["distinct_from_counters"] == [r["distinct_experts_gpu"],
                                               r["distinct_experts_cpu"]]
        gpu, floor = _hand_floor(cfg, r, run["dram_gbs"])
        assert r["gpu_bytes"] == pytest.approx(gpu, rel=1e-12)
        assert r["floor_ms"] == pytest.approx(floor, rel=1e-9)
    assert one["distinct_experts_gpu"] + one["distinct_experts_cpu"] == k  # one row: k picks
    assert wide["distinct_experts_gpu"] + wide["distinct_experts_cpu"] <= min(E, 6 * k)

    # the whole device (NumPy: no limit), appended: every expert on the backend
    result = _run(tiny, out, "--gpu-budget", "whole", "--layouts", "1x1", "--append")
    assert len(result["runs"]) == 2 and len(result["records"]) == 3  # another placement
    assert [r["run"] for r in result["records"]] == [0, 0, 1]
    whole = result["records"][-1]
    assert result["runs"][1]["experts_cpu_per_layer"] == []
    assert (one["experts_cpu_per_layer"], whole["experts_cpu_per_layer"]) == (4, 0)
    assert whole["distinct_experts_gpu"] == k and whole["distinct_experts_cpu"] == 0
    assert whole["cpu_floor_ms"] == 0 and whole["distinct_from_counters"] is None
    assert whole["floor_ms"] == pytest.approx(_hand_floor(cfg, whole, 100.0)[1], rel=1e-9)
