"""The int4 CPU expert format: its quantizer against the NumPy reference, the tile layout,
pre-quantized blocks (Q8_0 / Q4_0) taken exactly, and the int4 x int8 kernels against a
NumPy emulation of their float32 order (bit for bit, every instruction set this CPU runs),
against the float64 product of the dequantized operands (a tolerance), and across batch
layouts and shard counts."""

import numpy as np
import pytest

from cpu_experts import isa as cpu_isa
from cpu_experts import kernels, reference, shard
from cpu_experts.formats import Blocks, bytes_per_weight, pack_q4, unpack_q4
from cpu_experts.quant import quantize, quantize_ref
from cpu_experts.quant4 import quantize4, quantize4_ref, to_format

E, I, H = 5, 96, 160
ISAS = [pytest.param(i, id=cpu_isa.NAMES[i], marks=pytest.mark.skipif(
    i not in cpu_isa.available(), reason=f"this CPU cannot run {cpu_isa.NAMES[i]}"))
    for i in cpu_isa.NAMES]


def floats(rng, shape, scale=0.06) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(scope="module")
def layer() -> tuple[tuple[np.ndarray, ...], shard.QuantizedLayer]:
    rng = np.random.default_rng(2)
    f = (floats(rng, (E, I, H)), floats(rng, (E, I, H)), floats(rng, (E, H, I)))
    return f, shard.quantize_layer(*f, "int4")


def run(ql: shard.QuantizedLayer, shards: int, xq, xs, ids, w, isa: int | None = None):
    """What a pool of ``shards`` int4 workers computes (partials summed in shard order)."""
    kernel = kernels.layer_kernel(cpu_isa.select() if isa is None else isa)
    total = None
    for lo_hi in shard.shard_bounds(ql.intermediate, shards):
        manifest, size = shard.plan_shard({0: ql}, {0: lo_hi}, "int4")
        buf = bytearray(size)
        shard.write_shard(buf, manifest, {0: ql}, {0: lo_hi})
        views = shard.views(buf, manifest)[0]
        assert all(v.dtype == np.uint8 for v in views)
        out = np.full(xq.shape, np.nan, np.float32)
        rc = kernel(*views, xq, xs.view(np.uint16), ids.astype(np.int32),
                    w.astype(np.float32), out, kernels.PREFETCH_AHEAD)
        assert rc == kernels.ERR_OK
        total = out if total is None else total + out
    return total


def emulate(ql, shards: int, xq, xs, ids, w) -> np.ndarray:
    """reference.py's math (exact int32 block dots, then the kernels' float32 order) on the
    int4 values: the kernels must match it bit for bit."""
    bounds = shard.shard_bounds(ql.intermediate, shards)
    return reference.moe_reference([ql.shard(*b) for b in bounds], xq, xs, ids, w)


def test_quantizer_equals_reference_bytes() -> None:
    rng = np.random.default_rng(0)
    x = floats(rng, (7, 3, 256), 1.0)
    x[0, 0, :32] = 0.0                                      # a zero block
    x[0, 1, :32] = 1e-9                                     # scale rounds to 0
    x[0, 2, :32] = np.arange(32) - 15.5                     # ties at x / d = k + 0.5
    x[1, 0, :32] = 5e5                                      # scale clamps to 65504
    x[1, 1, 32:64] = np.arange(32) * 7 / 31                 # amax exactly 7: d = 1
    x[2] *= 1e-6                                            # subnormal scales
    q, d = quantize4(x)
    rq, rd = quantize4_ref(x)
    assert q.tobytes() == rq.tobytes() and d.tobytes() == rd.tobytes()
    assert q.min() >= -7 and q.max() <= 7 and q.dtype == np.int8
    assert not q[0, :2, :32].any() and not d[0, :2, 0].astype(np.float32).any()
    assert d[1, 0, 0] == np.float16(65504)
    # the rule, independently: d16 = fp16(amax / 7); q = rint(x / d16), ties to even
    blocks = x[0, 2, :32]
    d16 = np.float16(np.float32(np.abs(blocks).max()) / np.float32(7))
    assert d[0, 2, 0] == d16
    assert (q[0, 2, :32] == np.clip(np.rint(blocks / np.float32(d16)), -7, 7)).all()
    # within half a step, plus the clamp at 7 when fp16 rounded d down (d16 >= d (1 - 2**-11))
    d32 = d.astype(np.float32)
    ok = (d32 >= 2.0**-14) & (d32 < 65504)  # normal halves, not clamped
    err = np.abs(q.reshape(7, 3, 8, 32) * d32[..., None] - x.reshape(7, 3, 8, 32))
    assert (err <= d32[..., None] * 0.51)[ok].all() and ok.sum() > 100


