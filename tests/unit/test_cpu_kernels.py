"""Numba expert kernels against the slow NumPy reference of the same int8 math: bit for bit,
for every instruction set of the micro-kernels (tiles.py) that this CPU can run; the others
are skipped here (the AVX-512 VNNI one runs on the GPU machine, see docs/cpu_experts.md)."""

import numpy as np
import pytest
from numba import njit

from cpu_experts import act, activations, kernels, reference, shard
from cpu_experts import isa as cpu_isa
from cpu_experts.quant import quantize, quantize_ref

E, I, H = 6, 128, 256
BEST = cpu_isa.select()


def isa_param(which: int):
    runs = which in cpu_isa.available()
    return pytest.param(which, id=cpu_isa.NAMES[which], marks=pytest.mark.skipif(
        not runs, reason=f"this CPU cannot run {cpu_isa.NAMES[which]}"))


ALL_ISAS = [isa_param(i) for i in cpu_isa.NAMES]


@pytest.fixture(scope="module")
def layer() -> tuple[tuple[np.ndarray, ...], shard.QuantizedLayer]:
    rng = np.random.default_rng(1)
    gate = (rng.standard_normal((E, I, H)) * 0.06).astype(np.float32)
    up = (rng.standard_normal((E, I, H)) * 0.06).astype(np.float32)
    down = (rng.standard_normal((E, H, I)) * 0.06).astype(np.float32)
    return (gate, up, down), shard.quantize_layer(gate, up, down)


def run_shards(ql: shard.QuantizedLayer, num_shards: int, xq, xs, ids, w,
               isa: int = BEST) -> np.ndarray:
    """What a pool of ``num_shards`` workers computes: each shard's kernel, partials summed."""
    kernel = kernels.layer_kernel(isa)
    total = None
    for lo_hi in shard.shard_bounds(ql.intermediate, num_shards):
        bounds = {0: lo_hi}
        manifest, size = shard.plan_shard({0: ql}, bounds)
        buf = bytearray(size)
        shard.write_shard(buf, manifest, {0: ql}, bounds)
        out = np.full(xq.shape, np.nan, np.float32)  # poisoned: every row must be written
        rc = kernel(*shard.views(buf, manifest)[0], xq, xs.view(np.uint16),
                    ids.astype(np.int32), w.astype(np.float32), out, kernels.PREFETCH_AHEAD)
        assert rc == kernels.ERR_OK
        total = out if total is None else total + out
    return total


