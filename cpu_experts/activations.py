"""The activations of one MoE layer on a worker, made ready for the kernels (kernels.py): int8
rows in the micro-kernels' form with float32 scales and int4 block sums
(:func:`decode_activations`), on AMX a slot-ordered copy of the rows of experts with 16+ slots
(:func:`gather_wide`), and 64-byte aligned float32 scratch."""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit

from cpu_experts.amx import wide_tiles
from cpu_experts.quant import BLOCK
from cpu_experts.tiles4 import WIDE_ROWS, block_sum


@njit(cache=True, nogil=True)
def f16_value(bits) -> np.float32:
    """float32 value of an IEEE half given as its uint16 bits."""
    e = (np.int64(bits) >> 10) & 31
    m = np.int64(bits) & 1023
    sign = -1.0 if np.int64(bits) & 0x8000 else 1.0
    if e == 0:
        return np.float32(sign * (m * 2.0**-24))
    return np.float32(sign * math.ldexp(1024.0 + m, int(e) - 25))


@njit(cache=True, nogil=True)
def empty_f32_aligned(n: int):
    """``np.empty(n, float32)`` starting on a 64-byte boundary. The stages' float32 scratch
    is written by many threads in 64-byte pieces (16 units of one row); with Numba's 32-byte
    alignment half of those pieces would straddle two cache lines shared with a neighbouring
    item on another thread (false sharing)."""
    buf = np.empty(n + 16, np.float32)
    off = (-(buf.ctypes.data >> 2)) & 15
    return buf[off:off + n]


@njit(cache=True, nogil=True)
def decode_activations(xq, xd_bits, rows, flip, sums):
    """The first ``rows`` rows: int8 activations in tiles.py form (``xq[:rows]`` itself
    unless ``flip``), fp16-bit scales -> float32
    and, when ``sums``, ``-8 *`` each block's sum (int32 [rows, H/32]; else [0, H/32]).
    Serial (before the first parallel stage), so written as loops LLVM vectorises: unsigned
    indices, no branch per byte, the scales widened by integer operations (f16_value's
    values, exactly: a normal half's bits shifted and rebiased, a subnormal's ``m * 2**-24``)."""
    H = xq.shape[1]
    nb = H // BLOCK
    xk = np.empty((rows, H), np.int8) if flip else xq[:rows]  # int4, AVX2: x as it is
    xs = np.empty((rows, nb), np.float32)
    xc = np.empty((rows if sums else 0, nb), np.int32)
    xs_bits = xs.view(np.int32)
    for r in range(rows):
        src, hb, sb = xq[r], xd_bits[r], xs_bits[r]
        if flip:
            dst = xk[r]
            for i in range(H):
                dst[np.uintp(i)] = src[np.uintp(i)] ^ np.int8(-128)
        for b in range(nb):
            h = np.int32(hb[np.uintp(b)])
            em = h & np.int32(0x7FFF)
            sign = (h & np.int32(0x8000)) << np.int32(16)
            sb[np.uintp(b)] = ((em << np.int32(13)) + np.int32(112 << 23)) | sign
        for b in range(nb):
            em = np.int32(hb[np.uintp(b)]) & np.int32(0x7FFF)
            if em < np.int32(0x400):  # zero or subnormal: exact in float32
                v = np.float32(em) * np.float32(2.0**-24)
                xs[r, b] = -v if hb[np.uintp(b)] & 0x8000 else v
        if sums:
            cr = xc[r]
            for b in range(nb):
                cr[np.uintp(b)] = np.int32(-8) * block_sum(src, b * BLOCK)
    return xk, xs, xc


@njit(cache=True, nogil=True)
def gather_wide(isa, w, xk, xs, offsets, rows_of):
    """On AMX with int4 tiles: x/xs rows of the slots of experts with 16 or more slots, in slot
    order (AMX loads A straight from memory, 16 evenly spaced rows); other slots' rows are
    left unset. Else two empty arrays."""
    numba.literally(isa)
    H, nb = xk.shape[1], xs.shape[1]
    P = rows_of.shape[0] if wide_tiles(isa, w) else 0
    xg = np.empty((P, H), np.int8)
    xsg = np.empty((P, nb), np.float32)
    if P == 0:
        return xg, xsg
    xkf, xgf = xk.reshape(xk.size), xg.reshape(xg.size)
    for a in range(offsets.shape[0] - 1):
        if offsets[a + 1] - offsets[a] >= WIDE_ROWS:
            for s in range(offsets[a], offsets[a + 1]):
                r = rows_of[s]
                for i in range(H):
                    xgf[s * H + i] = xkf[r * H + i]
                for b in range(nb):
                    xsg[s, b] = xs[r, b]
    return xg, xsg
