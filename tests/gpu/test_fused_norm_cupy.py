"""The fused RMSNorm kernel (gpu_worker/kernels/fused_norm.py) on the device: bits equal to its
NumPy formula for several row lengths and both weightings, a row's bits the same alone and in
batches of 1-64 rows, within a float64 bound of the formula, strided rows (a slice of heads)
read in place, and Ops.rms_norm on it. The gated variant (Gated DeltaNet's silu(z) * norm):
the bits of the two kernels it replaces and of their formulas, and Ops.gated_rms_norm under
every switch. A failure says in one line what differs."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.fused_norm import gated_rms_norm_rows, rms_norm_rows
from gpu_worker.kernels.fused_norm_ref import gated_rms_norm_reference, rms_norm_reference
from gpu_worker.kernels.fused_silu import silu_mul
from gpu_worker.model import ops as ops_module
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


def _gates(rng, shape: tuple[int, ...]) -> np.ndarray:
    """Gate values z with silu's special cases first: signed zeros, subnormals, exp_neg's
    cut-off at -87, huge values."""
    z = (rng.standard_normal(shape) * 4).astype(np.float32)
    sp = np.array([0.0, -0.0, 1e-45, -3e-40, 1e-30, -1e-30, 20.0, -20.0, -87.0, -87.5, 88.0,
                   -100.0, 3e38, -3e38, 0.5, -0.5], np.float32)
    flat = z.reshape(-1)
    flat[:min(flat.size, sp.size)] = sp[:flat.size]
    return z


@pytest.mark.parametrize("zc", [False, True], ids=["plain", "zero_centered"])
@pytest.mark.parametrize("H", (1, 31, 100, 128, 256))
def test_gated_norm_gives_the_bits_of_the_two_kernels_and_the_formula(H, zc):
    """gated_rms_norm_rows: the bits of rms_norm_rows then fused_silu.silu_mul (the two
    launches it replaces) and of their NumPy formulas, [R, H] and [R, heads, H] rows, the
    latter read in place from a slice at a stride, a non-contiguous z copied."""
    rng = np.random.default_rng(H + 2 * zc)
    w = _weights(rng, H) - (1.0 if zc else 0.0)
    x, z = _x(rng, 37, H), _gates(rng, (37, H))
    wg, xg, zg = cupy.asarray(w), cupy.asarray(x), cupy.asarray(z)
    got = cupy.asnumpy(gated_rms_norm_rows(xg, zg, wg, EPS, zero_centered=zc))
    two = silu_mul(zg, rms_norm_rows(xg, wg, EPS, zero_centered=zc))
    _same(got, cupy.asnumpy(two), f"gated H {H} zc {zc} against the two kernels")
    _same(got, gated_rms_norm_reference(x, z, w, EPS, zero_centered=zc), f"gated H {H} formula")
    assert (np.isfinite(got) & (got != 0)).mean() > 0.5  # z = +-3e38 may give +-inf
    full = rng.standard_normal((5, 3, 2 * H)).astype(np.float32)
    zt = _gates(rng, (3, 5, H)).transpose(1, 0, 2)  # [5, 3, H], not contiguous
    got = gated_rms_norm_rows(cupy.asarray(full)[..., :H], cupy.asarray(zt), wg, EPS,
                              zero_centered=zc)
    want = gated_rms_norm_reference(full[..., :H], zt, w, EPS, zero_centered=zc)
    _same(cupy.asnumpy(got), want, f"gated H {H}: heads, a slice of x, a transposed z")


def test_a_gated_row_is_the_same_alone_and_in_every_batch():
    rng = np.random.default_rng(8)
    H = 128
    w = cupy.asarray(_weights(rng, H))
    xg, zg = cupy.asarray(_x(rng, 40, H)), cupy.asarray(_gates(rng, (40, H)))
    alone = [cupy.asnumpy(gated_rms_norm_rows(xg[r:r + 1], zg[r:r + 1], w, EPS,
                                              zero_centered=False))[0] for r in range(40)]
    for R in (2, 3, 5, 8, 33, 40):
        rows = cupy.asarray(rng.permutation(40)[:R])
        got = cupy.asnumpy(gated_rms_norm_rows(xg[rows], zg[rows], w, EPS, zero_centered=False))
        for pos, r in enumerate(cupy.asnumpy(rows).tolist()):
            _same(got[pos], alone[r], f"R {R}: row {r} at position {pos}")


@pytest.mark.parametrize("kernels", ["all", "rowtile,fused_norm", "rowtile,fused_silu"])
def test_ops_gated_rms_norm_is_the_norm_then_silu_mul(kernels, monkeypatch):
    """Ops.gated_rms_norm: one launch of the gated kernel where fused_norm and fused_silu are
    both on (CuPy float32, H <= 256), else the two steps; the bits of rms_norm then silu_mul
    under every switch, for rows too wide for one warp, in float64 and on NumPy."""
    monkeypatch.setenv("TANDEM_GPU_KERNELS", kernels)
    launches = []
    monkeypatch.setattr(ops_module, "gated_rms_norm_rows",
                        lambda *a, **k: launches.append(1) or gated_rms_norm_rows(*a, **k))
    rng = np.random.default_rng(3)
    for xp, dt in ((cupy, np.float32), (cupy, np.float64), (np, np.float32)):
        ops = Ops(xp, dt)
        for H in (64, 300):
            x, z = _x(rng, 6, H).reshape(3, 2, H), _gates(rng, (3, 2, H))
            xd, zd, wd = (xp.asarray(a, dtype=dt) for a in (x, z, _weights(rng, H)))
            n = len(launches)
            with np.errstate(over="ignore"):  # NumPy: silu(+-3e38) * normed
                got = ops.gated_rms_norm(xd, zd, wd, EPS, zero_centered=False)
                want = ops.silu_mul(zd, ops.rms_norm(xd, wd, EPS, zero_centered=False))
            assert got.tobytes() == want.tobytes(), (kernels, xp.__name__, dt, H)
            fused = kernels == "all" and xp is cupy and dt == np.float32 and H <= 256
            assert len(launches) - n == fused, (kernels, xp.__name__, dt, H)
