"""scripts/bench_load.py: its memory probes, its reading of the worker's log, the memory rules,
and one real run (two `tandem serve` processes of a tiny synthetic Qwen3-Next on NumPy, one
under a GPU budget that splits the experts, one without a budget) whose JSON must hold every
field the H200 run records."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest

from gpu_worker.memory_plan import plan_memory
from gpu_worker.model_config import ModelConfig
from scripts import bench_load
from scripts.bench_load_probe import TreeMemory, load_facts
from scripts.bench_load_report import GIB, checks, merge
from scripts.procs import process_tree
from scripts.tiny_model import DEFAULT_SIZES, build_config

MIB = 2**20

# a parent and its child both map and touch one 64 MiB shared file, then wait
_SHARED = textwrap.dedent("""
    import mmap, os, sys, time
    path = sys.argv[1]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 64 << 20)
    buf = mmap.mmap(fd, 64 << 20)
    buf[:] = b"x" * (64 << 20)
    if os.fork() == 0:
        s = sum(buf[i] for i in range(0, 64 << 20, 4096))  # map every page here too
    print("ready", flush=True)
    time.sleep(60)
""")


def test_the_tree_counts_shared_memory_once_with_pss(tmp_path):
    shm = Path("/dev/shm" if os.path.isdir("/dev/shm") else tmp_path) / f"tbl-test-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", _SHARED, str(shm)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3)  # the child has touched its pages too
        assert len(process_tree(proc.pid)) == 2
        tree = TreeMemory(proc.pid)
        tree.sample()
        rep = tree.report()
    finally:
        proc.kill()
        proc.wait()
        shm.unlink(missing_ok=True)
    assert rep["peak_host_vmrss_sum_bytes"] >= 128 * MIB  # counted by both processes
    if rep["peak_host_pss_sum_bytes"] is not None:  # smaps_rollup: counted once
        assert rep["rss_method"].startswith("sum of Pss")
        double = rep["peak_host_vmrss_sum_bytes"] - rep["peak_host_pss_sum_bytes"]
        assert double >= 60 * MIB
        assert rep["peak_host_rss_bytes"] == rep["peak_host_pss_sum_bytes"]
    assert all(p["vm_hwm_bytes"] >= 64 * MIB for p in rep["processes"])


def test_load_facts_reads_json_lines_behind_a_progress_bar(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text(
        '{"event": "memory plan", "line": "weights: bfloat16"}\n'
        '{"event": "load plan", "experts_gpu_per_layer": [66], "experts_cpu_per_layer": [446],'
        ' "cpu_bytes": 7}\n'
        'loading x:  18%|#   | 1.4G/7.8G [00:08<00:38]{"event": "load dense", "bytes": 3,'
        ' "seconds": 8.3}\r\nnot json {\n'
        '{"event": "model loaded", "backend_bytes": 5, "cpu_bytes": 7, "seconds": 9}\n')
    facts = load_facts(log)
    assert facts["memory_plan"] == ["weights: bfloat16"]
    assert facts["events"]["load dense"] == {"bytes": 3, "seconds": 8.3}
    assert facts["events"]["load plan"]["experts_cpu_per_layer"] == [446]
    assert facts["events"]["model loaded"]["backend_bytes"] == 5


def test_the_rules_and_their_limits():
    rec = {"cpu_resident_bytes": 70 * GIB, "gpu_resident_bytes": 30 * GIB,
           "peak_host_rss_bytes": 81 * GIB, "peak_gpu_bytes": 33 * GIB}
    c = checks(rec, budget_bytes=32 * GIB, numpy_backend=False)
    assert c["host_rss"]["limit_bytes"] == int(70 * GIB * 1.1 + 4 * GIB)  # 81 GiB
    assert c["host_rss"]["ok"] is True and c["gpu"]["ok"] is False
    c = checks({**rec, "peak_host_rss_bytes": 82 * GIB}, 34 * GIB, numpy_backend=False)
    assert c["host_rss"]["ok"] is False and c["gpu"]["ok"] is True
    c = checks(rec, None, numpy_backend=True)  # the "GPU" side is host memory on NumPy
    assert c["host_rss"]["host_resident_bytes"] == 100 * GIB and c["gpu"]["ok"] is None
    assert checks({**rec, "peak_gpu_bytes": None}, 32 * GIB, False)["gpu"]["ok"] is None


def test_append_keeps_other_budgets_and_replaces_a_rerun():
    old = {"model": "m", "runs": [{"gpu_budget": "32", "x": 1}, {"gpu_budget": "whole"}]}
    new = {"model": "m", "runs": [{"gpu_budget": "32", "x": 2}]}
    assert merge(old, new)["runs"] == [{"gpu_budget": "whole"}, {"gpu_budget": "32", "x": 2}]
    assert merge({**old, "model": "other"}, new) == new


def test_too_little_shared_memory_is_refused_before_any_server(tmp_path, monkeypatch, capsys):
    cfg = _tiny_config(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(bench_load.shutil, "disk_usage", lambda _: usage(1, 1, 1024))
    monkeypatch.setattr(bench_load, "one_run", lambda *a: pytest.fail("a server started"))
    rc = bench_load.main(["--model", str(cfg), "--backend", "numpy", "--gpu-budget",
                          f"{_budget(cfg, 6):.6f}", "--max-context", "512",
                          "--work-dir", str(tmp_path / "w")])
    err = capsys.readouterr()
    assert rc == 2
    assert "MemAvailable" in err.out and "shared memory" in err.out
    assert "which has 0.0 GiB free: enlarge it" in err.err


def _tiny_config(tmp_path: Path) -> Path:
    """A tiny Qwen3-Next config.json: hidden 64, 4 layers, 16 experts of width 32, MTP."""
    raw = build_config("qwen3_next", {**DEFAULT_SIZES, "experts": 16, "topk": 4,
                                      "vocab": 1024}, "bfloat16", [1023])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def _budget(config_file: Path, gpu_experts: int) -> float:
    """A budget in GiB (float32 on NumPy) that holds exactly ``gpu_experts`` per layer."""
    cfg = ModelConfig.from_dict({**json.loads(config_file.read_text()),
                                 "mtp_num_hidden_layers": 1})
    p = plan_memory(cfg, dtype="float32", backend="numpy", max_context=512,
                    prefix_cache_mb=256, placement="split", cpu_workers=1,
                    host_available_bytes=None)
    per_n = len(p.moe_layers) * p.gpu_bytes_per_expert
    return (p.gpu_fixed_bytes + (gpu_experts + 0.5) * per_n) / GIB


def _shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("tandem-*")} if Path("/dev/shm").is_dir() \
        else set()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_split_and_a_whole_run_record_every_field(tmp_path):
    cfg = _tiny_config(tmp_path)
    budget = _budget(cfg, 6)
    out = tmp_path / "load.json"
    before = _shm_files()
    rc = bench_load.main(["--model", str(cfg), "--backend", "numpy", "--gpu-budget",
                          f"{budget:.6f}", "--gpu-budget", "whole", "--max-context", "512",
                          "--max-tokens", "12", "--work-dir", str(tmp_path / "w"),
                          "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0, [r.get("log_tail") for r in result["runs"]]
    assert result["machine"]["cores"] and result["preflight"]["shm_free_bytes"] > 0
    split, whole = result["runs"]
    assert (split["experts_gpu_per_layer"], split["experts_cpu_per_layer"]) == (6, 10)
    assert split["plan_matches_worker"] is True and split["placement"] == "split"
    assert (whole["experts_gpu_per_layer"], whole["experts_cpu_per_layer"]) == (16, 0)
    assert split["cpu_resident_bytes"] > split["cpu_shard_bytes"] > 0
    assert whole["cpu_resident_bytes"] == 0
    assert split["gpu_resident_bytes"] <= budget * GIB
    assert split["gpu_budget_gb"] == pytest.approx(budget, rel=1e-4)
    assert whole["gpu_budget_gb"] is None  # no device size known: no limit, all on the backend
    for run in (split, whole):
        for key in ("model", "gpu_resident_bytes", "peak_host_rss_bytes",
                    "load_seconds", "decode_tokens_per_s_1_stream"):
            assert run[key] is not None, key
        assert run["completion_tokens"] == 12 and run["answer_head"]
        assert run["load_seconds"] > 0 and run["decode_tokens_per_s_1_stream"] > 0
        assert run["checks"]["host_rss"]["ok"] is True
        if shutil.which("nvidia-smi") is None:
            assert run["peak_gpu_bytes"] is None and run["checks"]["gpu"]["ok"] is None
        names = {p["name"] for p in run["processes"]}
        assert {"daemon.cli", "gpu_worker.server"} <= names
        assert {"load plan", "load dense", "model loaded"} <= set(run["load_phases"])
    assert "cpu_experts.worker" in {p["name"] for p in split["processes"]}
    # the CPU workers' shared memory is in the tree's peak (counted once)
    assert split["peak_host_rss_bytes"] > split["cpu_shard_bytes"]
    assert _shm_files() <= before  # every run's shared memory went with its processes
