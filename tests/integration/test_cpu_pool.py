"""CpuExpertPool through real worker processes, shared memory and doorbells."""

import glob
import os
import shutil
import signal
import time

import numpy as np
import pytest

from cpu_experts import reference, rings, shard
from cpu_experts.errors import CpuExpertError, CpuWorkerDied
from cpu_experts.formats import Blocks, pack_q4
from cpu_experts.pool import CpuExpertPool
from cpu_experts.quant import NonFiniteActivation, quantize, quantize_ref
from cpu_experts.quant4 import quantize4_ref

E, I, H = 5, 96, 128
CORES = sorted(os.sched_getaffinity(0))


def core_groups(n: int) -> list[list[int]]:
    return [CORES[i % len(CORES):i % len(CORES) + 1] for i in range(n)]


@pytest.fixture(scope="module")
def layers() -> dict[int, tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(7)
    out = {}
    for layer in (2, 5):
        out[layer] = ((rng.standard_normal((E, I, H)) * 0.08).astype(np.float32),
                      (rng.standard_normal((E, I, H)) * 0.08).astype(np.float32),
                      (rng.standard_normal((E, H, I)) * 0.08).astype(np.float32))
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["1worker", "2workers"])
def pool(request, layers):
    with CpuExpertPool(layers, num_workers=request.param, cores=core_groups(request.param),
                       max_rows=8, spin_us=200) as p:
        yield p


def expected(pool: CpuExpertPool, layer: int, x, ids, w) -> np.ndarray:
    ql = pool.layers[layer]
    xq, xs = quantize_ref(x)
    bounds = shard.shard_bounds(ql.intermediate, pool.num_workers)
    return reference.moe_reference([ql.shard(*b) for b in bounds], xq, xs, ids, w)


def routing(seed: int, rows: int, k: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, E, (rows, k))
    return rng.standard_normal((rows, H)), ids, rng.random((rows, k))


def test_dispatch_equals_reference_bitwise(pool) -> None:
    for layer in (2, 5):
        x, ids, w = routing(layer, 20)  # 20 rows > max_rows=8: three ring loads
        got = pool.dispatch(layer, x, ids, w)
        assert got.dtype == np.float32 and got.shape == (20, H)
        assert got.tobytes() == expected(pool, layer, x, ids, w).tobytes()


def test_rows_independent_of_batch(pool) -> None:
    x, ids, w = routing(11, 16)
    ids[:8, 0] = 3
    batch = pool.dispatch(5, x, ids, w)
    for r in range(16):
        alone = pool.dispatch(5, x[r:r + 1], ids[r:r + 1], w[r:r + 1])
        assert alone.tobytes() == batch[r:r + 1].tobytes(), f"row {r}"
    order = np.random.default_rng(0).permutation(16)
    for part in np.array_split(order, 3):
        assert pool.dispatch(5, x[part], ids[part], w[part]).tobytes() == batch[part].tobytes()


def test_quantized_dispatch_agrees(pool) -> None:
    x, ids, w = routing(3, 6)
    q, d = quantize(x)
    a = pool.dispatch(2, x, ids, w)
    assert pool.dispatch_quantized(2, q, d, ids, w).tobytes() == a.tobytes()
    assert pool.dispatch_quantized(2, q, d.view(np.uint16), ids, w).tobytes() == a.tobytes()


def test_bad_inputs_raise_and_pool_keeps_serving(pool) -> None:
    x, ids, w = routing(4, 4)
    with pytest.raises(ValueError, match="expert ids"):
        pool.dispatch(2, x, np.full_like(ids, E), w)
    with pytest.raises(KeyError):
        pool.dispatch(9, x, ids, w)
    bad = x.copy()
    bad[1, 3] = np.nan
    with pytest.raises(NonFiniteActivation):
        pool.dispatch(2, bad, ids, w)
    with pytest.raises(ValueError, match="rows"):
        pool.dispatch(2, x[:, :64], ids, w)
    with pytest.raises(ValueError, match="integers"):
        pool.dispatch(2, x, ids.astype(np.float32), w)
    # more rows than one load: a bad id in the last load is refused before the first load
    # runs, so ``out`` is not touched
    xl, idsl, wl = routing(11, pool.max_rows + 4)
    idsl[-1, 0] = -2
    out = np.full(xl.shape, 7.0, np.float32)
    for call in (lambda: pool.dispatch(2, xl, idsl, wl, out=out),
                 lambda: pool.dispatch_quantized(2, *quantize(xl), idsl, wl, out=out)):
        with pytest.raises(ValueError, match="expert ids"):
            call()
        assert (out == 7.0).all()
    assert pool.dispatch(2, x, ids, w).tobytes() == expected(pool, 2, x, ids, w).tobytes()


