"""Numba kernels of one MoE layer on one worker's shard (the math of reference.py, bit for bit).

``moe_layer`` groups the (row, expert) pairs by expert, then runs three parallel loops:

1. gate/up: items = (expert, matrix, 16-unit micro-tile); each item streams its weights once,
   block by block, and applies every block to all of the expert's rows (tiles.py), so 16 rows
   cost little more DRAM traffic than one, and threads stay busy whether one expert has 16
   rows or 16 experts have one row each;
2. SiLU * up and the re-quantization of h, items = (pair, block of 32);
3. down and the per-row weighted sum: items = 16-unit micro-tiles of H; each item runs down
   for every expert, then sums the row's experts in slot order for its 16 outputs.

The instruction set (isa.py) is a compile-time literal: ``moe_layer`` is compiled once per
instruction set; :func:`layer_kernel` returns the entry point for one.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from cpu_experts.errors import ERR_EXPERT_ID, ERR_NON_FINITE, ERR_OK
from cpu_experts.isa import ISA_AVX2, ISA_AVX512VNNI, ISA_PORTABLE
from cpu_experts.pairs import group_pairs
from cpu_experts.quant import BLOCK, quantize_block_bits
from cpu_experts.reference import EXP_COEF, EXP_MAX, EXP_MIN, INV_LN2, LN2_HI, LN2_LO
from cpu_experts.tiles import TU, block_prologue, rows_block
from cpu_experts.tiles4 import BLOCK_BYTES4, WIDE_ROWS, block_sum, rows_per_call

PREFETCH_AHEAD = 16384  # bytes ahead of the block being read (default; 0 = the block itself)
ROWS = 4  # rows per micro-kernel call (tiles.rows_block); a remainder goes 2, then 1


@njit(cache=True, nogil=True)
def f16_value(bits) -> np.float32:
    """float32 value of an IEEE half given as its uint16 bits."""
    e = (np.int64(bits) >> 10) & 31
    m = np.int64(bits) & 1023
    sign = -1.0 if np.int64(bits) & 0x8000 else 1.0
    if e == 0:
        return np.float32(sign * (m * 2.0**-24))
    return np.float32(sign * math.ldexp(1024.0 + m, int(e) - 25))


_C = EXP_COEF  # exp64's Taylor coefficients, a compile-time constant tuple


@njit(cache=True, nogil=True)
def silu_mul_block(g, u, o: int, h, p, two_k, so: int) -> None:
    """``h[so:so+32] = float32(silu64(g[o:o+32])) * u[o:o+32]``: exp64's operations in the
    same order, written as straight loops LLVM vectorises. ``p`` and ``two_k`` (float64) are
    scratch (``so:so+32`` is used), given by the caller: an allocation or a view per block
    costs more than the block when many threads do it at once. exp64 ends with
    ``ldexp(p, k)``; over the clamped range k lies in [-1021, 1023], where ``2**k`` is a normal
    double and ``p * 2**k`` is exact, so ``2**k`` is built from its exponent bits, written
    through an int64 view of ``two_k`` (made here; the SiLU stage makes it once and calls
    ``_silu_mul_block`` directly)."""
    return _silu_mul_block(g, u, o, h, p, two_k, two_k.view(np.int64), so)


TWO_K_BIAS = 2.0**52 + 1023.0  # k + this is exact, with k + 1023 in its low mantissa bits


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _silu_mul_block(g, u, o: int, h, p, two_k, kbits, so: int) -> None:
    # NOTE: unsigned indices (no wraparound checks) and the numpy error model (no zero-division
    # branch; 1 + e >= 1 anyway) let LLVM vectorise all three loops; the exponent bits of 2**k
    # come from the float k + 2**52 + 1023 shifted left 52 (no float -> int conversion, which
    # AVX2 has no vector form of): bits(2**52 + j) = bits(2**52) + j for 0 <= j < 2**52.
    for i in range(BLOCK):
        x = -np.float64(g[np.uintp(o + i)])
        xc = min(max(x, EXP_MIN), EXP_MAX)
        k = np.rint(xc * INV_LN2)
        r = (xc - k * LN2_HI) - k * LN2_LO
        q = _C[13]
        for c in range(12, -1, -1):
            q = q * r + _C[c]
        p[np.uintp(so + i)] = q
        two_k[np.uintp(so + i)] = k + TWO_K_BIAS
    for i in range(BLOCK):
        kbits[np.uintp(so + i)] <<= 52
    for i in range(BLOCK):
        gv = np.float64(g[np.uintp(o + i)])
        e = p[np.uintp(so + i)] * two_k[np.uintp(so + i)]
        e = np.inf if -gv > EXP_MAX else e
        e = 0.0 if -gv < EXP_MIN else e
        h[np.uintp(so + i)] = np.float32(gv / (1.0 + e)) * u[np.uintp(o + i)]


@njit(cache=True, nogil=True)
def empty_f32_aligned(n: int):
    """``np.empty(n, float32)`` starting on a 64-byte boundary. The stages' float32 scratch
    is written by many threads in 64-byte pieces (16 units of one row); with Numba's 32-byte
    alignment half of those pieces would straddle two cache lines shared with a neighbouring
    item on another thread (false sharing)."""
    buf = np.empty(n + 16, np.float32)
    off = (-(buf.ctypes.data >> 2)) & 15
    return buf[off:off + n]


@njit(cache=True, nogil=True, inline="always")
def _block_rows(isa, wf, at, x, xs, xc, rows, lo, hi, b, of, obase, ostride, ws) -> None:
    """One block (at byte ``at`` of wf) applied to slots ``lo:hi``: slot j reads activation row
    ``rows[j]`` (j when rows is None) of x/xs/xc and adds into ``of[obase + j * ostride:][:16]``.
    :data:`ROWS` slots per micro-kernel call while that many are left, then 2, then 1 (the
    bits are the same); int4 tiles on VNNI first take tiles4.WIDE_ROWS at a time. Inlined
    into the stage (whose ``isa`` is a literal): a call here would cost more than one block
    at 1 row."""
    j = lo
    if rows_per_call(isa, wf) == WIDE_ROWS:
        while hi - j >= WIDE_ROWS:
            rows_block(isa, WIDE_ROWS, wf, at, x, xs, xc, rows, j, b, of, obase + j * ostride,
                       ostride, ws)
            j += WIDE_ROWS
    while hi - j >= ROWS:
        rows_block(isa, ROWS, wf, at, x, xs, xc, rows, j, b, of, obase + j * ostride, ostride, ws)
        j += ROWS
    if hi - j >= 2:
        rows_block(isa, 2, wf, at, x, xs, xc, rows, j, b, of, obase + j * ostride, ostride, ws)
        j += 2
    if hi - j >= 1:
        rows_block(isa, 1, wf, at, x, xs, xc, rows, j, b, of, obase + j * ostride, ostride, ws)


@njit(cache=True, nogil=True, parallel=True)
def _gate_up_stage(isa, w, xk, xs, xc, active, offsets, rows_of, out, ahead):
    """out[m, slot, :] = matrix m of each slot's expert applied to its activation row.

    w [E, M, T, nb, 576] int8 or [E, M, T, nb, 288] uint8 (int4) tiles (shard.py); xk [R, n]
    int8 (tiles.py form), xs [R, nb] f32, xc [R, nb] int32 (int4: -8 * block sums);
    slots ``offsets[a]:offsets[a+1]`` belong to expert ``active[a]`` and read activation row
    ``rows_of[slot]``; out [M, P, T * 16] f32. Consecutive items are contiguous in memory (per
    expert), so the prefetch ``ahead`` bytes on runs into the thread's next item.
    """
    numba.literally(isa)
    M, T, nb, bb = w.shape[1], w.shape[2], w.shape[3], w.shape[4]
    P = out.shape[1]
    units = T * TU
    wf, of = w.reshape(w.size), out.reshape(out.size)
    for it in prange(active.shape[0] * M * T):
        a = it // (M * T)
        m = (it // T) % M
        t = it % T
        lo, hi = offsets[a], offsets[a + 1]
        base = ((active[a] * M + m) * T + t) * nb
        ws = np.empty(TU, np.int32)
        for j in range(lo, hi):
            of[(m * P + j) * units + t * TU:(m * P + j) * units + (t + 1) * TU] = 0.0
        if hi - lo == 1:  # one row (most experts of a decode step): its own tight loop
            for b in range(nb):
                at = (base + b) * bb
                block_prologue(isa, wf, at, ws, at + ahead)
                rows_block(isa, 1, wf, at, xk, xs, xc, rows_of, lo, b, of,
                           (m * P + lo) * units + t * TU, units, ws)
            continue
        for b in range(nb):
            at = (base + b) * bb
            block_prologue(isa, wf, at, ws, at + ahead)
            _block_rows(isa, wf, at, xk, xs, xc, rows_of, lo, hi, b, of,
                        m * P * units + t * TU, units, ws)


ACT_CHUNKS = 120  # items of the SiLU stage are dealt in this many chunks (or fewer)
# Up to this many items (blocks of 32), the calling thread does them all: on the GPU machine a
# parallel region costs ~7 us, more than 16 blocks on one thread.
ACT_SERIAL_BLOCKS = 16


@njit(cache=True, nogil=True, inline="always")
def _act_chunk(gf, uf, flip, hk, hs, hc, nb, hbuf, hbits, qbuf, pbuf, two_k, kbits, so, lo,
               hi):
    """Items ``lo:hi`` of the SiLU stage, with the scratch at ``so:so+32``; False if any h
    was not finite."""
    Is = nb * BLOCK
    ok = True
    for it in range(lo, hi):
        p = it // nb
        o = (it % nb) * BLOCK
        _silu_mul_block(gf, uf, p * Is + o, hbuf, pbuf, two_k, kbits, so)
        sc, fine = quantize_block_bits(hbuf, hbits, qbuf, so)
        ok = ok and fine
        hs[p, it % nb] = np.float32(sc)
        for i in range(BLOCK):
            hk[p, o + i] = qbuf[so + i] ^ np.int8(-128) if flip else qbuf[so + i]
        hc[p, it % nb] = np.int32(-8) * block_sum(qbuf, so)
    return ok


@njit(cache=True, nogil=True, parallel=True)
def _act_stage(g, u, flip, hk, hs, hc) -> bool:
    """h = float32(silu64(g)) * u, re-quantized per block of 32 into hk (int8, tiles.py form:
    ``^ 0x80`` when ``flip``) and hs [P, Is/32] (scale values as float32), with hc [P, Is/32]
    int32 = -8 * each block's sum of q (the int4 kernels' offset correction). Items are
    (pair, block), dealt in contiguous chunks: even one pair spreads over every thread (when
    there are more than :data:`ACT_SERIAL_BLOCKS`). Each chunk has its own part of scratch
    arrays made here; no item allocates or takes a view (either costs an atomic or a malloc
    that threads contend for)."""
    P, Is = g.shape
    nb = Is // BLOCK
    n = P * nb
    chunks = 1 if n <= ACT_SERIAL_BLOCKS else min(n, ACT_CHUNKS)
    gf, uf = g.reshape(g.size), u.reshape(u.size)
    hbuf = np.empty(chunks * BLOCK, np.float32)
    hbits = hbuf.view(np.int32)
    qbuf = np.empty(chunks * BLOCK, np.int8)
    pbuf = np.empty(chunks * BLOCK, np.float64)
    two_k = np.empty(chunks * BLOCK, np.float64)
    kbits = two_k.view(np.int64)
    # NOTE: np.ones here would be a parallel region of its own (Numba parallelises it): ~7 us
    ok = np.empty(chunks, np.bool_)
    if chunks == 1:
        ok[0] = _act_chunk(gf, uf, flip, hk, hs, hc, nb, hbuf, hbits, qbuf, pbuf, two_k,
                           kbits, 0, 0, n)
    else:
        for c in prange(chunks):
            ok[c] = _act_chunk(gf, uf, flip, hk, hs, hc, nb, hbuf, hbits, qbuf, pbuf, two_k,
                               kbits, c * BLOCK, c * n // chunks, (c + 1) * n // chunks)
    for c in range(chunks):
        if not ok[c]:
            return False
    return True


@njit(cache=True, nogil=True, parallel=True)
def _down_combine_stage(isa, w, hk, hs, hc, active, offsets, pair_of, slot_of_pair, weights,
                        y, out, ahead):
    """y[slot] = down of the slot's expert (hk/hs rows in slot order), then per row
    ``out[r] = 0; out[r] += weights[r, k] * y[pair(r, k)]`` for k in increasing order.

    Items are the 16-unit micro-tiles of H: each computes its 16 outputs for every expert and
    every row. w [E, 1, T, nb, 576 or 288]; y: P * H float32 scratch, laid out [T, P, 16] (an
    item's slots contiguous: a [P, H] layout puts its 16 rows 8 KiB apart, all in one L1 set,
    and 16 rows then miss L1 on every block); out [R, H]. An item reads one run of
    ``nb`` blocks per expert; the prefetch follows that sequence across experts (then into the
    thread's next item).
    """
    numba.literally(isa)
    T, nb, bb = w.shape[2], w.shape[3], w.shape[4]
    P = slot_of_pair.shape[0]
    R, K = pair_of.shape
    A = active.shape[0]
    step = ahead // bb
    wf, yf = w.reshape(w.size), y.reshape(y.size)
    for t in prange(T):
        ws = np.empty(TU, np.int32)
        c0 = t * TU
        # the prefetch cursor: block pb of run pa, ``step`` blocks ahead in this item's
        # sequence (runs a = 0..A-1 of nb blocks, then the next item's runs, from a = 0)
        pa, pb = step // nb, step % nb
        for a in range(A):
            lo, hi = offsets[a], offsets[a + 1]
            base = (active[a] * T + t) * nb
            for j in range(lo, hi):
                yf[(t * P + j) * TU:(t * P + j + 1) * TU] = 0.0
            one = hi - lo == 1  # one row: the branch below is the same at every block
            for b in range(nb):
                at = (base + b) * bb
                na = pa if pa < A else min(pa - A, A - 1)
                pf = ((active[na] * T + t + (pa >= A)) * nb + pb) * bb
                block_prologue(isa, wf, at, ws, pf)
                pb += 1
                if pb == nb:
                    pa, pb = pa + 1, 0
                if one:
                    rows_block(isa, 1, wf, at, hk, hs, hc, None, lo, b, yf, (t * P + lo) * TU,
                               TU, ws)
                else:
                    _block_rows(isa, wf, at, hk, hs, hc, None, lo, hi, b, yf, t * P * TU, TU,
                                ws)
        for r in range(R):
            o = out[r]
            for i in range(c0, c0 + TU):
                o[i] = 0.0
            for k in range(K):
                p = pair_of[r, k]
                if p >= 0:
                    wk = np.float32(weights[r, k])
                    ys = (t * P + slot_of_pair[p]) * TU
                    for i in range(TU):
                        o[c0 + i] += wk * yf[ys + i]


@njit(cache=True, nogil=True)
def _decode_activations(xq, xd_bits, rows, flip, sums):
    """The first ``rows`` rows: int8 activations in tiles.py form, fp16-bit scales -> float32
    and, when ``sums``, ``-8 *`` each block's sum (int32 [rows, H/32]; else [0, H/32]).
    Serial (before the first parallel stage), so written as loops LLVM vectorises: unsigned
    indices, no branch per byte, the scales widened by integer operations (f16_value's
    values, exactly: a normal half's bits shifted and rebiased, a subnormal's ``m * 2**-24``)."""
    H = xq.shape[1]
    nb = H // BLOCK
    xk = np.empty((rows, H), np.int8)
    xs = np.empty((rows, nb), np.float32)
    xc = np.empty((rows if sums else 0, nb), np.int32)
    xs_bits = xs.view(np.int32)
    mask = np.int8(-128) if flip else np.int8(0)
    for r in range(rows):
        src, dst = xq[r], xk[r]
        for i in range(H):
            dst[np.uintp(i)] = src[np.uintp(i)] ^ mask
        for b in range(nb):
            h = np.int32(xd_bits[r, b])
            em = h & np.int32(0x7FFF)
            sign = (h & np.int32(0x8000)) << np.int32(16)
            xs_bits[r, b] = ((em << np.int32(13)) + np.int32(112 << 23)) | sign
        for b in range(nb):
            em = np.int32(xd_bits[r, b]) & np.int32(0x7FFF)
            if em < np.int32(0x400):  # zero or subnormal: exact in float32
                v = np.float32(em) * np.float32(2.0**-24)
                xs[r, b] = -v if xd_bits[r, b] & 0x8000 else v
        if sums:
            for b in range(nb):
                xc[r, b] = np.int32(-8) * block_sum(src, b * BLOCK)
    return xk, xs, xc


@njit(cache=True, nogil=True)
def moe_layer(isa, gu, down, xq, xd_bits, expert_ids, weights, out, ahead) -> int:
    """One MoE layer on one shard for ``R = expert_ids.shape[0]`` rows; writes ``out[:R]``.

    isa: a literal ISA_* (isa.py). gu: gate and up tiled together ([E, 2, ...], shard.py);
    down: [E, 1, ...]; int8 tiles, or uint8 tiles of the int4 format (tiles4.py).
    xq [>=R, H] int8, xd_bits [>=R, H/32] uint16 (fp16 bits), expert_ids
    [R, K] (-1 = skip), weights [R, K] float32, out [>=R, H] float32, ahead: prefetch distance
    in bytes. Returns an ERR_* code.
    """
    numba.literally(isa)
    R = expert_ids.shape[0]
    E = gu.shape[0]
    Is = gu.shape[2] * TU
    H = xq.shape[1]
    int4 = gu.shape[4] == BLOCK_BYTES4
    flip = isa == ISA_AVX512VNNI and not int4  # int8 tiles on VNNI take x ^ 0x80 (tiles.py)
    pair_of, pair_row, active, offsets, members = group_pairs(expert_ids, E)
    if R > 0 and pair_of[0, 0] == -2:
        return ERR_EXPERT_ID
    P = pair_row.shape[0]
    if P == 0:  # nothing on the CPU this layer
        out[:R] = 0.0
        return ERR_OK
    xk, xs, xc = _decode_activations(xq, xd_bits, R, flip, int4)
    rows_of = pair_row[members]            # [P] activation row of each slot (slot = grouped order)
    slot_of_pair = np.empty(P, np.int64)   # [P] pair id -> slot
    for s in range(P):
        slot_of_pair[members[s]] = s
    g_u = empty_f32_aligned(2 * P * Is).reshape((2, P, Is))
    _gate_up_stage(isa, gu, xk, xs, xc, active, offsets, rows_of, g_u, ahead)
    hk = np.empty((P, Is), np.int8)
    hs = np.empty((P, Is // BLOCK), np.float32)
    hc = np.empty((P, Is // BLOCK), np.int32)
    if not _act_stage(g_u[0], g_u[1], flip, hk, hs, hc):
        return ERR_NON_FINITE
    y = empty_f32_aligned(P * H)  # [T, P, 16]
    _down_combine_stage(isa, down, hk, hs, hc, active, offsets, pair_of, slot_of_pair, weights,
                        y, out[:R], ahead)
    return ERR_OK


@njit(cache=True, nogil=True)
def _moe_layer_portable(gu, down, xq, xd_bits, expert_ids, weights, out, ahead) -> int:
    return moe_layer(ISA_PORTABLE, gu, down, xq, xd_bits, expert_ids, weights, out, ahead)


@njit(cache=True, nogil=True)
def _moe_layer_avx2(gu, down, xq, xd_bits, expert_ids, weights, out, ahead) -> int:
    return moe_layer(ISA_AVX2, gu, down, xq, xd_bits, expert_ids, weights, out, ahead)


@njit(cache=True, nogil=True)
def _moe_layer_avx512vnni(gu, down, xq, xd_bits, expert_ids, weights, out, ahead) -> int:
    return moe_layer(ISA_AVX512VNNI, gu, down, xq, xd_bits, expert_ids, weights, out, ahead)


_ENTRIES = {ISA_PORTABLE: _moe_layer_portable, ISA_AVX2: _moe_layer_avx2,
            ISA_AVX512VNNI: _moe_layer_avx512vnni}


def layer_kernel(isa: int):
    """``moe_layer`` compiled for one instruction set, called without the ``isa`` argument:
    ``layer_kernel(isa)(gu, down, xq, xd_bits, ids, weights, out, ahead)``."""
    return _ENTRIES[isa]