def test_pack_and_tile_layouts() -> None:
    rng = np.random.default_rng(1)
    v = rng.integers(-8, 8, (2, 48, 96)).astype(np.int8)
    s = (rng.standard_normal((2, 48, 3)) * 0.01).astype(np.float16)  # signed, like Q4_0's d
    p = pack_q4(v)
    assert p.shape == (2, 48, 48) and (unpack_q4(p) == v).all()
    assert p[1, 7, 16 + 3] == (int(v[1, 7, 32 + 3]) + 8) | ((int(v[1, 7, 48 + 3]) + 8) << 4)
    out = np.empty(shard.tiled_shape(2, 1, 48, 96, "int4"), np.uint8)
    assert out.shape == (2, 1, 3, 3, 288)
    shard.tile_into(v, s, out[:, 0])
    for e, t, b, j, u, c in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 3, 15, 3), (1, 1, 2, 2, 9, 1)]:
        byte = out[e, 0, t, b][(j * 16 + u) * 4 + c]
        assert byte & 15 == int(v[e, 16 * t + u, 32 * b + 4 * j + c]) + 8
        assert byte >> 4 == int(v[e, 16 * t + u, 32 * b + 16 + 4 * j + c]) + 8
        assert out[e, 0, t, b][256:].copy().view(np.float16)[u] == s[e, 16 * t + u, b]
    q2, s2 = shard.untile(out[:, 0])
    assert (q2 == v).all() and s2.tobytes() == s.tobytes()
    assert bytes_per_weight("int4") == 0.5625 and bytes_per_weight("int8") == 1.125
    v[0, 0, 0] = -9
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        shard.tile_into(v, s, out[:, 0])


def test_blocks_are_taken_exactly() -> None:
    """Q8_0 into int8 and Q4_0 into either format: the blocks' own values and scales; Q8_0
    into int4: the int4 rule applied to the dequantized values."""
    rng = np.random.default_rng(3)
    q8, s = quantize(floats(rng, (2, 32, 64)))
    v4 = rng.integers(-8, 8, (2, 32, 64)).astype(np.int8)
    q8_0, q4_0 = Blocks("q8_0", q8, s), Blocks("q4_0", pack_q4(v4), s.view(np.uint16))
    for got, want in [(to_format(q8_0, "int8"), q8), (to_format(q4_0, "int4"), v4),
                      (to_format(q4_0, "int8"), v4)]:
        assert got[0].tobytes() == want.tobytes() and got[1].tobytes() == s.tobytes()
    deq = q8.astype(np.float32) * np.repeat(s.astype(np.float32), 32, axis=-1)
    got = to_format(q8_0, "int4")
    want = quantize4_ref(deq)
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()
    with pytest.raises(ValueError, match="finite"):
        Blocks("q8_0", q8, np.full(s.shape, np.inf, np.float16))
    with pytest.raises(ValueError, match="uint8"):
        Blocks("q4_0", v4, s)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shards", [1, 2])
def test_kernel_equals_emulation_bitwise(layer, shards: int, isa: int) -> None:
    _, ql = layer
    rng = np.random.default_rng(shards)
    xq, xs = quantize(floats(rng, (16, H), 1.0))
    ids = rng.integers(-1, E, (16, 4))
    ids[0, :2] = 2                      # one expert twice in a row
    ids[1] = -1                         # nothing on the CPU
    w = rng.random(ids.shape).astype(np.float32)
    got = run(ql, shards, xq, xs, ids, w, isa)
    assert got.tobytes() == emulate(ql, shards, xq, xs, ids, w).tobytes()
    assert not got[1].any() and np.abs(got).max() > 0


