"""Exact int8 block-32 tile products (the inner loops of kernels.py).

A tile is ``tu`` output units of one expert matrix, stored ``[n/32, 32, tu]`` int8 with
``[n/32, tu]`` float32 scales (shard.py), so for a fixed block position t the ``tu`` units sit
side by side: the inner loops run across units (SIMD lanes), and each loaded weight row serves
every activation row routed to the expert ("wide" rows).

Exactness: a block's int8 x int8 products (|p| <= 16129) and their partial sums
(<= 516128 < 2**24) are integers exactly representable in float32, so the block dot is
computed in float32 lanes with reassociation/contraction allowed (:data:`FM_EXACT`) and
equals the int32 sum bit for bit, whatever order LLVM picks. The per-block scaling and the
sum over blocks (:func:`tile_matmul`) are fastmath-free, in block order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cpu_experts.quant import BLOCK

FM_EXACT = {"reassoc", "contract", "nsz"}
GROUP = 8  # block positions per pass: each accumulator load/store serves 8 multiply-adds


@njit(cache=True, nogil=True, fastmath=FM_EXACT)
def _block_dots_direct(wblk, xf, rows, xo, acc):
    """_block_dots for one or two rows: convert each weight where it is used (no staging)."""
    tu = wblk.shape[1]
    for j in range(rows.shape[0]):
        a = acc[j]
        for u in range(tu):
            a[u] = 0.0
        for t0 in range(0, BLOCK, GROUP):
            xr = xf[rows[j], xo + t0:xo + t0 + GROUP]
            x0 = xr[0]
            x1 = xr[1]
            x2 = xr[2]
            x3 = xr[3]
            x4 = xr[4]
            x5 = xr[5]
            x6 = xr[6]
            x7 = xr[7]
            w0 = wblk[t0]
            w1 = wblk[t0 + 1]
            w2 = wblk[t0 + 2]
            w3 = wblk[t0 + 3]
            w4 = wblk[t0 + 4]
            w5 = wblk[t0 + 5]
            w6 = wblk[t0 + 6]
            w7 = wblk[t0 + 7]
            for u in range(tu):
                a[u] += ((np.float32(w0[u]) * x0 + np.float32(w1[u]) * x1)
                         + (np.float32(w2[u]) * x2 + np.float32(w3[u]) * x3)) + (
                    (np.float32(w4[u]) * x4 + np.float32(w5[u]) * x5)
                    + (np.float32(w6[u]) * x6 + np.float32(w7[u]) * x7))


@njit(cache=True, nogil=True, fastmath=FM_EXACT)
def _block_dots(wblk, xf, rows, xo, acc, wf):
    """acc[j, :tu] = exact sum_t wblk[t, :] * xf[rows[j], xo + t] for one block (32 positions).

    wblk [32, tu] int8, xf [*, n] float32 holding int8 values, acc [n_rows, tu], wf [GROUP, tu].
    """
    tu = wblk.shape[1]
    n = rows.shape[0]
    for j in range(n):
        a = acc[j]
        for u in range(tu):
            a[u] = 0.0
    for t0 in range(0, BLOCK, GROUP):
        for q in range(GROUP):
            src = wblk[t0 + q]
            dst = wf[q]
            for u in range(tu):
                dst[u] = np.float32(src[u])
        w0 = wf[0]
        w1 = wf[1]
        w2 = wf[2]
        w3 = wf[3]
        w4 = wf[4]
        w5 = wf[5]
        w6 = wf[6]
        w7 = wf[7]
        for j in range(n):
            xr = xf[rows[j], xo + t0:xo + t0 + GROUP]
            x0 = xr[0]
            x1 = xr[1]
            x2 = xr[2]
            x3 = xr[3]
            x4 = xr[4]
            x5 = xr[5]
            x6 = xr[6]
            x7 = xr[7]
            a = acc[j]
            for u in range(tu):
                a[u] += ((w0[u] * x0 + w1[u] * x1) + (w2[u] * x2 + w3[u] * x3)) + (
                    (w4[u] * x4 + w5[u] * x5) + (w6[u] * x6 + w7[u] * x7))


@njit(cache=True, nogil=True)
def tile_matmul(wt, st, xf, xs, rows, out, acc, wf):
    """One unit tile for the rows of one expert: ``out[j, :tu] = sum_b dot_b * (s_b * xs[row, b])``.

    wt [nb, 32, tu] int8, st [nb, tu] f32, xf [*, n] f32, xs [*, nb] f32, rows [n_rows] int,
    out/acc [n_rows, tu] f32, wf [GROUP, tu] f32 scratch.
    """
    tu = wt.shape[2]
    n = rows.shape[0]
    for j in range(n):
        o = out[j]
        for u in range(tu):
            o[u] = 0.0
    direct = n <= 2  # few rows: converting weights in place beats staging them as floats
    for b in range(wt.shape[0]):
        if direct:
            _block_dots_direct(wt[b], xf, rows, b * BLOCK, acc)
        else:
            _block_dots(wt[b], xf, rows, b * BLOCK, acc, wf)
        sb = st[b]
        for j in range(n):
            sx = xs[rows[j], b]
            o = out[j]
            a = acc[j]
            for u in range(tu):
                o[u] += a[u] * (sb[u] * sx)
