"""NumPy twin of gpu_worker/kernels/gdn_recurrent.py: the same operations in the same order
on the same dtype, so on a GPU the kernels' outputs and states equal these bits exactly
(tests/gpu/test_gdn_kernel_cupy.py). Slow (Python loops over segments, rows and Dk); for tests.

Arguments and in-place updates are those of ``gates``, ``conv_silu`` and ``recurrence``
there, on NumPy
arrays; ``table`` [segments, 4] int32: slot, row0, rows, first T-row of ``track`` or -1.
A slot of -1: the segment starts from a zero window and state, and neither is kept.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels.gdn_recurrent import L2_EPS, exp_constants, log1p_constants


def exp_neg(u: np.ndarray) -> np.ndarray:
    """The kernels' exp for u <= 0: Cody-Waite reduction, Taylor polynomial, times 2^n."""
    c = exp_constants(u.dtype)
    ok = u >= c["under"]
    u = np.where(ok, u, 0).astype(u.dtype)
    n = np.rint(u * c["log2e"])
    r = u - n * c["ln2_hi"]
    r = r - n * c["ln2_lo"]
    p = np.full_like(u, c["coeffs"][-1])
    for coef in reversed(c["coeffs"][:-1]):
        p = p * r + coef
    bits = (n.astype(np.int64) + c["bias"]) << c["shift"]
    f32 = u.dtype == np.float32
    pow2 = bits.astype(np.int32).view(np.float32) if f32 else bits.view(np.float64)
    return np.where(ok, p * pow2, 0).astype(u.dtype)


def sigmoid(x: np.ndarray) -> np.ndarray:
    e = exp_neg(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def log1p01(y: np.ndarray) -> np.ndarray:
    """The kernels' log1p for 0 <= y <= 1: 2 atanh(y / (2 + y)) by a fixed series; within 2
    ulps of log1p (tests/unit/test_gdn_reference.py)."""
    c, t = log1p_constants(y.dtype), y.dtype.type
    s = y / (2 + y)
    s2 = s * s
    p = np.full_like(y, c["coeffs"][-1])
    for coef in reversed(c["coeffs"][:-1]):
        p = p * s2 + coef
    return np.where(y < c["tiny"], y, t(2) * (s + s * (s2 * p))).astype(y.dtype)


def softplus(x: np.ndarray) -> np.ndarray:
    """x above 20, else max(x, 0) + log1p(exp(-|x|)) (the kernels' exp and log1p)."""
    m = np.where(x > 0, x, 0).astype(x.dtype)
    return np.where(x > 20, x, m + log1p01(exp_neg(-np.abs(x)))).astype(x.dtype)


def gates(ba, a_log, dt_bias, *, key_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """ba [R, Hk * 2r] (per key head r b-values, then r a-values), a_log / dt_bias [Hv] ->
    beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias)), [R, Hv] each."""
    R, Hv = ba.shape[0], a_log.shape[0]
    r = Hv // key_heads
    ba = ba.reshape(R, key_heads, 2 * r)
    b, a = ba[..., :r].reshape(R, Hv), ba[..., r:].reshape(R, Hv)
    A = exp_neg(a_log)
    return sigmoid(b), exp_neg(-(A * softplus(a + dt_bias)))


def conv_silu(x, weight, window, table, track=None) -> np.ndarray:
    """x [R, C], weight [C, K], window [slots, K-1, C] (updated), track [T, K-1, C] -> y."""
    y = np.empty_like(x)
    K = weight.shape[1]
    for slot, row0, n, first in np.asarray(table).tolist():
        h = [window[slot, j].copy() if slot >= 0 else np.zeros_like(window[0, j])
             for j in range(K - 1)]  # oldest first, [C] each
        for t in range(n):
            h.append(x[row0 + t])
            acc = np.zeros(x.shape[1], x.dtype)
            for j in range(K):
                acc = acc + h[j] * weight[:, j]
            y[row0 + t] = silu(acc)
            h = h[1:]
            if first >= 0:
                track[first + t] = np.stack(h)
        if slot >= 0:
            window[slot] = np.stack(h)
    return y


def recurrence(y, decay, beta, state, table, *, key_heads: int, scale: float,
               track=None) -> np.ndarray:
    """y [R, C], decay/beta [R, Hv], state [slots, Hv, Dk, Dv] (updated), track
    [T, Hv, Dk, Dv] -> out [R, Hv, Dv]."""
    R = y.shape[0]
    _, Hv, Dk, Dv = state.shape
    Hk, dt = key_heads, y.dtype.type
    out = np.empty((R, Hv, Dv), y.dtype)
    for slot, row0, n, first in np.asarray(table).tolist():
        S = state[slot].copy() if slot >= 0 else np.zeros_like(state[0])  # [Hv, Dk, Dv]
        for t in range(n):
            row = row0 + t
            q = _l2norm(y[row, :Hk * Dk].reshape(Hk, Dk)) * dt(scale)
            k = _l2norm(y[row, Hk * Dk:2 * Hk * Dk].reshape(Hk, Dk))
            q, k = np.repeat(q, Hv // Hk, axis=0), np.repeat(k, Hv // Hk, axis=0)  # [Hv, Dk]
            v = y[row, 2 * Hk * Dk:].reshape(Hv, Dv)
            S = S * decay[row][:, None, None]
            m = _dot4(k[:, :, None] * S)
            d = beta[row][:, None] * (v - m)
            S = S + k[:, :, None] * d[:, None, :]
            out[row] = _dot4(q[:, :, None] * S)
            if first >= 0:
                track[first + t] = S
        if slot >= 0:
            state[slot] = S
    return out


def _l2norm(x: np.ndarray) -> np.ndarray:
    """x [heads, Dk] / sqrt(sum(x*x) + eps), the sum a halving tree over Dk padded to 2^m."""
    s = x * x
    width = 1 << (x.shape[-1] - 1).bit_length()
    s = np.concatenate([s, np.zeros((x.shape[0], width - x.shape[-1]), x.dtype)], axis=-1)
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[:, :half] + s[:, half:]
    return x / np.sqrt(s + x.dtype.type(L2_EPS))


def _dot4(p: np.ndarray) -> np.ndarray:
    """Sum of p [Hv, Dk, Dv] over Dk: four partial sums of the i = 0, 1, 2, 3 (mod 4) terms in
    order, then (a0 + a1) + (a2 + a3)."""
    a = np.zeros((4, p.shape[0], p.shape[2]), p.dtype)
    for i in range(p.shape[1]):
        a[i & 3] = a[i & 3] + p[:, i]
    return (a[0] + a[1]) + (a[2] + a[3])
