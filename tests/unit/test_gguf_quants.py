"""GGUF dequantization (gpu_worker/weights/gguf_quants.py) against the gguf package's own
reference, and Q8_0 blocks as the CPU experts' int8 blocks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as ref

from gpu_worker.weights import gguf_quants as gq
from tests.unit.gguf_tiny import random_blocks

ROWS = (3, 5, 512)  # [experts, rows, cols]: 2 super-blocks of 256 per row


def _data(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(ROWS).astype(np.float32) * 0.02
    x[0, 0, :32] = 0.0  # an all-zero block
    x[1, 2, 40] = 0.5   # an outlier
    return x


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.F16, T.BF16])
def test_quantized_by_gguf_dequantizes_like_gguf(qtype: T) -> None:
    """Data quantized by gguf.quants.quantize: ours == theirs, bit for bit."""
    raw = ref.quantize(_data(np.random.default_rng(1)), qtype)
    raw = raw.view(np.uint8).reshape(*ROWS[:-1], -1)
    ours = gq.dequantize(raw, qtype)
    theirs = ref.dequantize(raw, qtype)
    assert ours.dtype == np.float32 and ours.shape == ROWS
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS])
def test_random_blocks_dequantize_like_gguf(qtype: T) -> None:
    """gguf has no quantizer for these: every bit pattern of random blocks (finite fp16
    scales) dequantizes to the reference's values, so each field is decoded right."""
    raw = random_blocks(ROWS, qtype, np.random.default_rng(int(qtype)), scale=1.0)
    ours = gq.dequantize(raw, qtype)
    assert ours.shape == ROWS
    np.testing.assert_array_equal(ours, ref.dequantize(raw, qtype))
    assert np.isfinite(ours).all() and np.unique(ours).size > 100


def test_f32_and_fallback_types() -> None:
    x = _data(np.random.default_rng(2))
    np.testing.assert_array_equal(gq.dequantize(x.view(np.uint8), T.F32), x)
    raw = ref.quantize(x, T.Q5_1).reshape(*ROWS[:-1], -1)  # through the reference
    np.testing.assert_array_equal(gq.dequantize(raw, T.Q5_1), ref.dequantize(raw, T.Q5_1))
    with pytest.raises(ValueError, match="unsupported GGUF tensor type I32"):
        gq.dequantize(np.zeros((2, 8), np.uint8), T.I32)


def test_q8_0_split_is_the_stored_blocks() -> None:
    x = _data(np.random.default_rng(3))
    raw = ref.quantize(x, T.Q8_0).reshape(*ROWS[:-1], -1)
    q, d = gq.q8_0_split(raw)
    assert q.dtype == np.int8 and q.shape == ROWS
    assert d.dtype == np.float16 and d.shape == (*ROWS[:-1], ROWS[-1] // 32)
    blocks = np.concatenate([d[..., None].view(np.uint8),
                             q.reshape(*d.shape, 32).view(np.uint8)], axis=-1)
    np.testing.assert_array_equal(blocks.reshape(raw.shape), raw)  # byte for byte
    np.testing.assert_array_equal(q.astype(np.float32).reshape(*d.shape, 32)
                                  * d.astype(np.float32)[..., None],
                                  gq.dequantize(raw, T.Q8_0).reshape(*d.shape, 32))


def test_q8_0_for_cpu_keeps_blocks_and_requantizes_only_minus_128() -> None:
    rng = np.random.default_rng(4)
    q = rng.integers(-127, 128, (2, 4, 64), dtype=np.int8)
    d = rng.uniform(1e-3, 2e-3, (2, 4, 2)).astype(np.float16)
    q[1, 2, 33] = -128  # only block (1, 2, 1) holds the value the kernels cannot take
    q0, d0 = q.copy(), d.copy()
    q2, d2 = gq.q8_0_for_cpu(q, d)
    keep = np.ones(d.shape, bool)
    keep[1, 2, 1] = False
    qb, q0b = q2.reshape(2, 4, 2, 32), q0.reshape(2, 4, 2, 32)
    np.testing.assert_array_equal(qb[keep], q0b[keep])
    np.testing.assert_array_equal(d2[keep], d0[keep])
    assert q2.min() >= -127
    before = q0b[1, 2, 1].astype(np.float32) * np.float32(d0[1, 2, 1])
    after = qb[1, 2, 1].astype(np.float32) * np.float32(d2[1, 2, 1])
    assert np.abs(after - before).max() <= 0.5 * float(d2[1, 2, 1]) * 1.001


def test_row_bytes_and_supported() -> None:
    assert gq.row_bytes(T.Q4_K, 512) == 2 * GGML_QUANT_SIZES[T.Q4_K][1]
    assert {T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.IQ4_XS, T.BF16} <= gq.SUPPORTED
    assert T.I32 not in gq.SUPPORTED
