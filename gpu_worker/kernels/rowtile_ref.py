"""NumPy formula of the row-tile matrix kernel (gpu_worker/kernels/rowtile.py), bit for bit.

Per output ``(r, n)``: K padded with zeros to a multiple of 256; lane ``l`` (0..31) starts
from +0 and, for ``j = 0, 1, ...`` and ``e = 0..7``, does ``acc = fma(w[n, k], x[r, k], acc)``
at ``k = 8 (32 j + l) + e`` (float32, one rounding); then the lane sums fold
``s[l] = s[l] + s[l + o]`` for o = 16, 8, 4, 2, 1 (the kernel's butterfly gives lane 0 this
same tree); then ``+ bias[n]``. IEEE arithmetic throughout: subnormals are kept, never
flushed to 0 (the kernel's PTX keeps them despite CuPy's ``-ftz=true``). NumPy has no float32
FMA: :func:`fma32` computes it exactly (the product of two float32 is exact in float64; the
sum is rounded to odd in float64, and rounding that to float32 is the correctly rounded
result, since 53 >= 24 + 2).
"""

from __future__ import annotations

import numpy as np

LANES, CHUNK = 32, 8  # lanes of a warp; elements per chunk (one 16-byte bf16 load)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once (to nearest even), elementwise, as CUDA's
    ``__fmaf_rn``: float32 arrays (broadcast) -> float32."""
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 24 + 24 bits < 53
    c = c.astype(np.float64)
    s = p + c
    with np.errstate(invalid="ignore"):
        t = s - p  # TwoSum: e is the exact error of s (finite s)
        e = (p - (s - t)) + (c - t)
        # round to odd: an inexact s with an even last bit moves one ulp toward the exact sum
        fix = np.isfinite(s) & (e != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def weights_f32(w: np.ndarray) -> np.ndarray:
    """A weight matrix as float32: bf16 (uint16 bits or ``ml_dtypes.bfloat16``) widened
    exactly, float32 as it is."""
    if w.dtype == np.uint16:
        return (w.astype(np.uint32) << 16).view(np.float32)
    if w.dtype != np.float32 and w.dtype.itemsize == 2:  # ml_dtypes.bfloat16
        return weights_f32(w.view(np.uint16))
    if w.dtype != np.float32:
        raise TypeError(f"weights are float32 or bf16, not {w.dtype}")
    return w


def linear_rows_reference(x: np.ndarray, w: np.ndarray,
                          bias: np.ndarray | None = None) -> np.ndarray:
    """``x [R, K]`` float32 @ ``w [N, K]``.T (+ ``bias [N]``) -> ``[R, N]`` float32 with the
    kernel's exact operations (slow: a [R, N, 32] array updated K / 32 times)."""
    x = np.asarray(x, np.float32)
    w = weights_f32(np.asarray(w))
    R, K = x.shape
    N = w.shape[0]
    span = LANES * CHUNK
    Kp = -(-K // span) * span
    xp = np.zeros((R, Kp), np.float32)
    xp[:, :K] = x
    wp = np.zeros((N, Kp), np.float32)
    wp[:, :K] = w
    xv = xp.reshape(R, Kp // span, LANES, CHUNK)  # [R, J, lane, e]
    wv = wp.reshape(N, Kp // span, LANES, CHUNK)
    acc = np.zeros((R, N, LANES), np.float32)
    for j in range(Kp // span):
        for e in range(CHUNK):
            acc = fma32(wv[None, :, j, :, e], xv[:, None, j, :, e], acc)
    for o in (16, 8, 4, 2, 1):
        acc[:, :, :o] = acc[:, :, :o] + acc[:, :, o:2 * o]
    out = acc[:, :, 0].copy()
    if bias is not None:
        out = out + np.asarray(bias, np.float32)
    return out


def error_bound(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """A rigorous bound ``[R, N]`` of ``|kernel - exact|`` (exact: float64 of the same
    inputs): each term passes through at most ``8 ceil(K / 256) + 5 + 1`` roundings of
    relative error ``2^-24``, so ``|err| <= depth * 2^-24 * (|x| @ |w|.T + |bias|)`` (to first
    order; the factor 1.01 covers the rest)."""
    x64 = np.abs(np.asarray(x, np.float64))
    w64 = np.abs(weights_f32(np.asarray(w)).astype(np.float64))
    K = x64.shape[1]
    depth = CHUNK * -(-K // (LANES * CHUNK)) + 5 + 1
    mag = x64 @ w64.T
    if bias is not None:
        mag = mag + np.abs(np.asarray(bias, np.float64))
    return 1.01 * depth * 2.0 ** -24 * mag
