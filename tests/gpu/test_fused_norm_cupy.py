"""The fused RMSNorm kernel (gpu_worker/kernels/fused_norm.py) on the device: bits equal to its
NumPy formula for several row lengths and both weightings, a row's bits the same alone and in
batches of 1-64 rows, within a float64 bound of the formula, strided rows (a slice of heads)
read in place, and Ops.rms_norm on it. A failure says in one line what differs."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.fused_norm import rms_norm_reference, rms_norm_rows
from gpu_worker.model.ops import Ops
from tests.gpu.bits import assert_same_bits as _same

cupy = pytest.importorskip("cupy")

HS = (1, 31, 100, 128, 256, 1100, 2048, 4096, 5000, 8193)  # odd and short rows, one
# lane-sweep, a head (one warp); 1100, 2048 (8 warps of 8 per lane), 4096, 5000 (8 warps of
# up to 32 per lane), 8193 (one warp in batches of fused_norm.BATCH)
EPS = 1e-6


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    """The model takes the kernels under test (gpu_worker/kernels/enabled.py)."""
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")


def _x(rng, r: int, h: int) -> np.ndarray:
    x = rng.standard_normal((r, h)).astype(np.float32)
    if r > 3:
        x[1] = 0.0  # an all-zero row: d = sqrt(eps)
        x[2] *= 1e3
        x[3, : min(h, 3)] = [1e-39, -3e-40, 1e-30][: min(h, 3)]  # subnormals and their squares
    return x




def _weights(rng, h: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)


@pytest.mark.parametrize("zc", [False, True], ids=["plain", "zero_centered"])
@pytest.mark.parametrize("H", HS)
def test_bits_equal_the_numpy_formula_and_the_float64_bound(H, zc):
    rng = np.random.default_rng(H + zc)
    w = _weights(rng, H) - (1.0 if zc else 0.0)
    x = _x(rng, 37, H)
    got = cupy.asnumpy(rms_norm_rows(cupy.asarray(x), cupy.asarray(w), EPS, zero_centered=zc))
    _same(got, rms_norm_reference(x, w, EPS, zero_centered=zc), f"H {H} zero_centered {zc}")
    # float64 formula; relative error <= (ceil(H / 32) + 5 roundings of the sum) / 2 + 6 more
    x64 = x.astype(np.float64)
    scale = (1.0 + w.astype(np.float64)) if zc else w.astype(np.float64)
    exact = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS) * scale
    bound = ((-(-H // 32) + 7) / 2 + 6) * 2.0 ** -24 * np.abs(exact) * 1.01 + 1e-44
    err = np.abs(got - exact)
    if not (err <= bound).all():
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"H {H} zc {zc}: error {err[i]:.3g} over the bound {bound[i]:.3g} "
                             f"at {tuple(map(int, i))} ({int((err > bound).sum())} outputs)")


@pytest.mark.parametrize("H", (100, 2048))
def test_a_row_is_the_same_alone_and_in_every_batch(H):
    rng = np.random.default_rng(5)
    w = cupy.asarray(_weights(rng, H))
    x = _x(rng, 64, H)
    xg = cupy.asarray(x)
    alone = np.stack([cupy.asnumpy(rms_norm_rows(xg[r:r + 1], w, EPS, zero_centered=True))[0]
                      for r in range(len(x))])
    for R in (1, 2, 3, 4, 5, 7, 8, 16, 33, 64):
        rows = rng.permutation(len(x))[:R]
        got = cupy.asnumpy(rms_norm_rows(xg[cupy.asarray(rows)], w, EPS, zero_centered=True))
        for pos, r in enumerate(rows):
            _same(got[pos], alone[r], f"H {H} R {R}: row {r} at position {pos}")


def test_heads_strided_rows_and_ops():
    """[R, heads, hd] rows, a slice q[..., :hd] of [R, heads, 2 hd] (read in place at stride
    2 hd), a transposed (non-collapsible) view, and Ops.rms_norm taking the kernel."""
    rng = np.random.default_rng(11)
    R, heads, hd = 6, 5, 128
    w = _weights(rng, hd)
    wg = cupy.asarray(w)
    full = rng.standard_normal((R, heads, 2 * hd)).astype(np.float32)
    want = rms_norm_reference(np.ascontiguousarray(full[..., :hd]), w, EPS, zero_centered=False)
    fg = cupy.asarray(full)
    _same(cupy.asnumpy(rms_norm_rows(fg[..., :hd], wg, EPS, zero_centered=False)), want,
          "slice [R, heads, :hd]")
    t = np.ascontiguousarray(full[..., :hd].transpose(1, 0, 2))  # [heads, R, hd]
    _same(cupy.asnumpy(rms_norm_rows(cupy.asarray(t).transpose(1, 0, 2), wg, EPS,
                                     zero_centered=False)), want, "transposed view")
    ops = Ops(cupy, np.float32)
    _same(cupy.asnumpy(ops.rms_norm(fg[..., :hd], wg, EPS, zero_centered=False)), want,
          "Ops.rms_norm")
    _same(cupy.asnumpy(ops.rms_norm(fg[:0, :, :hd], wg, EPS, zero_centered=False)),
          want[:0], "no rows")


def test_subnormal_sums_are_kept_not_flushed():
    """Squares and a sum of squares below 2^-126 with eps 0: flushing them (CuPy's -ftz=true)
    would give 0 / 0 = NaN; the kernel's PTX keeps them, as NumPy does."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 100)) * 1e-22).astype(np.float32)
    w = _weights(rng, 100)
    want = rms_norm_reference(x, w, 0.0, zero_centered=False)
    assert np.isfinite(want).all()
    _same(cupy.asnumpy(rms_norm_rows(cupy.asarray(x), cupy.asarray(w), 0.0,
                                     zero_centered=False)), want, "subnormal sums, eps 0")


@pytest.mark.parametrize("H", (100, 2048, 3000))  # in registers (2048) and in batches (3000)
def test_the_fused_residual_add_gives_the_sum_and_its_norm(H):
    """Ops.add_rms_norm: ``x + delta`` stored (IEEE float32, subnormal sums kept) and the norm
    of that sum, the same bits as the add then the norm; None adds nothing."""
    rng = np.random.default_rng(H)
    x, d = _x(rng, 9, H), rng.standard_normal((9, H)).astype(np.float32)
    d[3, :2] = [-1e-39 - 1e-39, 3e-40]  # sums near the subnormal range
    w = _weights(rng, H)
    ops = Ops(cupy, np.float32)
    s, n = ops.add_rms_norm(cupy.asarray(x), cupy.asarray(d), cupy.asarray(w), EPS,
                            zero_centered=True)
    want = (x + d).astype(np.float32)
    _same(cupy.asnumpy(s), want, f"sum H {H}")
    _same(cupy.asnumpy(n), rms_norm_reference(want, w, EPS, zero_centered=True), f"norm H {H}")
    s0, n0 = ops.add_rms_norm(cupy.asarray(x), None, cupy.asarray(w), EPS, zero_centered=True)
    _same(cupy.asnumpy(s0), x, "no delta")
    _same(cupy.asnumpy(n0), rms_norm_reference(x, w, EPS, zero_centered=True), "no delta norm")