def routing(rng: np.random.Generator, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(-1, E, (rows, k))
    ids[0, :2] = [2, 2]   # the same expert twice in one row
    ids[1, :] = -1        # a row with nothing on the CPU
    return ids, rng.random((rows, k)).astype(np.float32)


def test_silu_mul_block_matches_numpy_bitwise() -> None:
    """The kernels' vectorised SiLU * up equals reference.silu_mul bit for bit, across exp64's
    whole range, its clamp edges, signed zeros, tiny values and infinities."""
    edges = [-708.0, -707.9, 709.0, 709.1, 708.0, -709.0, 708.5, -708.5, 0.0, -0.0, 1e-30,
             -1e-30, 1e-40, np.inf, -np.inf, 88.7, -88.7, 1e4, -1e4]
    rng = np.random.default_rng(0)
    g = np.concatenate([np.linspace(-750, 750, 20001), edges, rng.standard_normal(5000) * 30,
                        rng.standard_normal(5000) * 3]).astype(np.float32)
    g = g[:len(g) // 32 * 32]
    u = rng.standard_normal(g.shape).astype(np.float32)
    with np.errstate(all="ignore"):
        want = reference.silu_mul(g, u)
    got = np.empty_like(g)
    h = np.empty(64, np.float32)
    for o in range(0, g.size, 32):
        act.silu_mul_block(g, u, o, h, 32)  # the output at an offset
        got[o:o + 32] = h[32:]
    assert got.tobytes() == want.tobytes()
    inside = np.abs(g) < 700
    g64 = g[inside].astype(np.float64)
    assert np.allclose(want[inside], g64 / (1 + np.exp(-g64)) * u[inside], rtol=1e-6, atol=1e-30)


@njit
def _quantize_h_all(h, mask):
    n = h.size // 32
    q = np.empty(h.size, np.int8)
    scales, sums, fine = np.empty(n), np.empty(n, np.int64), np.empty(n, np.bool_)
    hbits = h.view(np.int32)
    for b in range(n):
        scales[b], sums[b], fine[b] = act.quantize_h(h, hbits, 32 * b, q, 32 * b, mask)
    return q, scales, sums, fine


def test_quantize_h_equals_rule() -> None:
    """The vector quantizer of h gives quant.py's rule byte for byte: ties of x / scale at
    .5 (to even), the clamp at +-127, scales that round to 0 (every q 0), subnormal and huge
    values, signed zeros; and it reports inf and nan."""
    rng = np.random.default_rng(11)
    blocks = [rng.standard_normal(32) * 10 ** rng.uniform(-30, 30) for _ in range(400)]
    ties = np.arange(-16, 16) + 0.5
    blocks += [ties * 2.0 ** -4, ties, np.r_[127.0, -127.0, 126.5, -126.5, 0.5, -0.5, np.zeros(26)],
               np.full(32, 1e-39), np.full(32, -3e-45), np.zeros(32), np.r_[-0.0, np.zeros(31)],
               np.full(32, 3e38), np.r_[65504.0 * 127, -1e38, np.ones(30)],
               rng.standard_normal(32) * 2.0 ** -26]
    h = np.concatenate(blocks).astype(np.float32)
    want_q, want_d = quantize_ref(h)
    for mask in (0, -128):
        q, scales, sums, fine = _quantize_h_all(h, np.int8(mask))
        assert fine.all()
        assert q.tobytes() == (want_q ^ np.int8(mask)).tobytes()
        assert scales.astype(np.float32).tobytes() == want_d.astype(np.float32).tobytes()
        assert (sums == want_q.astype(np.int64).reshape(-1, 32).sum(1)).all()
    for bad in (np.inf, -np.inf, np.nan):
        x = np.ones(32, np.float32)
        x[17] = bad
        assert not _quantize_h_all(x, np.int8(0))[3][0]


@pytest.mark.parametrize("pairs", [1, 3])
def test_act_blocks_equal_reference(pairs: int) -> None:
    """act.act_block over every block gives reference.py's re-quantized h, flipped for VNNI,
    and reports a non-finite h."""
    rng = np.random.default_rng(7)
    g = (rng.standard_normal((pairs, 512)) * 4).astype(np.float32)
    u = rng.standard_normal((pairs, 512)).astype(np.float32)
    hk, hs = np.empty((pairs, 512), np.int8), np.empty((pairs, 16), np.float32)
    hc = np.empty((pairs, 16), np.int32)
    want_q, want_d = quantize_ref(reference.silu_mul(g, u))
    assert act.act_rows(g, u, False, hk, hs, hc)
    assert hk.tobytes() == want_q.tobytes()
    assert hs.tobytes() == want_d.astype(np.float32).tobytes()
    # the int4 kernels' offset correction: -8 * each block's sum of q
    assert (hc == -8 * want_q.astype(np.int32).reshape(pairs, 16, 32).sum(-1)).all()
    assert act.act_rows(g, u, True, hk, hs, hc)
    assert hk.tobytes() == (want_q ^ np.int8(-128)).tobytes()
    g[-1, 100] = np.inf  # silu(inf) * u = +-inf
    assert not act.act_rows(g, u, True, hk, hs, hc)


def test_f16_value_all_finite_halves() -> None:
    bits = np.arange(0x10000, dtype=np.uint16)
    halves = bits.view(np.float16)
    finite = np.isfinite(halves)
    got = np.array([activations.f16_value(b) for b in bits[finite]], np.float32)
    assert got.tobytes() == halves[finite].astype(np.float32).tobytes()


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("num_shards", [1, 2])
def test_kernel_equals_reference_bitwise(layer, num_shards: int, isa: int) -> None:
    _, ql = layer
    rng = np.random.default_rng(num_shards)
    x = rng.standard_normal((16, H)).astype(np.float32)
    ids, w = routing(rng, 16, 4)
    xq, xs = quantize(x)
    got = run_shards(ql, num_shards, xq, xs, ids, w, isa)
    bounds = shard.shard_bounds(I, num_shards)
    want = reference.moe_reference([ql.shard(*b) for b in bounds], xq, xs, ids, w)
    assert got.tobytes() == want.tobytes()
    assert not got[1].any() and np.abs(got).max() > 0


@pytest.mark.parametrize("num_shards", [1, 2])
def test_rows_independent_of_batch(layer, num_shards: int) -> None:
    _, ql = layer
    rng = np.random.default_rng(10 + num_shards)
    x = rng.standard_normal((16, H)).astype(np.float32)
    ids, w = routing(rng, 16, 3)
    ids[4:8] = 5               # 4 rows share one expert
    ids[8:, 0] = np.arange(8) % E  # one row per expert in column 0
    xq, xs = quantize(x)
    batch = run_shards(ql, num_shards, xq, xs, ids, w)
    for r in range(16):  # alone
        alone = run_shards(ql, num_shards, xq[r:r + 1], xs[r:r + 1], ids[r:r + 1], w[r:r + 1])
        assert alone.tobytes() == batch[r:r + 1].tobytes(), f"row {r}"
    for seed in range(3):  # random splits of the batch into sub-batches, rows reordered
        order = np.random.default_rng(seed).permutation(16)
        for part in np.array_split(order, seed + 2):
            sub = run_shards(ql, num_shards, xq[part], xs[part], ids[part], w[part])
            assert sub.tobytes() == batch[part].tobytes()


def test_extreme_values_equal_reference_bitwise() -> None:
    """Weights and activations at +-127 everywhere (the largest block dots, both signs), zero
    blocks and mixed signs: every instruction set equals the reference."""
    rng = np.random.default_rng(5)
    e, i, h = 2, 64, 128
    ql = shard.quantize_layer(*(rng.standard_normal(sz).astype(np.float32) * 0.03
                                for sz in ((e, i, h), (e, i, h), (e, h, i))))
    sign = np.where(rng.random((e, i, h)) < 0.5, -1, 1).astype(np.int8)
    gate_q = np.full((e, i, h), 127, np.int8)
    gate_q[1] = -127
    up_q = (127 * sign).astype(np.int8)
    up_q[:, :, :32] = 0
    ql = shard.QuantizedLayer(gate_q, ql.gate_s, up_q, ql.up_s, ql.down_q, ql.down_s)
    x = np.zeros((4, h), np.float32)
    x[0] = 1.0                                   # all +127 after quantization
    x[1] = -1.0                                  # all -127
    x[2] = np.where(np.arange(h) % 2, 1.0, -1.0)
    x[3, 32:] = rng.standard_normal(h - 32)      # a zero block, then random
    xq, xs = quantize(x)
    assert np.abs(xq).max() == 127
    ids, w = np.array([[0, 1], [1, 0], [0, -1], [1, 1]]), np.ones((4, 2), np.float32)
    want = reference.moe_reference([ql.shard(0, i)], xq, xs, ids, w)
    for which in cpu_isa.available():
        got = run_shards(ql, 1, xq, xs, ids, w, which)
        assert got.tobytes() == want.tobytes(), cpu_isa.NAMES[which]


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 21])
def test_row_counts_equal_reference_bitwise(rows: int, isa: int) -> None:
    """Any number of rows on one expert holding every row, and on a mix of experts: every
    split of an expert's rows into micro-kernel calls (kernels.ROWS, then 2, then 1)."""
    rng = np.random.default_rng(40 + rows)
    e, i, h = 3, 96, 320  # 6 micro-tiles of gate/up, 20 of down; odd block counts
    ql = shard.quantize_layer(*(rng.standard_normal(s).astype(np.float32) * 0.03
                                for s in ((e, i, h), (e, i, h), (e, h, i))))
    x = rng.standard_normal((rows, h)).astype(np.float32)
    xq, xs = quantize(x)
    for ids in (np.zeros((rows, 1), np.int64), rng.integers(-1, e, (rows, 3))):
        w = rng.random(ids.shape).astype(np.float32)
        got = run_shards(ql, 1, xq, xs, ids, w, isa)
        want = reference.moe_reference([ql.shard(0, i)], xq, xs, ids, w)
        assert got.tobytes() == want.tobytes()


