"""Numba kernels of one MoE layer on one worker's shard (the math of reference.py, bit for bit).

``moe_layer`` groups the (row, expert) pairs by expert, then runs two parallel loops:

1. gate/up: items = (expert, matrix, 16-unit micro-tile); each item streams its weights once,
   block by block, and applies every block to all of the expert's rows (tiles.py), so 16 rows
   cost little more DRAM traffic than one, and threads stay busy whether one expert has 16
   rows or 16 experts have one row each. SiLU * up and the re-quantization of h (act.py) are
   done in the same loop, a block of 32 units as soon as its four tiles are written;
2. down and the per-row weighted sum: items = 16-unit micro-tiles of H; each item runs down
   for every expert, then sums the row's experts in slot order for its 16 outputs.

The instruction set (isa.py) is a compile-time literal: ``moe_layer`` is compiled once per
instruction set; :func:`layer_kernel` returns the entry point for one.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from cpu_experts.act import act_block, scratch
from cpu_experts.activations import decode_activations, empty_f32_aligned, gather_wide
from cpu_experts.amx import TILES, buffers, run16, tile_begin, tile_end, wide_tiles
from cpu_experts.atomics import fetch_add, num_threads
from cpu_experts.errors import ERR_EXPERT_ID, ERR_NON_FINITE, ERR_OK
from cpu_experts.isa import ISA_AMX, ISA_AVX2, ISA_AVX512VNNI, ISA_PORTABLE
from cpu_experts.pairs import group_pairs
from cpu_experts.quant import BLOCK
from cpu_experts.tiles import TU, block_prologue, rows_block
from cpu_experts.tiles4 import BLOCK_BYTES4, GROUP_ROWS, WIDE_ROWS, rows_per_call

PREFETCH_AHEAD = 16384  # bytes ahead of the block being read (default; 0 = the block itself)
ROWS = 4  # rows per micro-kernel call (tiles.rows_block); a remainder goes 2, then 1


@njit(cache=True, nogil=True, inline="always")
def _block_rows(isa, wf, at, x, xs, xc, rows, lo, hi, b, of, obase, ostride, ws) -> None:
    """One block (at byte ``at`` of wf) applied to slots ``lo:hi``: slot j reads activation row
    ``rows[j]`` (j when rows is None) of x/xs/xc and adds into ``of[obase + j * ostride:][:16]``.
    :data:`ROWS` slots per micro-kernel call while that many are left, then 2, then 1 (the
    bits are the same); int4 tiles on VNNI first take tiles4.WIDE_ROWS at a time, then
    GROUP_ROWS. Inlined into the stage (whose ``isa`` is a literal): a call here would cost
    more than one block at 1 row."""
    j = lo
    if rows_per_call(isa, wf) == WIDE_ROWS:
        while hi - j >= WIDE_ROWS:
            rows_block(isa, WIDE_ROWS, wf, at, x, xs, xc, rows, j, b, of, obase + j * ostride,
                       ostride, ws)
            j += WIDE_ROWS
        if hi - j >= GROUP_ROWS:
            rows_block(isa, GROUP_ROWS, wf, at, x, xs, xc, rows, j, b, of,
                       obase + j * ostride, ostride, ws)
            j += GROUP_ROWS
    while hi - j >= ROWS:
        rows_block(isa, ROWS, wf, at, x, xs, xc, rows, j, b, of, obase + j * ostride, ostride, ws)
        j += ROWS
    if hi - j >= 2:
        rows_block(isa, 2, wf, at, x, xs, xc, rows, j, b, of, obase + j * ostride, ostride, ws)
        j += 2
    if hi - j >= 1:
        rows_block(isa, 1, wf, at, x, xs, xc, rows, j, b, of, obase + j * ostride, ostride, ws)


@njit(cache=True, nogil=True)
def _wide_rows(isa, w, woff, bb, nb, pf, x, xs, lo, hi, o, obase, ostride) -> int:
    """AMX (amx.run16): slots ``lo:hi``, 16 at a time, through all ``nb`` blocks of one int4
    micro-tile (the first at byte ``woff`` of w, prefetching from byte ``pf``); slot j is row j
    of x/xs and adds into ``o[obase + j * ostride:][:16]``. Returns the first slot left
    (fewer than 16: the caller's per-block path). The tile configuration is held for the
    call only (amx.tile_begin / tile_end)."""
    numba.literally(isa)
    bbuf, cbuf = buffers()
    tile_begin(isa)
    j = lo
    while hi - j >= WIDE_ROWS:
        run16(isa, TILES, w, woff, bb, nb, pf, x, xs, j, o, obase + j * ostride, ostride, bbuf,
              cbuf)
        j += WIDE_ROWS
    tile_end(isa)
    return j


@njit(cache=True, nogil=True, inline="always")
def _prefetch_next(isa, wf, at, ws, active, T, t, nb, bb, pa, pb):
    """block_prologue of the block at byte ``at`` of the down stage, prefetching block ``pb``
    of run ``pa`` of the item's sequence (runs a = 0..A-1 of nb blocks, then the next item's
    runs from a = 0); returns the cursor moved on by one block."""
    A = active.shape[0]
    na = pa if pa < A else min(pa - A, A - 1)
    pf = ((active[na] * T + t + (pa >= A)) * nb + pb) * bb
    block_prologue(isa, wf, at, ws, pf)
    pb += 1
    if pb == nb:
        pa, pb = pa + 1, 0
    return pa, pb


@njit(cache=True, nogil=True, parallel=True)
def _gate_up_stage(isa, w, xk, xs, xc, active, offsets, rows_of, out, ahead, flip, hk, hs, hc,
                   done, fine, sc, xg, xsg) -> None:
    """out[m, slot, :] = matrix m of each slot's expert applied to its activation row, and h
    (act.py) of each slot as soon as its four tiles of a block of 32 units are written.

    w [E, 2, T, nb, 576] int8 or [E, 2, T, nb, 288] uint8 (int4) tiles (shard.py); xk [R, n]
    int8 (tiles.py form), xs [R, nb] f32, xc [R, nb] int32 (int4: -8 * block sums);
    slots ``offsets[a]:offsets[a+1]`` belong to expert ``active[a]`` and read activation row
    ``rows_of[slot]``; out [2, P, T * 16] f32. Consecutive items are contiguous in memory (per
    expert), so the prefetch ``ahead`` bytes on runs into the thread's next item.

    The hand-off: ``done [A * T/2]`` int32 zeros counts the tiles written of each (expert,
    block of 32 units); the item whose ``fetch_add`` returns 3 wrote the last of the four
    (gate and up, tiles 2c and 2c+1), sees the other three's stores (the atomic orders them)
    and computes the block's h for every slot of the expert into hk/hs/hc (act.act_block),
    with its thread's part of ``sc`` (act.scratch); ``fine[A * T/2]`` records whether that h
    was finite. xg/xsg: on AMX, the activations of the experts with 16+ slots in slot
    order (activations.gather_wide), read by amx.run16.
    """
    numba.literally(isa)
    M, T, nb, bb = w.shape[1], w.shape[2], w.shape[3], w.shape[4]
    P = out.shape[1]
    units = T * TU
    half = T // 2  # blocks of 32 units
    wf, of = w.reshape(w.size), out.reshape(out.size)
    gf, uf, hkf = of[:P * units], of[P * units:], hk.reshape(hk.size)
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
        elif wide_tiles(isa, wf) and hi - lo >= WIDE_ROWS:  # AMX: 16 slots at a time
            j = _wide_rows(isa, wf, base * bb, bb, nb, base * bb + ahead, xg, xsg, lo, hi, of,
                           m * P * units + t * TU, units)
            for b in range(nb):
                _block_rows(isa, wf, (base + b) * bb, xk, xs, xc, rows_of, j, hi, b, of,
                            m * P * units + t * TU, units, ws)
        else:
            for b in range(nb):
                at = (base + b) * bb
                block_prologue(isa, wf, at, ws, at + ahead)
                _block_rows(isa, wf, at, xk, xs, xc, rows_of, lo, hi, b, of,
                            m * P * units + t * TU, units, ws)
        c = a * half + t // 2
        if fetch_add(done, c, 1) == 3:
            so = numba.get_thread_id() * BLOCK
            ok = True
            for j in range(lo, hi):
                ok = act_block(gf, uf, units, j, t // 2, flip, hkf, hs, hc, sc, so) and ok
            fine[c] = ok


@njit(cache=True, nogil=True)
def gate_up_act(isa, w, xk, xs, xc, active, offsets, rows_of, out, ahead, flip, hk, hs,
                hc) -> bool:
    """:func:`_gate_up_stage` with its hand-off state made here (the tile counts, the finite
    flags, each thread's scratch); False if any h was not finite."""
    numba.literally(isa)
    blocks = active.shape[0] * hk.shape[1] // BLOCK
    done = np.zeros(blocks, np.int32)
    fine = np.zeros(blocks, np.bool_)
    xg, xsg = gather_wide(isa, w, xk, xs, offsets, rows_of)
    _gate_up_stage(isa, w, xk, xs, xc, active, offsets, rows_of, out, ahead, flip, hk, hs, hc,
                   done, fine, scratch(num_threads()), xg, xsg)
    for c in range(blocks):
        if not fine[c]:
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
    wf, yf, outf = w.reshape(w.size), y.reshape(y.size), out.reshape(out.size)
    H = out.shape[1]
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
            if hi - lo >= WIDE_ROWS and wide_tiles(isa, wf):  # AMX: as in _gate_up_stage
                for b in range(nb):
                    pa, pb = _prefetch_next(isa, wf, (base + b) * bb, ws, active, T, t, nb, bb,
                                            pa, pb)
                j = _wide_rows(isa, wf, base * bb, bb, nb, base * bb, hk, hs, lo, hi, yf,
                               t * P * TU, TU)
                for b in range(nb):
                    _block_rows(isa, wf, (base + b) * bb, hk, hs, hc, None, j, hi, b, yf,
                                t * P * TU, TU, ws)
                continue
            for b in range(nb):
                at = (base + b) * bb
                pa, pb = _prefetch_next(isa, wf, at, ws, active, T, t, nb, bb, pa, pb)
                if one:
                    rows_block(isa, 1, wf, at, hk, hs, hc, None, lo, b, yf, (t * P + lo) * TU,
                               TU, ws)
                else:
                    _block_rows(isa, wf, at, hk, hs, hc, None, lo, hi, b, yf, t * P * TU, TU,
                                ws)
        for r in range(R):  # NOTE: out's flat view, not out[r]: a view per row is an atomic
            o = r * H + c0
            for i in range(TU):
                outf[o + i] = 0.0
            for k in range(K):
                p = pair_of[r, k]
                if p >= 0:
                    wk = np.float32(weights[r, k])
                    ys = (t * P + slot_of_pair[p]) * TU
                    for i in range(TU):
                        outf[o + i] += wk * yf[ys + i]


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
    flip = (isa == ISA_AVX512VNNI or isa == ISA_AMX) and not int4  # int8 on VNNI: x ^ 0x80
    pair_of, pair_row, active, offsets, members = group_pairs(expert_ids, E)
    if R > 0 and pair_of[0, 0] == -2:
        return ERR_EXPERT_ID
    P = pair_row.shape[0]
    if P == 0:  # nothing on the CPU this layer
        out[:R] = 0.0
        return ERR_OK
    xk, xs, xc = decode_activations(xq, xd_bits, R, flip, int4)
    rows_of = pair_row[members]            # [P] activation row of each slot (slot = grouped order)
    slot_of_pair = np.empty(P, np.int64)   # [P] pair id -> slot
    for s in range(P):
        slot_of_pair[members[s]] = s
    g_u = empty_f32_aligned(2 * P * Is).reshape((2, P, Is))
    hk = np.empty((P, Is), np.int8)
    hs = np.empty((P, Is // BLOCK), np.float32)
    hc = np.empty((P, Is // BLOCK), np.int32)
    if not gate_up_act(isa, gu, xk, xs, xc, active, offsets, rows_of, g_u, ahead, flip, hk, hs,
                       hc):
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


@njit(cache=True, nogil=True)
def _moe_layer_amx(gu, down, xq, xd_bits, expert_ids, weights, out, ahead) -> int:
    return moe_layer(ISA_AMX, gu, down, xq, xd_bits, expert_ids, weights, out, ahead)


_ENTRIES = {ISA_PORTABLE: _moe_layer_portable, ISA_AVX2: _moe_layer_avx2,
            ISA_AVX512VNNI: _moe_layer_avx512vnni, ISA_AMX: _moe_layer_amx}


def layer_kernel(isa: int):
    """``moe_layer`` compiled for one instruction set, called without the ``isa`` argument:
    ``layer_kernel(isa)(gu, down, xq, xd_bits, ids, weights, out, ahead)``."""
    return _ENTRIES[isa]
