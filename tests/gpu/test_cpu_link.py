"""The launched path's pinned ring (gpu_worker/experts/pinned_ring.py): CuPy arrays in, CuPy
array out, GPU kernels on the pool's registered ring. Bit-identical to the host path, also
inside a model."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cpu_experts.errors import CpuExpertError
from cpu_experts.pool import CpuExpertPool
from cpu_experts.quant import quantize
from gpu_worker.engine import Engine
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")

E, I, H = 6, 96, 256


def test_pinned_ring_equals_host_dispatch():
    from gpu_worker.experts.pinned_ring import PinnedRing, device_can_map

    rng = np.random.default_rng(3)
    layers = {1: tuple((rng.standard_normal(s) * 0.08).astype(np.float32)
                       for s in ((E, I, H), (E, I, H), (E, H, I)))}
    cores = sorted(os.sched_getaffinity(0))[:4]
    first = 4  # global expert ids 4..4+E-1 are the pool's 0..E-1
    mask = cupy.asarray(np.arange(first + E) >= first)
    with CpuExpertPool(layers, cores=[cores[:2], cores[2:]], max_rows=16) as pool:
        assert device_can_map(cupy)  # x86 Linux
        link = PinnedRing(pool, cupy)

        def run(ids_, w_, on_cpu=None, first_cpu=0, base=None):
            """One layer through launch/gather/end_step: (output, ring ids, ring weights)."""
            link.launch(1, cupy.asarray(q), cupy.asarray(d), cupy.asarray(ids_),
                        cupy.asarray(w_), on_cpu, first_cpu)
            out = link.gather(base=base)
            link.end_step()
            rids_, w_ring = pool.ring.pairs(*ids_.shape)
            return out, rids_.copy(), w_ring.copy()

        try:
            for rows, k in ((1, 1), (5, 3), (16, 4), (3, 2)):
                x = rng.standard_normal((rows, H)).astype(np.float32)
                ids = rng.integers(-1, E, (rows, k))
                w = rng.random((rows, k)).astype(np.float32)
                base = rng.standard_normal((rows, H)).astype(np.float32)
                q, d = quantize(x)
                host = pool.dispatch_quantized(1, q, d, ids, w)
                got, rids, w_ring = run(ids, w)
                assert (rids == ids).all()
                assert w_ring.tobytes() == w.tobytes()
                assert isinstance(got, cupy.ndarray)
                assert got.get().tobytes() == host.tobytes(), (rows, k)
                # global ids through the layer's mask (0..3: GPU experts), onto a base
                glob = np.where(ids >= 0, ids + first, rng.integers(0, first, ids.shape))
                got, rids, _ = run(glob, w, mask, first, cupy.asarray(base))
                assert (rids == ids).all()
                assert got.get().tobytes() == (base + host).tobytes()
            for bad, on_cpu in ((E, None), (first + E, mask), (-3, mask)):
                with pytest.raises(CpuExpertError, match="expert id"):
                    run(np.full((3, 2), bad), w[:3, :2], on_cpu, first)
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
            assert engine.placement.launched
            if not pinned:
                engine.placement.use_host_path()
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


def test_launched_path_chunks_rows_above_the_ring(tmp_path):
    """A prefill of more rows than the ring holds (pool.max_rows = 256) stays on the launched
    path, in two loads per layer, and gives the host path's logits bit for bit."""
    path = make_tiny_model(tmp_path, "qwen3_moe", seed=5, tokenizer=False,
                           moe_intermediate=64, std=0.1)
    prompt = np.arange(5, 305) * 7 % 500  # 300 rows in one prefill chunk
    runs = []
    for pinned in (True, False):
        engine = Engine.from_dir(path, backend="cupy", placement="split",
                                 cpu_experts_per_layer=3, cpu_workers=1, max_slots=1,
                                 max_len=512)
        try:
            assert engine.placement.pool.max_rows < len(prompt)
            if not pinned:
                engine.placement.use_host_path()
            runs.append(engine.score(prompt))
        finally:
            engine.close()
    assert runs[0].tobytes() == runs[1].tobytes()


def _pool_and_layers(rng, num_workers=2, **kw):
    layers = {L: tuple((rng.standard_normal(s) * 0.08).astype(np.float32)
                       for s in ((E, I, H), (E, I, H), (E, H, I))) for L in (1, 3)}
    cores = sorted(os.sched_getaffinity(0))[:2 * num_workers]
    groups = [cores[2 * i:2 * i + 2] for i in range(num_workers)]
    return CpuExpertPool(layers, cores=groups, max_rows=16, spin_us=200, **kw)


