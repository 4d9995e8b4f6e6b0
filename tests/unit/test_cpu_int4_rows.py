"""The int4 kernels' row handling and activation decoding: every split of an expert's rows into
micro-kernel calls (16 per call for int4 tiles on VNNI, then 8, then 4, 2, 1) bit for bit
against the emulation, the serial decode of the activations (fp16 scales, block sums)
exactly, and the helpers of tiles4.py those use."""

import numpy as np
import pytest
from numba import njit

from cpu_experts import activations, kernels, reference, shard
from cpu_experts import isa as cpu_isa
from cpu_experts.isa import ISA_AVX2, ISA_AVX512VNNI, ISA_PORTABLE
from cpu_experts.quant import quantize
from cpu_experts.tiles4 import WIDE_ROWS, block_sum, rows_per_call

ISAS = [pytest.param(i, id=cpu_isa.NAMES[i], marks=pytest.mark.skipif(
    i not in cpu_isa.available(), reason=f"this CPU cannot run {cpu_isa.NAMES[i]}"))
    for i in cpu_isa.NAMES]


def run(ql: shard.QuantizedLayer, xq, xs, ids, w, isa: int) -> np.ndarray:
    """One int4 worker holding the whole layer."""
    manifest, size = shard.plan_shard({0: ql}, {0: (0, ql.intermediate)}, "int4")
    buf = bytearray(size)
    shard.write_shard(buf, manifest, {0: ql}, {0: (0, ql.intermediate)})
    out = np.full(xq.shape, np.nan, np.float32)
    rc = kernels.layer_kernel(isa)(*shard.views(buf, manifest)[0], xq, xs.view(np.uint16),
                                   ids.astype(np.int32), w, out, kernels.PREFETCH_AHEAD)
    assert rc == kernels.ERR_OK
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 15, 16, 17, 21, 24])
def test_row_counts_equal_emulation_bitwise(rows: int, isa: int) -> None:
    """Any number of rows on one expert holding every row, and on a mix of experts."""
    rng = np.random.default_rng(70 + rows)
    e, i, h = 3, 96, 320  # 6 micro-tiles of gate/up, 20 of down; odd block counts
    ql = shard.quantize_layer(*(rng.standard_normal(s).astype(np.float32) * 0.03
                                for s in ((e, i, h), (e, i, h), (e, h, i))), "int4")
    xq, xs = quantize(rng.standard_normal((rows, h)).astype(np.float32))
    for ids in (np.zeros((rows, 1), np.int64), rng.integers(-1, e, (rows, 3))):
        w = rng.random(ids.shape).astype(np.float32)
        got = run(ql, xq, xs, ids, w, isa)
        want = reference.moe_reference([ql.shard(0, i)], xq, xs, ids, w)
        bad = np.argwhere(got.view(np.int32) != want.view(np.int32))
        assert not bad.size, f"{len(bad)} outputs differ, first at {bad[0]}"


@pytest.mark.parametrize("flip", [False, True])
def test_decode_activations_exact(flip: bool) -> None:
    """Every finite fp16 scale widens to its float32 value, the bytes are copied (or flipped
    by 0x80), and the int4 corrections are ``-8 *`` the blocks' sums, -128 and 127 included."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    bits = bits[np.isfinite(bits.view(np.float16))]
    bits = bits[:len(bits) // 64 * 64].reshape(-1, 2)            # [rows, 2 blocks]
    rng = np.random.default_rng(3)
    xq = rng.integers(-128, 128, (bits.shape[0], 64)).astype(np.int8)
    xq[0], xq[1] = -128, 127
    xk, xs, xc = activations.decode_activations(xq, bits, bits.shape[0], flip, True)
    assert xs.view(np.int32).tobytes() == bits.view(np.float16).astype(np.float32).view(
        np.int32).tobytes()
    assert xk.tobytes() == (xq ^ np.int8(-128) if flip else xq).tobytes()
    want = -8 * xq.astype(np.int32).reshape(-1, 2, 32).sum(-1)
    assert np.array_equal(xc, want), np.argwhere(xc != want)[:3]
    assert activations.decode_activations(xq, bits, 3, flip, False)[2].shape == (0, 2)


@njit
def _sums(x, offs):
    return np.array([block_sum(x, o) for o in offs], np.int32)


@njit
def _wide(gu):
    return (rows_per_call(ISA_AVX512VNNI, gu), rows_per_call(ISA_AVX2, gu),
            rows_per_call(ISA_PORTABLE, gu))


def test_tiles4_helpers() -> None:
    """block_sum at unaligned offsets and the extremes; rows_per_call by tiles and ISA."""
    x = np.random.default_rng(1).integers(-128, 128, 200).astype(np.int8)
    x[:32], x[40:72] = -128, 127
    offs = np.array([0, 40, 1, 7, 33, 168])
    assert _sums(x, offs).tolist() == [int(x[o:o + 32].astype(np.int32).sum()) for o in offs]
    assert _wide(np.zeros(4, np.uint8)) == (WIDE_ROWS, 4, 4)
    assert _wide(np.zeros(4, np.int8)) == (4, 4, 4)
