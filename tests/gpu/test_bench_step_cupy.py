"""scripts/bench_step.py on the device: the kernel that keeps the GPU busy while the host time
is measured, and a run on a tiny bf16 Qwen3-Next split with a CPU worker."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scripts import bench_step
from scripts.bench_common import SPIN_KERNEL, tiny_checkpoint

cupy = pytest.importorskip("cupy")


def test_the_spin_kernel_keeps_the_device_busy():
    if "cpu-emulator" in cupy.__version__:
        pytest.skip("the emulator runs each launch to its end before returning (no queue)")
    spin = cupy.RawKernel(SPIN_KERNEL, "spin")
    start, after = cupy.cuda.Event(), cupy.cuda.Event()
    cupy.cuda.Device().synchronize()
    start.record()
    spin((1,), (1,), (np.uint64(50e6),))  # 50 ms
    after.record()
    pending = not after.done  # the host is far ahead of the device
    after.synchronize()
    ms = cupy.cuda.get_elapsed_time(start, after)
    assert pending and 49 <= ms < 200, (pending, ms)


@pytest.mark.timeout(300)
def test_a_tiny_split_run_on_cupy(tmp_path):
    ckpt = tiny_checkpoint("qwen3_next")
    out = tmp_path / "step.json"
    rc = bench_step.main(["--model", str(ckpt), "--backend", "cupy", "--dtype", "bfloat16",
                          "--gpu-budget", "whole", "--cpu-experts-per-layer", "4",
                          "--cpu-workers", "1", "--layouts", "1x1,2x3", "--steps", "3",
                          "--context", "40", "--max-context", "128", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    print(json.dumps(result["records"], indent=1))
    for r in result["records"]:
        assert r["floor_ms"] > 0 and r["step_ms"] > 0 and r["host_ms"] > 0, r
        assert isinstance(r["host_exact"], bool)
        assert r["distinct_from_counters"] == pytest.approx(
            [r["distinct_experts_gpu"], r["distinct_experts_cpu"]]), r
        assert 1 <= r["distinct_experts_gpu"] + r["distinct_experts_cpu"] <= 8
        assert r["gpu_bytes_per_expert"] == 3 * 32 * 64 * 2  # bf16 experts: 2 B a weight


def test_the_measured_hbm_rate_frees_its_array():
    from scripts.step_floor import hbm_rate

    pool = cupy.get_default_memory_pool()
    held = pool.total_bytes()
    tbs, source = hbm_rate("measure", "cupy", nbytes=64 << 20)
    assert tbs > 0 and "best of 5 read passes over 0.0625 GiB" in source
    assert pool.total_bytes() <= held  # the model's memory plan sees the device as before


@pytest.mark.parametrize("where", [0, 777, 2047, 4096 * 8 + 5])
def test_the_read_kernel_reaches_every_element(where):
    """The HBM probe's kernel loads every element: the one holding the marker (the only
    non-zero) makes its thread store it, wherever it is, the tail past a whole block too."""
    from scripts.step_floor import READ_KERNEL

    n = 4096 * 8 + 9
    a = cupy.zeros(n, dtype=cupy.uint64)
    a[where] = np.uint64(0x9E3779B97F4A7C15)
    out = cupy.zeros(1, dtype=cupy.uint64)
    cupy.RawKernel(READ_KERNEL, "read_all")((-(-n // 2048),), (256,), (a, cupy.int64(n), out))
    assert int(out[0]) == 0x9E3779B97F4A7C15


def test_a_failed_hbm_measure_says_so_and_keeps_the_nominal_rate(monkeypatch):
    from scripts import step_floor

    monkeypatch.setattr(step_floor, "READ_KERNEL", "this is not CUDA")
    pool = cupy.get_default_memory_pool()
    held = pool.total_bytes()
    tbs, source = step_floor.hbm_rate("measure", "cupy", nbytes=1 << 20)
    assert tbs == step_floor.HBM_TBS and source.startswith("measure failed (")
    assert pool.total_bytes() <= held
