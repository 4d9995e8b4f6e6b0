"""CPU-expert shards kept between runs ([experts] shard_cache, cpu_experts/shard_cache.py): a
second load with the same weights, placement and format maps the first one's shards (no
expert is read or quantized) and gives the same logits; anything that changes the shards'
bytes gives a new entry; unfinished entries are rebuilt; entries in use are never removed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from cpu_experts.shard_cache import CacheEntry, cache_key, evict
from daemon.config import ConfigError, load_config
from daemon.lifecycle import worker_config
from gpu_worker.engine import load_model
from gpu_worker.model.batch import RaggedBatch
from scripts.tiny_model import make_tiny_model

PROMPT = np.arange(5, 37) * 7 % 500


def _build(root: Path, key: str, sizes: list[int], finish: bool = True) -> CacheEntry:
    entry = CacheEntry(root, key, sizes)
    assert not entry.complete
    for w, size in enumerate(sizes):
        with open(entry.path(w), "wb") as f:
            f.truncate(max(size, 1))
    if finish:
        entry.built()
    return entry


def test_an_entry_is_complete_only_once_built_with_its_sizes(tmp_path):
    _build(tmp_path, "a", [100, 200]).close()
    again = CacheEntry(tmp_path, "a", [100, 200])
    assert again.complete
    again.close()
    other = CacheEntry(tmp_path, "a", [100, 300])  # sizes differ: rebuilt, old files gone
    assert not other.complete and not list((tmp_path / "a").glob("experts*.bin"))
    other.close()
    _build(tmp_path, "b", [64], finish=False).close()  # a load that never finished
    late = CacheEntry(tmp_path, "b", [64])
    assert not late.complete and not os.path.exists(late.path(0))
    late.close()


def test_a_new_entry_removes_the_unused_ones_only(tmp_path):
    _build(tmp_path, "old", [10]).close()
    in_use = _build(tmp_path, "used", [10])  # a running server holds it
    _build(tmp_path, "new", [10]).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "used"]
    in_use.close()
    assert evict(tmp_path, keep="new") == ["used"]
    assert [p.name for p in tmp_path.iterdir()] == ["new"]


def test_the_key_follows_the_facts():
    assert cache_key({"a": 1, "b": [2]}) == cache_key({"b": [2], "a": 1})
    assert cache_key({"a": 1}) != cache_key({"a": 2})


def _logits(model, experts) -> np.ndarray:
    caches = model.new_caches(1, 64)
    batch = RaggedBatch.build([(0, 0, PROMPT)])
    rows = np.arange(len(PROMPT))
    return experts.run_step(lambda: model.forward(batch, caches, rows, experts)).logits


def _load(path: Path, cache: Path | None, fmt: str = "int8") -> tuple[np.ndarray, dict]:
    lines: dict[str, dict] = {}
    model, experts = load_model(path, placement="split", cpu_experts_per_layer=3,
                                cpu_workers=1, cpu_format=fmt, cpu_shard_cache=cache,
                                log=lambda event, **f: lines.setdefault(event, f))
    try:
        return _logits(model, experts), lines
    finally:
        experts.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_a_second_load_maps_the_first_ones_shards(tmp_path, arch):
    path = make_tiny_model(tmp_path / "m", arch, seed=4, tokenizer=False, moe_intermediate=64)
    cache = tmp_path / "shards"
    plain, lines = _load(path, None)
    assert not lines["load plan"]["cpu_shards_cached"]
    first, lines = _load(path, cache)
    assert not lines["load plan"]["cpu_shards_cached"] and "load experts CPU" in lines
    [entry] = list(cache.iterdir())
    assert (entry / "complete").exists() and list(entry.glob("experts*.bin"))
    second, lines = _load(path, cache)
    assert lines["load plan"]["cpu_shards_cached"] and "load experts CPU" not in lines
    assert np.array_equal(first, plain) and np.array_equal(second, plain)
    # another format is other bytes: a new entry, and the unused old one goes
    int4, lines = _load(path, cache, "int4")
    assert not lines["load plan"]["cpu_shards_cached"]
    assert [p.name for p in cache.iterdir()] != [entry.name] and len(list(cache.iterdir())) == 1
    # a changed checkpoint file is a new key too
    weights = sorted(path.glob("*.safetensors"))[0]
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    _, lines = _load(path, cache, "int4")
    assert not lines["load plan"]["cpu_shards_cached"]


def test_the_config_key_reaches_the_worker(tmp_path):
    cfg = load_config(None, {"experts.shard_cache": str(tmp_path / "s")})
    assert worker_config(cfg).cpu_shard_cache == str(tmp_path / "s")
    assert worker_config(load_config(None)).cpu_shard_cache == ""
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="shard_cache"):
        load_config(None, {"experts.shard_cache": str(tmp_path / "f")})