def test_launched_layers_equal_host_dispatch():
    """launch()/gather() over many layers with no host wait between them (the workers rung
    by the GPU's store to SEQ_IN, waited for by a kernel): every layer's output is the host
    path's, bit for bit; a layer without CPU pairs returns its base untouched; the distinct
    expert counts are numpy's."""
    from gpu_worker.experts.pinned_ring import PinnedRing

    rng = np.random.default_rng(11)
    first = 4
    mask_h = np.arange(first + E) >= first
    mask = cupy.asarray(mask_h)
    with _pool_and_layers(rng) as pool:
        link = PinnedRing(pool, cupy)
        try:
            for session in range(2):
                cases, want_gpu, want_cpu = [], 0, 0
                for rows, k, layer in ((1, 1, 1), (5, 3, 3), (16, 4, 1), (3, 2, 3), (16, 8, 1),
                                       (4, 2, 3)):
                    x = rng.standard_normal((rows, H)).astype(np.float32)
                    ids = rng.integers(-1, E, (rows, k))
                    if len(cases) == 3:
                        ids[...] = -1  # every pair on the GPU: the workers are not rung
                    w = rng.random((rows, k)).astype(np.float32)
                    base = rng.standard_normal((rows, H)).astype(np.float32)
                    glob = np.where(ids >= 0, ids + first, rng.integers(0, first, ids.shape))
                    q, d = quantize(x)
                    host = pool.dispatch_quantized(layer, q, d, ids, w)
                    cases.append({"layer": layer, "q": q, "d": d, "glob": glob, "w": w,
                                  "base": base, "host": host, "ids": ids})
                    want_gpu += len(np.unique(glob[glob < first]))
                    want_cpu += len(np.unique(glob[glob >= first]))
                outs = []
                for c in cases:
                    dev = [cupy.asarray(c[n]) for n in ("q", "d", "glob", "w")]
                    link.launch(c["layer"], *dev, mask, first)
                    with pytest.raises(RuntimeError, match="gather"):
                        link.launch(c["layer"], *dev, mask, first)
                    outs.append(link.gather(base=cupy.asarray(c["base"])))
                c = cases[0]
                with pytest.raises(RuntimeError, match="GPU drives the ring"):
                    pool.dispatch_quantized(c["layer"], c["q"], c["d"], c["ids"], c["w"])
                link.end_step()
                for i, (c, got) in enumerate(zip(cases, outs, strict=True)):
                    cpu_pairs = (c["glob"] >= first).any()
                    want = c["base"] + c["host"] if cpu_pairs else c["base"]
                    assert got.get().tobytes() == want.tobytes(), (session, i)
                gpu, cpu, ms = link.take_distinct()
                assert (gpu, cpu) == (want_gpu, want_cpu)
                assert ms > 0
                assert link.take_distinct()[:2] == (0, 0)
        finally:
            link.close()


def test_launch_errors_surface_at_end_step():
    """A bad expert id: end_step raises CpuExpertError naming the layer, and the next step
    works. A stopped worker: the GPU's wait times out, CpuExpertError says so. A dead worker:
    the watchdog stops the wait at once and end_step raises CpuWorkerDied."""
    import signal
    import time

    from cpu_experts.errors import CpuWorkerDied
    from gpu_worker.experts.pinned_ring import PinnedRing

    rng = np.random.default_rng(12)
    with _pool_and_layers(rng) as pool:
        link = PinnedRing(pool, cupy, timeout_s=0.5)
        try:
            x = rng.standard_normal((3, H)).astype(np.float32)
            q, d = quantize(x)
            ids = rng.integers(0, E, (3, 2))
            w = rng.random((3, 2)).astype(np.float32)
            host = pool.dispatch_quantized(3, q, d, ids, w)
            args = (cupy.asarray(q), cupy.asarray(d))

            def step(layer, ids_):
                link.launch(layer, *args, cupy.asarray(ids_), cupy.asarray(w))
                out = link.gather()
                link.end_step()
                return out.get()

            with pytest.raises(CpuExpertError, match="layer 3: .*expert id"):
                step(3, np.full((3, 2), E))
            assert step(3, ids).tobytes() == host.tobytes()
            os.kill(pool.pids[1], signal.SIGSTOP)
            try:
                with pytest.raises(CpuExpertError, match="layer 1: .*no answer within 0.5 s"):
                    step(1, ids)
            finally:
                os.kill(pool.pids[1], signal.SIGCONT)
            assert step(3, ids).tobytes() == host.tobytes()
            victim = pool.pids[0]
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(CpuWorkerDied, match=f"pid {victim}"):
                step(3, ids)
            assert time.monotonic() - t0 < 0.45  # the watchdog, not the 0.5 s timeout
        finally:
            link.close()
