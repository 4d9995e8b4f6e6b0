"""Shards written with pwrite (shard.pwrite_experts, ShardFiles.write): the same bytes as
tiling into a mapped buffer, in any order of runs, int8 and int4, two workers; the loading
process never maps the pages it writes; the synthetic source starts no pool of its own
under a loader thread; the loader's threads stop at the first error."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from cpu_experts import shard
from cpu_experts.pool import CpuExpertPool
from cpu_experts.shard import LayerShape
from gpu_worker.weights import stream, synthetic
from gpu_worker.weights.synthetic import SyntheticSource
from tests.unit.test_synthetic import _config

E, I, H = 7, 64, 96


def _experts(seed: int, n: int = E) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, I, H), np.float32), rng.standard_normal((n, I, H),
            np.float32), rng.standard_normal((n, H, I), np.float32))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_pwrite_experts_equals_tiling_into_a_buffer(tmp_path, fmt):
    shapes = {3: LayerShape(E, I, H), 5: LayerShape(E, I, H)}
    layers = {k: shard.quantize_layer(*_experts(k), fmt) for k in shapes}
    runs = [(4, 7), (0, 1), (1, 4)]  # out of order, unequal
    for w, (lo, hi) in enumerate(shard.shard_bounds(I, 2)):
        bounds = {k: (lo, hi) for k in shapes}
        manifest, size = shard.plan_shard(shapes, bounds, fmt)
        want = bytearray(size)
        shard.write_shard(want, manifest, layers, bounds)
        path = tmp_path / f"shard{w}"
        path.write_bytes(b"")
        os.truncate(path, size)
        fd = os.open(path, os.O_WRONLY)
        try:
            scratch = np.full(10, 0xAB, np.uint8)  # grown below; stale bytes never leak
            for layer, ql in layers.items():
                entries = [e for e in manifest if e[0] == layer]
                for a, b in runs:
                    part = shard.QuantizedLayer(*(x[a:b] for x in (
                        ql.gate_q, ql.gate_s, ql.up_q, ql.up_s, ql.down_q, ql.down_s)))
                    need = shard.run_bytes(entries, b - a)
                    if scratch.size < need:
                        scratch = np.full(need, 0xAB, np.uint8)
                    shard.pwrite_experts(fd, entries, part, (lo, hi), a, scratch)
        finally:
            os.close(fd)
        got = path.read_bytes()
        assert len(got) == size
        if got != bytes(want):
            diff = np.flatnonzero(np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8))
            pytest.fail(f"worker {w} {fmt}: {diff.size} bytes differ, first at {diff[0]} "
                        f"(manifest {[(e[0], e[1], e[4]) for e in manifest]})")


def _rss_shmem() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


def test_filling_a_pool_maps_no_shard_page_here():
    """16 experts of I=H=512 (about 12.8 MiB of int8 tiles), filled from 4 threads: the
    shards hold them (read back exactly), yet this process's resident shared memory grew
    by far less than that (it was every byte before: the pages were faulted in here)."""
    n, dim = 16, 512
    rng = np.random.default_rng(1)
    stacks = [rng.standard_normal((n, dim, dim), np.float32) for _ in range(3)]
    pool = CpuExpertPool({0: LayerShape(n, dim, dim)}, num_workers=2, cores=[[0], [0]])
    try:
        before = _rss_shmem()
        threads = [threading.Thread(target=pool.fill, args=(0, a, *(s[a:a + 4] for s in stacks)))
                   for a in range(0, n, 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grew = _rss_shmem() - before
        assert pool.shard_bytes > 12 * 2**20
        assert grew < pool.shard_bytes // 10, (grew, pool.shard_bytes)
        want = shard.quantize_layer(*stacks)
        got = pool.layers[0].canonical()
        for k in ("gate_q", "gate_s", "up_q", "up_s", "down_q", "down_s"):
            np.testing.assert_array_equal(getattr(got, k), getattr(want, k), err_msg=k)
    finally:
        pool.close()


def test_synthetic_source_pools_only_on_the_main_thread(monkeypatch):
    made = []

    class Recording(synthetic.ThreadPoolExecutor):
        def __init__(self, *a, **k) -> None:
            made.append(threading.current_thread().name)
            super().__init__(*a, **k)

    monkeypatch.setattr(synthetic, "ThreadPoolExecutor", Recording)
    monkeypatch.setattr(synthetic, "_THREADS", 2)
    monkeypatch.setattr(synthetic, "UNIT_ELEMS", 1024)  # a run of 2 experts is "large"
    src = SyntheticSource(_config("qwen3_moe"), seed=3)
    name = next(n for n in src.shapes() if ".mlp.experts." in n)
    on_main = src.read(name, np.float32, experts=[0, 1])
    assert made == [threading.main_thread().name]
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("x", src.read(name, np.float32,
                                                                        experts=[0, 1])))
    t.start()
    t.join()
    assert len(made) == 1  # no pool under a (loader's) thread
    np.testing.assert_array_equal(box["x"], on_main)


def test_loader_threads_stop_at_the_first_error():
    """fill_cpu runs every layer's runs on one set of threads: a failing run is raised
    without waiting for the runs not yet started (they are cancelled)."""
    done = []

    def job(i: int) -> None:
        if i == 3:
            raise ValueError("run 3")
        time.sleep(0.002)
        done.append(i)

    with pytest.raises(ValueError, match="run 3"):
        stream._Loader._on_threads(SimpleNamespace(threads=2), job, [(i,) for i in range(500)])
    assert len(done) < 100