@pytest.mark.parametrize("isa", ISAS)
def test_q4_0_extremes_equal_emulation_bitwise(isa: int) -> None:
    """Q4_0's full range (-8 included), negative and subnormal scales, activations at +-127
    and a zero block: the largest block dots of both signs."""
    rng = np.random.default_rng(5)
    e, i, h = 2, 64, 128
    vals = [rng.integers(-8, 8, s).astype(np.int8) for s in ((e, i, h), (e, i, h), (e, h, i))]
    vals[0][0], vals[0][1] = -8, 7
    scl = [(rng.standard_normal((*v.shape[:2], v.shape[2] // 32)) * 0.02).astype(np.float16)
           for v in vals]
    scl[1][0, :4] = np.float16(3e-6)                        # subnormal halves
    ql = shard.QuantizedLayer(vals[0], scl[0], vals[1], scl[1], vals[2], scl[2])
    x = np.zeros((4, h), np.float32)
    x[0], x[1] = 1.0, -1.0
    x[2] = np.where(np.arange(h) % 2, 1.0, -1.0)
    x[3, 32:] = rng.standard_normal(h - 32)
    xq, xs = quantize(x)
    ids, w = np.array([[0, 1], [1, 0], [0, -1], [1, 1]]), np.ones((4, 2), np.float32)
    got = run(ql, 1, xq, xs, ids, w, isa)
    assert got.tobytes() == emulate(ql, 1, xq, xs, ids, w).tobytes()


@pytest.mark.parametrize("shards", [1, 3])
def test_rows_independent_of_batch(layer, shards: int) -> None:
    """A row's bits alone, in a 16-row batch, and in random sub-batches with other expert
    groupings are the same; every ISA gives them too."""
    _, ql = layer
    rng = np.random.default_rng(20 + shards)
    xq, xs = quantize(floats(rng, (16, H), 1.0))
    ids = rng.integers(-1, E, (16, 3))
    ids[4:12, 0] = 3                    # 8 rows share an expert
    w = rng.random(ids.shape).astype(np.float32)
    batch = run(ql, shards, xq, xs, ids, w)
    for r in range(16):
        alone = run(ql, shards, xq[r:r + 1], xs[r:r + 1], ids[r:r + 1], w[r:r + 1])
        assert alone.tobytes() == batch[r:r + 1].tobytes(), f"row {r}"
    for seed in range(2):
        order = np.random.default_rng(seed).permutation(16)
        for part in np.array_split(order, seed + 2):
            assert run(ql, shards, xq[part], xs[part], ids[part], w[part]).tobytes() == \
                batch[part].tobytes()
    for which in cpu_isa.available():
        assert run(ql, shards, xq, xs, ids, w, which).tobytes() == batch.tobytes()


def test_close_to_float64_of_the_dequantized_operands(layer) -> None:
    """Against float64 math on the dequantized int4 weights and int8 activations (h kept in
    float64, no re-quantization): only h's int8 rounding and float32 sums remain."""
    _, ql = layer
    rng = np.random.default_rng(9)
    xq, xs = quantize(floats(rng, (6, H), 1.0))
    ids = rng.integers(0, E, (6, 2))
    w = rng.random(ids.shape).astype(np.float32)
    got = run(ql, 2, xq, xs, ids, w)

    def deq(q, s):
        return q.astype(np.float64) * np.repeat(s.astype(np.float64), 32, axis=-1)

    x = deq(xq, xs)
    want = np.zeros((6, H))
    for r in range(6):
        for k in range(2):
            e = ids[r, k]
            want[r] += w[r, k] * reference.expert_float(
                deq(ql.gate_q[e], ql.gate_s[e]), deq(ql.up_q[e], ql.up_s[e]),
                deq(ql.down_q[e], ql.down_s[e]), x[r])
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, rel  # h's int8 rounding: ~0.5%


def test_int4_error_against_the_float_expert(layer) -> None:
    """The format's own cost: int4 weights against the unquantized float expert."""
    (gate, up, down), ql = layer
    rng = np.random.default_rng(4)
    x = floats(rng, (6, H), 1.0)
    xq, xs = quantize_ref(x)
    ids = rng.integers(0, E, (6, 2))
    w = rng.random(ids.shape).astype(np.float32)
    got = run(ql, 1, xq, xs, ids, w)
    want = np.zeros((6, H))
    for r in range(6):
        for k in range(2):
            e = ids[r, k]
            want[r] += w[r, k] * reference.expert_float(gate[e], up[e], down[e], x[r])
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0.03 < rel < 0.2, rel  # 4-bit weights: ~10% (int8: ~1%, test_cpu_kernels.py)


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_gguf_blocks_split_as_docs_say_equal_the_gguf_reference(kind: str) -> None:
    """A GGUF tensor's raw Q4_0 / Q8_0 blocks, split into Blocks as docs/cpu_experts.md says,
    hold the values the gguf package dequantizes, bit for bit."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    t, size = {"q4_0": (gguf.GGMLQuantizationType.Q4_0, 18),
               "q8_0": (gguf.GGMLQuantizationType.Q8_0, 34)}[kind]
    x = floats(np.random.default_rng(8), (2, 16, 64), 1.0)
    raw = gguf_quantize(x, t).reshape(2, 16, 2, size)
    q = raw[..., 2:].reshape(2, 16, -1)
    blocks = Blocks(kind, q.view(np.int8) if kind == "q8_0" else q,
                    raw[..., :2].view(np.float16)[..., 0])
    v, s = to_format(blocks, "int8")
    deq = v.astype(np.float32) * np.repeat(s.astype(np.float32), 32, axis=-1)
    assert deq.tobytes() == dequantize(gguf_quantize(x, t), t).reshape(x.shape).tobytes()


def test_memory_plan_counts_cpu_bytes_by_format(tmp_path) -> None:
    """[experts] cpu_format = "int4": the plan's CPU experts take half the int8 bytes per
    weight (0.5625 against 1.125), and a worker config refuses an unknown format."""
    from gpu_worker.memory_plan import plan_memory
    from gpu_worker.model_config import ModelConfig
    from protocol.worker_config import WorkerConfig
    from scripts.tiny_model import make_tiny_model

    config = ModelConfig.from_file(make_tiny_model(tmp_path, "qwen3_moe", seed=1,
                                                   tokenizer=False) / "config.json")
    plans = {f: plan_memory(config, backend="numpy", placement="cpu", cpu_format=f,
                            host_available_bytes=None) for f in ("int8", "int4")}
    weights = 3 * config.moe_intermediate_size * config.hidden_size
    assert plans["int4"].cpu_bytes_per_expert == weights * 0.5625
    assert plans["int8"].cpu_bytes_per_expert == weights * 1.125
    assert plans["int4"].cpu_expert_bytes < 0.51 * plans["int8"].cpu_expert_bytes
    with pytest.raises(ValueError, match="cpu_format"):
        WorkerConfig(run_dir="/tmp/r", model="/tmp/m", cpu_format="int3")
