"""Numba kernels of one MoE layer on one worker's shard (the math of reference.py, bit for bit).

``moe_layer`` groups the (row, expert) pairs by expert, then runs parallel loops over
(expert, matrix, unit tile) work items -- so threads stay busy whether one expert has 16 rows
or 16 experts have one row each -- for gate/up (tiles.py), SiLU * up with the re-quantization
of h, down, and the per-row weighted sum in slot order.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from cpu_experts.quant import BLOCK, quantize_block
from cpu_experts.reference import EXP_COEF, EXP_MAX, EXP_MIN, INV_LN2, LN2_HI, LN2_LO
from cpu_experts.tiles import GROUP, tile_matmul

ERR_OK = 0
ERR_EXPERT_ID = 1
ERR_NON_FINITE = 2


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
def exp64(x: float) -> float:
    """Scalar twin of reference.exp64 (same operations, same order)."""
    if x > EXP_MAX:
        return np.inf
    if x < EXP_MIN:
        return 0.0
    k = np.rint(x * INV_LN2)
    r = (x - k * LN2_HI) - k * LN2_LO
    p = EXP_COEF[13]
    for i in range(12, -1, -1):
        p = p * r + EXP_COEF[i]
    return math.ldexp(p, int(k))


@njit(cache=True, nogil=True)
def group_pairs(expert_ids, num_experts):
    """Dense pair numbering and grouping by expert.

    Returns ``pair_of [R, K]`` (pair index or -1), ``pair_row [P]``, ``active [A]`` (expert ids
    in increasing order), ``offsets [A+1]`` and ``members [P]`` (pair ids of each active expert,
    in increasing pair order), or an empty ``active`` with ``pair_of[0, 0] = -2`` on a bad id.
    """
    R, K = expert_ids.shape
    pair_of = np.full((R, K), -1, np.int64)
    counts = np.zeros(num_experts, np.int64)
    P = 0
    for r in range(R):
        for k in range(K):
            e = expert_ids[r, k]
            if e < -1 or e >= num_experts:
                pair_of[0, 0] = -2
                return pair_of, np.empty(0, np.int64), np.empty(0, np.int64), \
                    np.zeros(1, np.int64), np.empty(0, np.int64)
            if e >= 0:
                pair_of[r, k] = P
                counts[e] += 1
                P += 1
    pair_row = np.empty(P, np.int64)
    pair_exp = np.empty(P, np.int64)
    for r in range(R):
        for k in range(K):
            p = pair_of[r, k]
            if p >= 0:
                pair_row[p] = r
                pair_exp[p] = expert_ids[r, k]
    A = 0
    for e in range(num_experts):
        if counts[e] > 0:
            A += 1
    active = np.empty(A, np.int64)
    offsets = np.zeros(A + 1, np.int64)
    slot = np.full(num_experts, -1, np.int64)
    a = 0
    for e in range(num_experts):
        if counts[e] > 0:
            active[a] = e
            slot[e] = a
            offsets[a + 1] = offsets[a] + counts[e]
            a += 1
    members = np.empty(P, np.int64)
    fill = offsets[:-1].copy()
    for p in range(P):
        s = slot[pair_exp[p]]
        members[fill[s]] = p
        fill[s] += 1
    return pair_of, pair_row, active, offsets, members


@njit(cache=True, nogil=True, parallel=True)
def _matmul_stage(w, s, xf, xs, active, offsets, rows_of, out):
    """out[m, slot, units] for every matrix m: items = (active expert, matrix, unit tile).

    w [E, M, tiles, nb, 32, tu] int8, s [E, M, tiles, nb, tu] f32, out [M, P, tiles * tu];
    slot j of active expert a is row ``offsets[a] + j`` of out[m] and reads activation row
    ``rows_of[offsets[a] + j]`` of xf/xs.
    """
    n_mats = w.shape[1]
    tiles = w.shape[2]
    tu = w.shape[5]
    n_items = active.shape[0] * n_mats * tiles
    for it in prange(n_items):
        a = it // (n_mats * tiles)
        m = (it // tiles) % n_mats
        tile = it % tiles
        e = active[a]
        rows = rows_of[offsets[a]:offsets[a + 1]]
        n = rows.shape[0]
        res = np.empty((n, tu), np.float32)
        acc = np.empty((n, tu), np.float32)
        wf = np.empty((GROUP, tu), np.float32)
        tile_matmul(w[e, m, tile], s[e, m, tile], xf, xs, rows, res, acc, wf)
        dst = out[m]
        for j in range(n):
            dst[offsets[a] + j, tile * tu:(tile + 1) * tu] = res[j]


@njit(cache=True, nogil=True, parallel=True)
def _act_stage(g, u, hf, hs) -> bool:
    """h = float32(silu64(g)) * u, re-quantized per block of 32.

    hf [P, Is] receives the int8 values as float32, hs [P, Is/32] the scale values.
    """
    P, Is = g.shape
    nb = Is // BLOCK
    ok = np.ones(P, np.bool_)
    for p in prange(P):
        h = np.empty(Is, np.float32)
        q = np.empty(Is, np.int8)
        for i in range(Is):
            gv = np.float64(g[p, i])
            s = np.float32(gv / (1.0 + exp64(-gv)))
            h[i] = s * u[p, i]
        for b in range(nb):
            sc, fine = quantize_block(h, q, b * BLOCK)
            if not fine:
                ok[p] = False
            hs[p, b] = np.float32(sc)
        for i in range(Is):
            hf[p, i] = np.float32(q[i])
    return ok.all()


@njit(cache=True, nogil=True, parallel=True)
def _combine_stage(pair_of, slot_of_pair, weights, y, out):
    """out[r] = 0; out[r] += w[r, k] * y[pair(r, k)] for k in increasing order."""
    R, K = pair_of.shape
    H = y.shape[1]
    for r in prange(R):
        o = out[r]
        for i in range(H):
            o[i] = 0.0
        for k in range(K):
            p = pair_of[r, k]
            if p >= 0:
                wk = np.float32(weights[r, k])
                yr = y[slot_of_pair[p]]
                for i in range(H):
                    o[i] += wk * yr[i]


@njit(cache=True, nogil=True)
def _decode_activations(xq, xd_bits, rows):
    """int8 activations, fp16-bit scales -> float32 values (exact) for the first ``rows`` rows."""
    H = xq.shape[1]
    nb = H // BLOCK
    xf = np.empty((rows, H), np.float32)
    xs = np.empty((rows, nb), np.float32)
    for r in range(rows):
        for i in range(H):
            xf[r, i] = np.float32(xq[r, i])
        for b in range(nb):
            xs[r, b] = f16_value(xd_bits[r, b])
    return xf, xs


@njit(cache=True, nogil=True)
def moe_layer(gu_w, gu_s, down_w, down_s, xq, xd_bits, expert_ids, weights, out) -> int:
    """One MoE layer on one shard for ``R = expert_ids.shape[0]`` rows; writes ``out[:R]``.

    gu_w/gu_s: gate and up tiled together ([E, 2, ...], shard.py); down_w/down_s: [E, 1, ...].
    xq [>=R, H] int8, xd_bits [>=R, H/32] uint16 (fp16 bits), expert_ids [R, K] (-1 = skip),
    weights [R, K] float32, out [>=R, H] float32. Returns an ERR_* code.
    """
    R = expert_ids.shape[0]
    E = gu_w.shape[0]
    Is = gu_w.shape[2] * gu_w.shape[5]
    H = xq.shape[1]
    pair_of, pair_row, active, offsets, members = group_pairs(expert_ids, E)
    if R > 0 and pair_of[0, 0] == -2:
        return ERR_EXPERT_ID
    P = pair_row.shape[0]
    if P == 0:  # nothing on the CPU this layer
        out[:R] = 0.0
        return ERR_OK
    xf, xs = _decode_activations(xq, xd_bits, R)
    rows_of = pair_row[members]            # [P] activation row of each slot (slot = grouped order)
    slot_of_pair = np.empty(P, np.int64)   # [P] pair id -> slot
    for s in range(P):
        slot_of_pair[members[s]] = s
    gu = np.empty((2, P, Is), np.float32)
    _matmul_stage(gu_w, gu_s, xf, xs, active, offsets, rows_of, gu)
    hf = np.empty((P, Is), np.float32)
    hs = np.empty((P, Is // BLOCK), np.float32)
    if not _act_stage(gu[0], gu[1], hf, hs):
        return ERR_NON_FINITE
    y = np.empty((1, P, H), np.float32)
    slots = np.arange(P)  # hf/hs rows are already in slot order
    _matmul_stage(down_w, down_s, hf, hs, active, offsets, slots, y)
    _combine_stage(pair_of, slot_of_pair, weights, y[0], out[:R])
    return ERR_OK

