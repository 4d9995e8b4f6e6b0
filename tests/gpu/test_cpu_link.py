"""The pinned-ring dispatch (gpu_worker/cpu_link.py): CuPy arrays in, CuPy array out, by DMA
through the pool's registered ring. Bit-identical to the host path, also inside a model."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cpu_experts.pool import CpuExpertError, CpuExpertPool
from cpu_experts.quant import quantize
from gpu_worker.engine import Engine
from gpu_worker.sampling import SamplingParams
from gpu_worker.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")

E, I, H = 6, 96, 256


@pytest.mark.parametrize("kernel_in,kernel_out", [(True, False), (True, True), (False, False)],
                         ids=["kernel-memcpy", "kernel-kernel", "memcpy-memcpy"])
def test_pinned_ring_equals_host_dispatch(kernel_in, kernel_out):
    from gpu_worker.cpu_link import PinnedRing

    rng = np.random.default_rng(3)
    layers = {1: tuple((rng.standard_normal(s) * 0.08).astype(np.float32)
                       for s in ((E, I, H), (E, I, H), (E, H, I)))}
    cores = sorted(os.sched_getaffinity(0))[:4]
    first = 4  # global expert ids 4..4+E-1 are the pool's 0..E-1
    mask = cupy.asarray(np.arange(first + E) >= first)
    with CpuExpertPool(layers, cores=[cores[:2], cores[2:]], max_rows=16) as pool:
        link = PinnedRing(pool, cupy, kernel_in=kernel_in, kernel_out=kernel_out)
        assert (link.kernel_in, link.kernel_out) == (kernel_in, kernel_out)  # x86 Linux
        try:
            for rows, k in ((1, 1), (5, 3), (16, 4), (3, 2)):
                x = rng.standard_normal((rows, H)).astype(np.float32)
                ids = rng.integers(-1, E, (rows, k))
                w = rng.random((rows, k)).astype(np.float32)
                base = rng.standard_normal((rows, H)).astype(np.float32)
                q, d = quantize(x)
                host = pool.dispatch_quantized(1, q, d, ids, w)
                gids, rids = link.stage(cupy.asarray(q), cupy.asarray(d), cupy.asarray(ids),
                                        cupy.asarray(w))
                assert (gids == ids).all() and (rids == ids).all()
                assert pool.ring.pairs(rows, k)[1].tobytes() == w.tobytes()
                link.start(1, rows, k)
                got = link.collect()
                assert isinstance(got, cupy.ndarray)
                assert got.get().tobytes() == host.tobytes(), (rows, k)
                # global ids through the layer's mask (0..3: GPU experts), onto a base
                glob = np.where(ids >= 0, ids + first, rng.integers(0, first, ids.shape))
                gids, rids = link.stage(cupy.asarray(q), cupy.asarray(d), cupy.asarray(glob),
                                        cupy.asarray(w), mask, first)
                assert (gids == glob).all() and (rids == ids).all()
                link.start(1, rows, k)
                got = link.collect(base=cupy.asarray(base))
                assert got.get().tobytes() == (base + host).tobytes()
            for bad, on_cpu in ((E, None), (first + E, mask), (-3, mask)):
                link.stage(cupy.asarray(q), cupy.asarray(d), cupy.full((3, 2), bad),
                           cupy.asarray(w), on_cpu, first)
                link.start(1, 3, 2)
                with pytest.raises(CpuExpertError, match="expert id"):
                    link.collect()
            assert pool.dispatch_quantized(1, q, d, ids, w).tobytes() == host.tobytes()
        finally:
            link.close()


def test_split_placement_pinned_equals_host_path(tmp_path):
    """GPU experts plus CPU experts on CuPy: the pinned path (GPU experts overlapping the CPU
    workers) and the host path (copies through NumPy) give the same logits, bit for bit."""
    path = make_tiny_model(tmp_path, "qwen3_next", seed=5, tokenizer=False,
                           moe_intermediate=64, std=0.1)
    prompt = np.arange(5, 60) * 7 % 500
    runs = []
    for pinned in (True, False):
        engine = Engine.from_dir(path, backend="cupy", placement="split",
                                 cpu_experts_per_layer=3, cpu_workers=1, max_slots=1,
                                 max_len=256)
        try:
            assert engine.placement.link is not None
            if not pinned:
                engine.placement.link.close()
                engine.placement.link = None
            tokens = engine.generate(prompt, params=SamplingParams(temperature=0),
                                     max_tokens=64)
            logits = engine.score(np.concatenate([prompt, tokens]))
            stats = engine.placement.take_stats()
        finally:
            engine.close()
        assert stats["cpu_experts"] > 0 and stats["gpu_experts"] > 0
        runs.append((tokens, logits))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1].tobytes() == runs[1][1].tobytes()
