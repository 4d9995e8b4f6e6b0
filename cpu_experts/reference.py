"""Slow pure-NumPy reference of the CPU experts' int8 math (kernels.py matches it bit for bit).

For each (row r, slot k) with ``expert_ids[r, k] = e >= 0`` and each shard s of the
intermediate dimension (a contiguous range of whole blocks of 32, one per worker process):

* ``x`` is quantized per block of 32 by the canonical quantizer (quant.py): ``xq``, ``xs``.
* gate and up: for output unit i, ``acc = 0``; for each block b in increasing order:
  ``acc += float32(sum_t int32(Wq[i, b, t]) * int32(xq[b, t])) * (float32(Ws[i, b]) * xs[b])``,
  all float32 with one rounding per operation (no FMA).
* ``h = float32(silu64(g)) * u`` in float32, where ``silu64(g) = g / (1 + exp64(-g))`` is
  evaluated in float64 with :func:`exp64`, a fixed polynomial (so NumPy and Numba agree bitwise).
* ``h`` is re-quantized by the same canonical quantizer, blocks of 32 along the shard's slice of I.
* down: the same block-dot rule over the shard's blocks of I gives ``y_s[r, k] [H]``.
* the shard's partial output is ``out_s[r] = 0; out_s[r] += w[r, k] * y_s[r, k]`` for k in
  increasing order (slots with ``e == -1`` skipped); the pool sums ``out_0 + out_1 + ...`` in
  shard order. Every step depends only on row r, so a row's result is independent of the batch.
"""

from __future__ import annotations

import numpy as np

from cpu_experts.quant import BLOCK, quantize_ref

LN2_HI = 6.93147180369123816490e-01  # fdlibm split of ln 2: k * LN2_HI is exact for |k| < 2**11
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
EXP_COEF = tuple(1.0 / float(np.prod(np.arange(1, n + 1, dtype=np.float64))) for n in range(14))
EXP_MAX = 709.0
EXP_MIN = -708.0


def exp64(x: np.ndarray) -> np.ndarray:
    """exp in float64 from basic IEEE operations only (range reduction + degree-13 Taylor)."""
    x = np.asarray(x, dtype=np.float64)
    xc = np.clip(x, EXP_MIN, EXP_MAX)
    k = np.rint(xc * INV_LN2)
    r = (xc - k * LN2_HI) - k * LN2_LO
    p = np.full_like(r, EXP_COEF[13])
    for c in EXP_COEF[12::-1]:
        p = p * r + c
    out = np.ldexp(p, k.astype(np.int32))
    out = np.where(x > EXP_MAX, np.inf, out)
    return np.where(x < EXP_MIN, 0.0, out)


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``float32(silu64(g)) * u`` in float32."""
    g64 = g.astype(np.float64)
    s = (g64 / (1.0 + exp64(-g64))).astype(np.float32)
    return s * u.astype(np.float32)


def block_matvec(wq: np.ndarray, ws: np.ndarray, xq: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """``wq [U, n] int8, ws [U, n/32] f16, xq [n] int8, xs [n/32] f16`` -> ``[U] float32``."""
    nb = wq.shape[1] // BLOCK
    prod = wq.astype(np.int32).reshape(-1, nb, BLOCK) * xq.astype(np.int32).reshape(nb, BLOCK)
    isum = prod.sum(axis=-1, dtype=np.int32)                           # [U, nb] exact int32
    scale = ws.astype(np.float32) * xs.astype(np.float32)              # [U, nb]
    terms = isum.astype(np.float32) * scale
    acc = np.zeros(wq.shape[0], np.float32)
    for b in range(nb):                                                # sequential, block order
        acc = acc + terms[:, b]
    return acc


def expert_shard(shard: tuple[np.ndarray, ...], e: int, xq: np.ndarray,
                 xs: np.ndarray) -> np.ndarray:
    """One expert on one shard for one row: ``shard = (gq, gs, uq, us, dq, ds)`` canonical arrays
    (``gq/uq [E, Is, H]``, ``dq [E, H, Is]`` int8 and their f16 scales) -> ``y [H] float32``."""
    gq, gs, uq, us, dq, ds = shard
    g = block_matvec(gq[e], gs[e], xq, xs)                             # [Is]
    u = block_matvec(uq[e], us[e], xq, xs)                             # [Is]
    hq, hs = quantize_ref(silu_mul(g, u))
    return block_matvec(dq[e], ds[e], hq, hs)                          # [H]


def moe_reference(shards: list[tuple[np.ndarray, ...]], xq: np.ndarray, xs: np.ndarray,
                  expert_ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``xq [R, H] int8, xs [R, H/32] f16, expert_ids [R, k], weights [R, k]`` -> ``[R, H] f32``."""
    R, K = expert_ids.shape
    w = weights.astype(np.float32)
    total = None
    for shard in shards:
        part = np.zeros(xq.shape, np.float32)
        for r in range(R):
            for k in range(K):
                e = int(expert_ids[r, k])
                if e >= 0:
                    part[r] = part[r] + w[r, k] * expert_shard(shard, e, xq[r], xs[r])
        total = part if total is None else total + part
    return total


def expert_float(gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The unquantized expert in float64: ``down @ (silu(gate @ x) * (up @ x))``."""
    g = gate.astype(np.float64) @ x
    u = up.astype(np.float64) @ x
    return down.astype(np.float64) @ (g / (1.0 + np.exp(-g)) * u)
