"""The NumPy formula of the row-tile matrix kernel: its float32 FMA is correctly rounded (exact
rational arithmetic decides), its order is the documented one, and it stays within its
stated float64 bound. The kernel itself is compared in tests/gpu/test_rowtile_cupy.py."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from gpu_worker.kernels.rowtile_ref import error_bound, fma32, linear_rows_reference


def _round_f32(q: Fraction) -> np.float32:
    """The float32 nearest to ``q`` (ties to even), decided exactly among the neighbours of
    a float64 guess."""
    g = np.float32(float(q))
    cands = [g, np.nextafter(g, np.float32(np.inf)), np.nextafter(g, np.float32(-np.inf))]
    cands = [c for c in cands if np.isfinite(c)]
    best = min(abs(Fraction(float(c)) - q) for c in cands)
    ties = [c for c in cands if abs(Fraction(float(c)) - q) == best]
    return min(ties, key=lambda c: int(np.array(c).view(np.uint32)) & 1)


def test_fma32_is_correctly_rounded():
    rng = np.random.default_rng(0)
    n = 4000
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    c = -(a * b)  # near-cancellation: the hard cases for double rounding
    c[: n // 2] = (rng.standard_normal(n // 2) * 10.0 ** rng.integers(-8, 8, n // 2)).astype(
        np.float32)
    got = fma32(a, b, c)
    for i in range(n):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        want = _round_f32(exact)
        assert got[i].tobytes() == np.float32(want).tobytes(), (i, a[i], b[i], c[i], got[i], want)
    # double rounding: a * b + c = 1 + 3 * 2^-24 - 2^-70 rounds in float64 to the float32 tie
    # 1 + 3 * 2^-24 (then to even, 1 + 2^-22); rounded once it is 1 + 2^-23
    a1 = np.array([2.0 ** -12 * (1 + 2.0 ** -23)], np.float32)
    b1 = np.array([2.0 ** -12 * (1 - 2.0 ** -23)], np.float32)
    c1 = np.array([1 + 2.0 ** -23], np.float32)
    naive = (a1.astype(np.float64) * b1 + c1).astype(np.float32)
    assert naive[0] == np.float32(1 + 2.0 ** -22)
    assert fma32(a1, b1, c1)[0] == np.float32(1 + 2.0 ** -23)

def test_reference_follows_the_lane_order_and_its_bound():
    rng = np.random.default_rng(1)
    R, N, K = 3, 5, 300  # K past one 256-wide lane sweep and not a multiple of 8
    x = rng.standard_normal((R, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    got = linear_rows_reference(x, w, bias)
    # the order, written out plainly for one output
    xp = np.zeros(512, np.float32)
    wp = np.zeros(512, np.float32)
    xp[:K], wp[:K] = x[2], w[4]
    lanes = []
    for lane in range(32):
        acc = np.float32(0)
        for j in range(2):
            for e in range(8):
                k = 8 * (32 * j + lane) + e
                acc = fma32(np.array([wp[k]]), np.array([xp[k]]), np.array([acc]))[0]
        lanes.append(acc)
    s = np.array(lanes, np.float32)
    for o in (16, 8, 4, 2, 1):
        s[:o] = s[:o] + s[o:2 * o]
    assert got[2, 4].tobytes() == (s[0] + bias[4]).tobytes()
    exact = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    err = np.abs(got - exact)
    assert (err <= error_bound(x, w, bias)).all(), float((err / error_bound(x, w, bias)).max())
    # bf16 bits give the float32 arithmetic of the widened values
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    wide = (bits.astype(np.uint32) << 16).view(np.float32)
    assert linear_rows_reference(x, bits).tobytes() == linear_rows_reference(x, wide).tobytes()
