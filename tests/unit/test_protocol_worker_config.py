"""WorkerConfig: the GPU worker's one typed config, its JSON round trip and its checks."""

from __future__ import annotations

import dataclasses

import pytest

from protocol.worker_config import WorkerConfig, prefix_blocks


def test_json_round_trip_keeps_every_field():
    cfg = WorkerConfig(run_dir="/tmp/run", model="/m", name="tiny", dtype="float64",
                       placement="split", cpu_experts_per_layer=3, cpu_workers=2,
                       cpu_cores=((0, 1), (2, 3)), cpu_isa="portable", hot_experts="/h.json",
                       kv_cache_dtype="int8", heartbeat_s=0.25, gpu_memory_gb=31.5,
                       prefill_chunk=2048, max_drafts=4)
    back = WorkerConfig.from_json(cfg.to_json())
    assert back == cfg and back.cpu_cores == ((0, 1), (2, 3))
    assert back.gpu_memory_gb == 31.5 and back.gpu_budget_bytes == int(31.5 * 2**30)
    whole = WorkerConfig.from_json(WorkerConfig(run_dir="/r", model="/m").to_json())
    assert whole.gpu_memory_gb is None and whole.gpu_budget_bytes is None


@pytest.mark.parametrize("change", [
    {"dtype": "float16"}, {"placement": "disk"}, {"cpu_isa": "sse"}, {"backend": "torch"},
    {"kv_cache_dtype": "fp8"}, {"max_slots": 0}, {"block_size": 1.5},
    {"cpu_cores": ((),)}, {"hot_experts": "/h.json"}, {"heartbeat_s": 0},
    {"prefix_cache": 1}, {"gpu_memory_gb": 0}, {"gpu_memory_gb": -4.0},
    {"gpu_memory_gb": "32"}, {"gpu_memory_gb": True}, {"gpu_memory_gb": float("nan")},
    {"gpu_memory_gb": float("inf")}, {"prefill_chunk": 0}, {"max_drafts": -1},
])
def test_bad_values_are_refused(change):
    with pytest.raises(ValueError):
        dataclasses.replace(WorkerConfig(run_dir="/r", model="/m"), **change)


@pytest.mark.parametrize("text", ['[]', '{"run_dir": "/r"}',
                                  '{"run_dir": "/r", "model": "/m", "cpu_dispatch": "sync"}'])
def test_malformed_json_is_a_value_error(text):
    with pytest.raises(ValueError):
        WorkerConfig.from_json(text)


def test_prefix_blocks_follow_the_budget_and_the_cap():
    cfg = WorkerConfig(run_dir="/r", model="/m", max_slots=2, max_context=256, block_size=16,
                       prefix_cache_max_mb=1)
    assert cfg.blocks_per_slot == 16
    assert cfg.prefix_blocks(2**20 // 10) == 10  # 1 MiB of ~100 KiB blocks
    assert cfg.prefix_blocks(64) == 4 * 16 * 2  # capped at four slots' worth per slot
    assert dataclasses.replace(cfg, prefix_cache=False).prefix_blocks(64) == 0


def test_the_prefix_block_rule_is_one_function():
    cfg = WorkerConfig(run_dir="/r", model="/m", max_slots=3, max_context=1000, block_size=64,
                       prefix_cache_max_mb=5)
    for size in (1000, 2**20, 3 * 2**20):
        assert cfg.prefix_blocks(size) == prefix_blocks(True, 5, size, 16, 3)
    assert prefix_blocks(False, 5, 1000, 16, 3) == 0
    assert prefix_blocks(True, 0, 1000, 16, 3) == 1  # on with no budget: still one block
