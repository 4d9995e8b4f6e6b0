"""CPU-expert shards kept between runs ([experts] shard_cache, cpu_experts/shard_cache.py): a
second load with the same weights, placement and format maps the first one's shards (no
expert is read or quantized) and gives the same logits; anything that changes the shards'
bytes gives a new entry; unfinished entries are rebuilt; entries in use are never removed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from cpu_experts.shard_cache import CacheEntry, cache_key, evict, reclaimable_bytes
from daemon.config import ConfigError, load_config
from daemon.lifecycle import worker_config
from gpu_worker.engine import load_model
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.weights.resolve import open_source
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
    # cached shards: the workers started while the backend's weights were read
    assert lines["load workers ready"]["during_load"] is True
    assert lines["load workers ready"]["waited_after_load"] >= 0
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


def test_kept_shards_count_as_free_host_memory_for_the_next_plan(monkeypatch):
    """On a memory file system the kept shards are not in MemAvailable; the plan of the
    next start counts the entries no process uses (it maps one or removes them)."""
    if not (Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK)):
        pytest.skip("no /dev/shm here")
    import tempfile  # noqa: PLC0415

    from gpu_worker import memory_parts  # noqa: PLC0415
    from gpu_worker.memory_plan import plan_for_worker  # noqa: PLC0415
    from gpu_worker.model_config import ModelConfig  # noqa: PLC0415
    from protocol.worker_config import WorkerConfig  # noqa: PLC0415

    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        root = Path(root)
        busy = _build(root, "busy", [1 << 20])  # a running server's
        for f in root.glob("busy/experts*.bin"):  # its pages really held
            f.write_bytes(b"\1" * (1 << 20))
        idle = _build(root, "idle", [1 << 20])  # a stopped server's (busy stays)
        for f in root.glob("idle/experts*.bin"):
            f.write_bytes(b"\1" * (1 << 20))
        idle.close()
        assert reclaimable_bytes(root) == 1 << 20  # the idle entry only
        busy.close()
        assert reclaimable_bytes(root) == 2 << 20
        monkeypatch.setattr(memory_parts, "mem_available", lambda: 8 << 30)
        cfg = WorkerConfig(run_dir="/r", model="/m", cpu_shard_cache=str(root))
        model = ModelConfig.from_dict({"model_type": "qwen3_moe", "vocab_size": 64,
                                       "hidden_size": 32, "intermediate_size": 64,
                                       "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "num_key_value_heads": 1, "head_dim": 16,
                                       "num_experts": 4, "num_experts_per_tok": 2,
                                       "moe_intermediate_size": 32})
        plan = plan_for_worker(cfg, model, backend="numpy")
        assert plan.host_available_bytes == (8 << 30) + (2 << 20)
    assert reclaimable_bytes("/nonexistent/dir") == 0


def test_a_q8_0_gguf_split_in_two_files_is_cached_too(tmp_path):
    """A GGUF's identity is every part's name, size and time: the second load maps the first
    one's shards, and the logits are those of an uncached load."""
    from gguf import GGMLQuantizationType  # noqa: PLC0415

    from tests.unit.gguf_tiny import experts_in, write_gguf  # noqa: PLC0415

    model_dir = make_tiny_model(tmp_path / "m", "qwen3_moe", seed=7)
    file = write_gguf(model_dir, tmp_path / "q.gguf", split_max_tensors=20,
                      types=experts_in(GGMLQuantizationType.Q8_0))
    assert file.name.endswith("-00001-of-" + file.name.split("-of-")[1])
    plain, _ = _load(file, None)
    first, lines = _load(file, tmp_path / "shards")
    assert not lines["load plan"]["cpu_shards_cached"]
    second, lines = _load(file, tmp_path / "shards")
    assert lines["load plan"]["cpu_shards_cached"]
    assert np.array_equal(first, plain) and np.array_equal(second, plain)


def test_a_directory_it_cannot_use_is_named_in_the_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"experts.shard_cache .*file.*cannot use it"):
        CacheEntry(tmp_path / "file", "k", [1])


def _children() -> set[int]:
    return {int(p) for f in Path("/proc/self/task").glob("*/children")
            for p in f.read_text().split()}


def test_a_load_that_fails_while_cached_workers_start_leaves_none(tmp_path):
    path = make_tiny_model(tmp_path / "m", "qwen3_moe", seed=4, tokenizer=False,
                           moe_intermediate=64)
    cache = tmp_path / "shards"
    _load(path, cache)  # makes the entry the next load maps
    before = _children()
    source = open_source(path)
    read = source.read

    def broken(name, *args, **kwargs):
        if name == "model.norm.weight":
            raise OSError("disk gone: model.norm.weight")
        return read(name, *args, **kwargs)

    source.read = broken
    lines: dict[str, dict] = {}
    with pytest.raises(OSError, match="disk gone"):
        load_model(source, placement="split", cpu_experts_per_layer=3, cpu_workers=1,
                   cpu_shard_cache=cache, log=lambda event, **f: lines.setdefault(event, f))
    assert lines["load plan"]["cpu_shards_cached"]
    assert _children() == before  # the early workers were stopped with the pool
