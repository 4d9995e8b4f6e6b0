"""GGUF tensor types: bytes as stored -> float32, and Q8_0 blocks as Tandem's int8 blocks.

Own NumPy dequantizers for the types big-MoE GGUFs use (F32, F16, BF16, Q8_0, Q4_0, Q4_K,
Q5_K, Q6_K, IQ4_XS), written from ggml's block layouts; each multiplies in float32 in
ggml's order, so it equals the ``gguf`` package's reference bit for bit
(tests/unit/test_gguf_quants.py). Other types the ``gguf`` package can dequantize (Q4_1,
Q5_0, Q5_1, Q2_K, Q3_K, IQ2_*, IQ3_*, IQ1_*, IQ4_NL, TQ*, MXFP4) go through its reference.

Every function takes a tensor's rows as stored: ``raw [..., row_bytes]`` uint8 (one row
is ``cols`` values along GGUF's first dimension, a whole number of blocks) and returns
``[..., cols]``.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
QK_K = 256  # values per K-quant / IQ4_XS super-block
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                       1, 13, 25, 38, 53, 69, 89, 113], np.float32)  # ggml's kvalues_iq4nl
_FALLBACK = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ2_S",
             "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "TQ1_0", "TQ2_0", "MXFP4")


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from byte pairs ``[..., 2]`` -> float32 ``[..., 1]`` (exact)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[n, m]`` bytes -> ``[n, 2m]``: the m low nibbles, then the m high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b: np.ndarray) -> np.ndarray:  # [n, 34]: fp16 d, 32 int8
    return _f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:  # [n, 18]: fp16 d, 16 bytes of nibbles (q - 8)
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).astype(np.float32) - 8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes ``[n, 12]`` -> 6-bit (scales, mins) ``[n, 8]`` each:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7
    take their low 4 bits from bytes 8-11 and their top 2 bits from bytes 0-7's top bits."""
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (mix & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``y = (d * sc) * q - (dmin * m)`` per 32-value sub-block; q ``[n, 8, 32]``."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).reshape(len(b), QK_K)


def _q4_k(b: np.ndarray) -> np.ndarray:  # [n, 144]: d, dmin, scales[12], qs[128]
    # qs: 4 runs of 32 bytes; run j holds sub-block 2j (low nibbles) and 2j+1 (high)
    q = _nibbles(b[:, 16:].reshape(-1, 32)).reshape(len(b), 8, 32)
    return _k_affine(b, q.astype(np.float32))


def _q5_k(b: np.ndarray) -> np.ndarray:  # [n, 176]: d, dmin, scales[12], qh[32], qs[128]
    low = _nibbles(b[:, 48:].reshape(-1, 32)).reshape(len(b), 8, 32)
    bit = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    return _k_affine(b, (low | (bit << 4)).astype(np.float32))


def _q6_k(b: np.ndarray) -> np.ndarray:  # [n, 210]: ql[128], qh[64], int8 scales[16], d
    n = len(b)
    ql = b[:, :128].reshape(n, 2, 2, 32)        # [half, first/second 32 bytes, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)     # [half, -, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [half, 4 quarters, 32]
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    q = ((low | (high << 4)).astype(np.float32) - 32).reshape(n, 16, 16)
    scale = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    return (scale[..., None] * q).reshape(n, QK_K)


def _iq4_xs(b: np.ndarray) -> np.ndarray:  # [n, 136]: d, scales_h u16, scales_l[4], qs[128]
    n = len(b)
    sh = np.ascontiguousarray(b[:, 2:4]).view("<u2")  # [n, 1]
    low = _nibbles(b[:, 4:8])  # [n, 8]: sub-blocks 0,2,4,6 then 1,3,5,7
    low = low.reshape(n, 2, 4).transpose(0, 2, 1).reshape(n, 8)
    high = (sh >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
    dl = _f16(b[:, 0:2]) * ls.astype(np.float32)  # [n, 8]
    idx = _nibbles(b[:, 8:].reshape(-1, 16)).reshape(n, 8, 32)
    return (dl[..., None] * IQ4_VALUES[idx]).reshape(n, QK_K)


_BLOCKS = {T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
           T.IQ4_XS: _iq4_xs}
FLOATS = (T.F32, T.F16, T.BF16)
OWN = (*FLOATS, *_BLOCKS)
SUPPORTED = frozenset((*OWN, *(T[name] for name in _FALLBACK if name in T.__members__)))


def type_name(qtype: int) -> str:
    try:
        return T(qtype).name
    except ValueError:
        return f"type {qtype}"


def row_bytes(qtype: int, cols: int) -> int:
    """Stored bytes of one row of ``cols`` values."""
    block, size = GGML_QUANT_SIZES[T(qtype)]
    return cols // block * size


def dequantize(raw: np.ndarray, qtype: int) -> np.ndarray:
    """Rows as stored ``[..., row_bytes]`` uint8 -> float32 ``[..., cols]``."""
    qtype = T(qtype)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    lead = raw.shape[:-1]
    if qtype == T.F32:
        return raw.view("<f4").astype(np.float32, copy=False)
    if qtype == T.F16:
        return raw.view("<f2").astype(np.float32)
    if qtype == T.BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in _BLOCKS:
        out = _BLOCKS[qtype](raw.reshape(-1, size))
    elif qtype in SUPPORTED:
        from gguf.quants import dequantize as reference  # noqa: PLC0415 (rare types only)

        out = reference(raw.reshape(-1, size), qtype)
    else:
        raise ValueError(f"unsupported GGUF tensor type {type_name(qtype)}")
    return out.reshape(*lead, raw.shape[-1] // size * block)


def q8_0_split(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows ``[..., row_bytes]`` -> ``(q int8 [..., cols], d float16 [..., cols/32])``:
    the same numbers as stored (the int8 values and the fp16 scale of each block of 32)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    lead, nb = raw.shape[:-1], raw.shape[-1] // 34
    blocks = raw.reshape(*lead, nb, 34)
    d = np.ascontiguousarray(blocks[..., :2]).view("<f2").reshape(*lead, nb)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(*lead, nb * 32)
    return q, d.astype(np.float16)


def q4_0_split(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 rows ``[..., row_bytes]`` -> ``(qs uint8 [..., cols/2], d float16 [...,
    cols/32])``: each block's 16 bytes of nibbles (value + 8) and its fp16 scale, as stored."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    lead, nb = raw.shape[:-1], raw.shape[-1] // 18
    blocks = raw.reshape(*lead, nb, 18)
    d = np.ascontiguousarray(blocks[..., :2]).view("<f2").reshape(*lead, nb)
    qs = np.ascontiguousarray(blocks[..., 2:]).reshape(*lead, nb * 16)
    return qs, d.astype(np.float16)


def q8_0_for_cpu(q: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks as the CPU experts' int8 blocks of 32 (cpu_experts/shard.py), in place:
    the same values and fp16 scales, except a block holding -128 (outside the kernels'
    [-127, 127]; llama.cpp's quantizer never writes one, as it rounds x / (amax / 127)),
    which is re-quantized from its values by the canonical quantizer."""
    from cpu_experts.quant import BLOCK, quantize_ref  # noqa: PLC0415 (numba)

    blocks = q.reshape(*d.shape, BLOCK)
    bad = (blocks == -128).any(axis=-1)
    if bad.any():
        values = blocks[bad].astype(np.float32) * d[bad].astype(np.float32)[:, None]
        blocks[bad], scales = quantize_ref(values)
        d[bad] = scales[:, 0]
    return q, d