def test_worker_death_is_detected_and_close_cleans_up(layers) -> None:
    mine = f"/dev/shm/tandem-*-{os.getpid()}-*"  # other processes' pools may come and go
    before = set(glob.glob(mine))
    p = CpuExpertPool(layers, num_workers=2, cores=core_groups(2))
    assert set(glob.glob(mine)) == before  # names unlinked once workers are up
    x, ids, w = routing(8, 3)
    p.dispatch(2, x, ids, w)
    p.check_alive()
    victim = p.pids[1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    with pytest.raises(CpuWorkerDied, match=f"worker 1 \\(pid {victim}\\)") as info:
        while time.monotonic() < deadline:
            p.check_alive()
            time.sleep(0.01)
    assert info.value.index == 1
    with pytest.raises(CpuWorkerDied):
        p.dispatch(2, x, ids, w)  # the survivor answers, the dead one never does
    pids = p.pids
    p.close()
    p.close()  # idempotent
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_instruction_set_option(layers) -> None:
    """A pool forced onto the portable kernels reports it and gives the same bits; an unknown
    or unavailable instruction set is refused before any process starts."""
    from cpu_experts import isa as cpu_isa

    x, ids, w = routing(11, 6)
    with CpuExpertPool(layers, num_workers=1, cores=core_groups(1), isa="portable",
                       prefetch_bytes=0) as p:
        assert p.ready_info[0]["isa"] == "portable" and p.ready_info[0]["prefetch_bytes"] == 0
        got = p.dispatch(5, x, ids, w)
        assert got.tobytes() == expected(p, 5, x, ids, w).tobytes()
    with pytest.raises(ValueError, match="expected one of"):
        CpuExpertPool(layers, num_workers=1, isa="sse9")
    with pytest.raises(ValueError, match="prefetch_bytes"):
        CpuExpertPool(layers, num_workers=1, prefetch_bytes=-1)
    for name in (n for i, n in cpu_isa.NAMES.items() if i not in cpu_isa.available()):
        with pytest.raises(ValueError, match="cannot run"):
            CpuExpertPool(layers, num_workers=1, isa=name)


def test_out_buffer(pool) -> None:
    """``out=`` is written and returned (rows split over ring loads too); a wrong buffer is
    refused before anything is sent, and the pool keeps serving."""
    x, ids, w = routing(12, 20)
    buf = np.full((20, H), np.nan, np.float32)
    got = pool.dispatch(2, x, ids, w, out=buf)
    assert got is buf and buf.tobytes() == expected(pool, 2, x, ids, w).tobytes()
    q, d = quantize(np.asarray(x, np.float32))
    got = pool.dispatch_quantized(5, q, d, ids, w, out=buf)
    assert got is buf and buf.tobytes() == expected(pool, 5, x, ids, w).tobytes()
    for bad in (np.empty((20, H), np.float64), np.empty((19, H), np.float32),
                np.empty((H, 20), np.float32).T):
        with pytest.raises(ValueError, match="out must be"):
            pool.dispatch(2, x, ids, w, out=bad)
    assert pool.dispatch(2, x, ids, w).tobytes() == expected(pool, 2, x, ids, w).tobytes()


def test_split_dispatch_through_ring_views(pool) -> None:
    """inputs() / start() / finish(): the path a GPU takes when it writes the ring by DMA.
    The partials' sum equals dispatch(); misuse and a bad expert id raise typed errors and the
    pool keeps serving."""
    x, ids, w = routing(13, 6)
    q, d = quantize(np.asarray(x, np.float32))
    xq, xd, ids_v, w_v = pool.inputs(6, 3)
    assert ids_v.shape == w_v.shape == (6, 3) and all(
        a.flags.c_contiguous for a in (xq, xd, ids_v, w_v))
    xq[...], xd[...], ids_v[...], w_v[...] = q, d.view(np.uint16), ids, w
    pool.start(5, 6, 3)
    with pytest.raises(RuntimeError, match="in flight"):
        pool.start(5, 6, 3)
    with pytest.raises(RuntimeError, match="in flight"):
        pool.dispatch(5, x, ids, w)
    parts = pool.finish()
    assert parts.shape == (pool.num_workers, 6, H)
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    assert total.tobytes() == expected(pool, 5, x, ids, w).tobytes()
    with pytest.raises(RuntimeError, match="no dispatch"):
        pool.finish()
    with pytest.raises(ValueError, match="rows"):
        pool.inputs(pool.max_rows + 1, 3)
    with pytest.raises(KeyError):
        pool.start(9, 6, 3)
    _, _, ids_v, _ = pool.inputs(6, 3)
    ids_v[2, 1] = E  # out of range: the workers refuse it
    pool.start(5, 6, 3)
    with pytest.raises(CpuExpertError, match="expert id"):
        pool.finish()
    addr, nbytes = pool.ring_region()
    ring = pool.ring
    for region in (ring.ctrl, ring.header, ring.xq, ring.xd, ring.ids, ring.w, ring.out):
        assert addr <= region.ctypes.data and region.ctypes.data + region.nbytes <= addr + nbytes
    assert pool.dispatch(5, x, ids, w).tobytes() == expected(pool, 5, x, ids, w).tobytes()


def _ring_like_a_gpu(pool: CpuExpertPool, layer: int, x, ids, w) -> int:
    """What the pinned ring's kernels do: write the inputs and header into the ring, then store a
    new SEQ_IN for every worker, with no eventfd. Returns the sequence number."""
    ring = pool.ring
    rows, k = ids.shape
    q, d = quantize(np.asarray(x, np.float32))
    ring.xq[:rows], ring.xd[:rows] = q, d.view(np.uint16)
    ids_v, w_v = ring.pairs(rows, k)
    ids_v[...], w_v[...] = ids, w
    ring.header[:4] = (rings.CMD_RUN, layer, rows, k)
    seq = pool.next_seq()
    ring.ctrl[:, rings.SEQ_IN] = seq
    return seq


def _served(pool: CpuExpertPool, seq: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (pool.ring.ctrl[:, rings.SEQ_OUT] == seq).all():
            return True
        time.sleep(0.0005)
    return False


def test_device_session_workers_answer_a_store_to_seq_in(pool) -> None:
    """device_begin(): sleeping workers wake and spin, so a store to SEQ_IN in the ring (a
    GPU kernel's, emulated here) starts them without a doorbell; the partials' sum equals
    dispatch(). Host dispatches are refused during the session and work again after it.
    (Without the session a sleeping worker would still see the store, at its next 200 ms
    poll timeout: the session is for speed, the benchmark shows it.)"""
    x, ids, w = routing(21, 7)
    want = expected(pool, 2, x, ids, w)
    time.sleep(0.05)  # spin_us=200: every worker now sleeps on its eventfd
    before = pool.kernel_total_ns()
    pool.device_begin()
    pool.device_begin()  # idempotent
    try:
        with pytest.raises(RuntimeError, match="GPU drives the ring"):
            pool.dispatch(2, x, ids, w)
        with pytest.raises(RuntimeError, match="GPU drives the ring"):
            pool.inputs(7, 3)
        for _ in range(3):
            time.sleep(0.05)  # far past spin_us: they spin because of the session
            seq = _ring_like_a_gpu(pool, 2, x, ids, w)
            assert _served(pool, seq, 10.0)
            assert (pool.ring.ctrl[:, rings.STATUS] == 0).all()
            parts = pool.ring.out[:, :7]
            total = parts[0].copy()
            for part in parts[1:]:
                total += part
            assert total.tobytes() == want.tobytes()
        assert not pool.aborted
    finally:
        pool.device_end()
    assert (pool.kernel_total_ns() > before).all()
    with pytest.raises(RuntimeError, match="no device session"):
        pool.next_seq()
    assert pool.dispatch(2, x, ids, w).tobytes() == want.tobytes()


def test_device_session_watchdog_flags_a_dead_worker(layers) -> None:
    with CpuExpertPool(layers, num_workers=2, cores=core_groups(2), spin_us=200) as p:
        p.device_begin()
        assert not p.aborted
        os.kill(p.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not p.aborted and time.monotonic() < deadline:
            time.sleep(0.005)
        assert p.aborted  # a kernel waiting on SEQ_OUT reads this and gives up
        p.device_end()
        with pytest.raises(CpuWorkerDied):
            p.check_alive()


# ---- streaming: shards made at their final size, filled a run of experts at a time --------
def test_layers_read_back_what_the_workers_hold(pool, layers) -> None:
    """pool.layers untiles the shards (expected() above relies on it): it must equal the
    canonical quantizer's output of the float weights, independently."""
    for layer, stacks in layers.items():
        want = shard.quantize_layer(*stacks)
        got = pool.layers[layer].canonical()
        for name in ("gate_q", "gate_s", "up_q", "up_s", "down_q", "down_s"):
            assert getattr(got, name).tobytes() == getattr(want, name).tobytes(), name
        assert pool.layers[layer].up_s.tobytes() == want.up_s.tobytes()


def test_streamed_pool_equals_the_pool_from_floats(layers) -> None:
    """LayerShapes, then fill() in runs of two experts (any order), then launch(): the same
    shards and the same bits as a pool made from the whole float stacks."""
    mine = f"/dev/shm/tandem-*-{os.getpid()}-*"
    before = set(glob.glob(mine))
    p = CpuExpertPool({k: shard.LayerShape(E, I, H) for k in layers}, num_workers=2,
                      cores=core_groups(2), max_rows=8, spin_us=200)
    try:
        assert p.pids == [] and p.shard_bytes > 0
        for layer, (gate, up, down) in layers.items():
            for first in (4, 2, 0):
                p.fill(layer, first, gate[first:first + 2], up[first:first + 2],
                       down[first:first + 2])
        p.launch()
        assert set(glob.glob(mine)) == before  # names unlinked once workers are up
        for layer, stacks in layers.items():
            assert p.layers[layer].gate_q.tobytes() == shard.quantize_layer(*stacks).gate_q \
                .tobytes()
            x, ids, w = routing(layer, 11)
            assert p.dispatch(layer, x, ids, w).tobytes() == \
                expected(p, layer, x, ids, w).tobytes()
        with pytest.raises(RuntimeError, match="before launch"):
            p.fill(2, 0, *(s[:1] for s in layers[2]))
    finally:
        p.close()


def test_fill_mistakes_are_named_and_nothing_leaks(layers, monkeypatch) -> None:
    mine = f"/dev/shm/tandem-*-{os.getpid()}-*"
    before = set(glob.glob(mine))
    shapes = {k: shard.LayerShape(E, I, H) for k in layers}
    with CpuExpertPool(shapes, num_workers=1, cores=core_groups(1)) as p:
        gate, up, down = layers[2]
        with pytest.raises(ValueError, match="do not fit"):
            p.fill(2, 4, gate[:2], up[:2], down[:2])  # experts 4..6 of 5
        with pytest.raises(KeyError, match="layer 3"):
            p.fill(3, 0, gate, up, down)
        p.fill(2, 0, gate, up, down)
        p.fill(5, 0, *(s[:3] for s in layers[5]))
        with pytest.raises(ValueError, match="layer 5: expert 3 was never written"):
            p.launch()
    assert set(glob.glob(mine)) == before
    with pytest.raises(ValueError, match="every layer's weights, or only"):
        CpuExpertPool({2: layers[2], 5: shapes[5]}, num_workers=1)
    monkeypatch.setattr("cpu_experts.processes.shutil.disk_usage",
                        lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    with pytest.raises(MemoryError, match="GiB of shared memory"):
        CpuExpertPool(shapes, num_workers=1)
    assert set(glob.glob(mine)) == before


# ---- weight formats: int4, and blocks quantized elsewhere (a GGUF's Q8_0 / Q4_0) ----------
def test_int4_pool_takes_floats_and_q4_0_blocks_and_equals_reference(layers) -> None:
    """An int4 pool filled from floats (experts 0-2) and from Q4_0 blocks (3-4, -8 and
    negative scales included): the workers hold exactly those values and compute the
    reference's bits, through 2 workers; an int8 pool holds Q8_0 blocks byte for byte."""
    rng = np.random.default_rng(11)
    gate, up, down = layers[2]
    v = [rng.integers(-8, 8, (2, *a.shape[1:])).astype(np.int8) for a in (gate, up, down)]
    s = [(rng.standard_normal((*x.shape[:2], x.shape[2] // 32)) * 0.01).astype(np.float16)
         for x in v]
    with CpuExpertPool({2: shard.LayerShape(E, I, H)}, num_workers=2, cores=core_groups(2),
                       max_rows=8, spin_us=200, weight_format="int4") as p:
        assert p.weight_format == "int4"
        p.fill(2, 0, gate[:3], up[:3], down[:3])
        p.fill(2, 3, *(Blocks("q4_0", pack_q4(a), b) for a, b in zip(v, s, strict=True)))
        p.launch()
        assert all(info["weight_format"] == "int4" for info in p.ready_info)
        held = p.layers[2].canonical()
        assert held.gate_q[3:].tobytes() == v[0].tobytes()
        assert held.down_s[3:].tobytes() == s[2].tobytes()
        assert held.up_q[:3].tobytes() == quantize4_ref(up[:3])[0].tobytes()
        x, ids, w = routing(21, 12)
        assert p.dispatch(2, x, ids, w).tobytes() == expected(p, 2, x, ids, w).tobytes()
    q8 = [quantize_ref(a)[0] for a in (gate, up, down)]
    d8 = [quantize_ref(a)[1] for a in (gate, up, down)]
    with CpuExpertPool({2: shard.LayerShape(E, I, H)}, num_workers=1, cores=core_groups(1),
                       max_rows=8, spin_us=200) as p:
        p.fill(2, 0, *(Blocks("q8_0", a, b) for a, b in zip(q8, d8, strict=True)))
        p.launch()
        held = p.layers[2].canonical()
        assert held.gate_q.tobytes() == q8[0].tobytes()
        assert held.down_s.tobytes() == d8[2].tobytes()
    with pytest.raises(ValueError, match="format"):
        CpuExpertPool({2: shard.LayerShape(E, I, H)}, weight_format="int3")