def test_tile_layout() -> None:
    """Micro-tile t, block b holds w[16t + u, 32b + 4g + c] at byte (g * 16 + u) * 4 + c, then
    the 16 scales as float32 from byte 512."""
    rng = np.random.default_rng(6)
    E_, U, n = 2, 48, 96
    q = rng.integers(-127, 128, (E_, U, n)).astype(np.int8)
    s = rng.random((E_, U, n // 32)).astype(np.float16)
    out = np.empty(shard.tiled_shape(E_, 1, U, n), np.int8)
    assert out.shape == (E_, 1, U // 16, n // 32, 576)
    shard.tile_into(q, s, out[:, 0])
    for e, t, b, g, u, c in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 7, 15, 3), (1, 1, 2, 3, 9, 2)]:
        blk = out[e, 0, t, b]
        assert blk[(g * 16 + u) * 4 + c] == q[e, 16 * t + u, 32 * b + 4 * g + c]
        assert blk[512:].copy().view(np.float32)[u] == np.float32(s[e, 16 * t + u, b])
    q[0, 5, 7] = -128
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        shard.tile_into(q, s, out[:, 0])


def test_isa_selection(monkeypatch) -> None:
    assert cpu_isa.ISA_PORTABLE in cpu_isa.available()
    assert cpu_isa.select("portable") == cpu_isa.ISA_PORTABLE
    monkeypatch.setenv(cpu_isa.ENV, "portable")
    assert cpu_isa.select() == cpu_isa.ISA_PORTABLE
    with pytest.raises(ValueError, match="expected one of"):
        cpu_isa.select("sse9")
    missing = [n for i, n in cpu_isa.NAMES.items() if i not in cpu_isa.available()]
    for name in missing:
        with pytest.raises(ValueError, match="cannot run"):
            cpu_isa.select(name)


def test_amx_needs_the_tile_permission(monkeypatch) -> None:
    """AMX is offered only with the CPU's AMX features and the kernel's permission for the
    tile state, and chosen only by name (its tile configuration: tests/unit/test_cpu_amx.py)."""
    amx_cpu = {"avx512f", "avx512bw", "avx512vnni", "amx-tile", "amx-int8"}
    monkeypatch.setattr(cpu_isa, "host_features", lambda: amx_cpu)
    monkeypatch.setattr(cpu_isa, "amx_permitted", lambda: False)
    assert cpu_isa.available()[-1] == cpu_isa.ISA_AVX512VNNI
    monkeypatch.setattr(cpu_isa, "amx_permitted", lambda: True)
    assert cpu_isa.available()[-1] == cpu_isa.ISA_AMX
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert cpu_isa.select() == cpu_isa.ISA_AVX512VNNI  # amx only when named (slower so far)
    assert cpu_isa.select("amx") == cpu_isa.ISA_AMX


def test_close_to_unquantized_float_expert(layer) -> None:
    (gate, up, down), ql = layer
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, H)).astype(np.float32)
    ids = rng.integers(0, E, (8, 2))
    w = rng.random((8, 2)).astype(np.float32)
    xq, xs = quantize(x)
    got = run_shards(ql, 2, xq, xs, ids, w)
    want = np.zeros((8, H))
    for r in range(8):
        for k in range(2):
            e = ids[r, k]
            want[r] += w[r, k] * reference.expert_float(gate[e], up[e], down[e], x[r])
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"relative error vs float expert: {rel:.2e}")
    assert rel < 2e-2, rel  # int8 weights and activations (twice): about 1% relative error


def test_bad_expert_id_is_reported(layer) -> None:
    _, ql = layer
    manifest, size = shard.plan_shard({0: ql}, {0: (0, I)})
    buf = bytearray(size)
    shard.write_shard(buf, manifest, {0: ql}, {0: (0, I)})
    xq, xs = quantize(np.ones((2, H), np.float32))
    out = np.empty((2, H), np.float32)
    ids = np.array([[0], [E]], np.int32)
    rc = kernels.layer_kernel(BEST)(*shard.views(buf, manifest)[0], xq, xs.view(np.uint16), ids,
                                    np.ones((2, 1), np.float32), out, kernels.PREFETCH_AHEAD)
    assert rc == kernels.ERR_EXPERT_ID


def test_shard_bounds_whole_blocks() -> None:
    assert shard.shard_bounds(768, 2) == [(0, 384), (384, 768)]
    assert shard.shard_bounds(96, 2) == [(0, 64), (64, 96)]
    with pytest.raises(ValueError):
        shard.shard_bounds(64, 3)
