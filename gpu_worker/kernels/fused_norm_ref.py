"""NumPy formulas of the fused RMSNorm kernels (gpu_worker/kernels/fused_norm.py), bit for
bit: each warp's segment's sum of squares (lane sums ascending, then the butterfly), the warp
sums in order, then the per-element formula, float32 throughout (IEEE, subnormals kept)."""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels.fused_norm import LANES, wide_split
from gpu_worker.kernels.fused_silu import silu_mul_reference


def rms_norm_reference(x: np.ndarray, w: np.ndarray, eps: float, *,
                       zero_centered: bool) -> np.ndarray:
    """NumPy formula of fused_norm.rms_norm_rows, bit for bit: ``x [..., H]``, ``w [H]`` float32
    -> float32 of ``x``'s shape. Lane sums over k = l (mod 32) ascending (H padded with
    zeros to a multiple of 32: adding +0 to a sum of squares changes no bit), the tree fold,
    then the per-element formula, all in float32 (IEEE, subnormals kept)."""
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    H = x.shape[-1]
    rows = x.reshape(-1, H)
    split = wide_split(H) or (1, H)
    W, S = split
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        total = None
        for v in range(W):  # each warp's segment, then the warp sums in order
            part = _warp_sum_of_squares(rows[:, v * S:min(H, (v + 1) * S)])
            total = part if total is None else total + part
        d = np.sqrt(total / np.float32(H) + np.float32(eps))  # [n] float32
        wk = np.float32(1.0) + w if zero_centered else w
        out = (rows / d[:, None]) * wk
    return out.astype(np.float32, copy=False).reshape(x.shape)


def gated_rms_norm_reference(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float, *,
                             zero_centered: bool) -> np.ndarray:
    """NumPy formula of fused_norm.gated_rms_norm_rows, bit for bit: :func:`rms_norm_reference`,
    then ``fused_silu.silu_mul_reference(z, .)``."""
    return silu_mul_reference(z, rms_norm_reference(x, w, eps, zero_centered=zero_centered))


def _warp_sum_of_squares(seg: np.ndarray) -> np.ndarray:
    """One warp's sum of ``seg [n, L]``'s squares: lane sums over k = l (mod 32) ascending
    (padded with zeros: adding +0 to a sum of squares changes no bit), then the tree fold."""
    n, L = seg.shape
    hp = -(-L // LANES) * LANES
    sq = np.zeros((n, hp), np.float32)
    sq[:, :L] = seg * seg
    lanes = sq.reshape(n, hp // LANES, LANES)  # [row, j, lane]: k = 32 j + lane
    acc = np.zeros((n, LANES), np.float32)
    for j in range(hp // LANES):
        acc = acc + lanes[:, j]
    for o in (16, 8, 4, 2, 1):
        acc[:, :o] = acc[:, :o] + acc[:, o:2 * o]
    return acc[:, 0]
