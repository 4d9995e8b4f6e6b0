"""The fused SwiGLU activation (gpu_worker/kernels/fused_silu.py) on the device: bits equal to
its NumPy formula over ordinary, signed-zero, huge, subnormal and exp-cut-off values and
shapes with partial blocks, NaN/inf where the formula has them, within a float64 bound of
silu(g) * u, and Ops.silu_mul taking it. A failure says in one line what differs."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.fused_silu import THREADS, silu_mul, silu_mul_reference
from gpu_worker.model.ops import Ops
from tests.gpu.bits import assert_same_bits as _same

cupy = pytest.importorskip("cupy")

SHAPES = ((1,), (THREADS - 1,), (THREADS + 1,), (3, 5), (7, 1000), (2, 3, 129))


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    """The model takes the kernels under test (gpu_worker/kernels/enabled.py)."""
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")




def _specials() -> np.ndarray:
    """Finite gate values where an exp, a sign split or a flush could go wrong."""
    cut = [-87.0, np.nextafter(np.float32(-87), np.float32(0)),
           np.nextafter(np.float32(-87), np.float32(-100)), -86.5, -88.0, -100.0]
    v = [0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-40, 1.1754942e-38, -1.1754942e-38, 1e-30,
         -1e-30, 0.5, -0.5, 0.34657359, -0.34657359, 1.0, -1.0, 20.0, -20.0, 3e38, -3e38,
         1e30, -1e30, 1e5, -1e5] + cut + [-c for c in cut]
    return np.array(v, np.float32)


def _gate_up(rng, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    g = (rng.standard_normal(shape) * 4).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    flat_g, flat_u = g.reshape(-1), u.reshape(-1)
    sp = _specials()
    m = min(flat_g.size, sp.size)
    flat_g[:m] = sp[:m]
    flat_u[: min(flat_u.size, 4)] = [1e-40, -1e-38, 2.0, -0.0][: min(flat_u.size, 4)]
    return g, u


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bits_equal_the_numpy_formula(shape):
    rng = np.random.default_rng(sum(shape))
    g, u = _gate_up(rng, shape)
    got = cupy.asnumpy(silu_mul(cupy.asarray(g), cupy.asarray(u)))
    _same(got, silu_mul_reference(g, u), f"shape {shape}")


def test_every_special_value_against_many_ups_and_the_float64_bound():
    """Each special gate with ordinary, subnormal and signed-zero ups; then the result
    within a few ulp of the float64 silu(g) * u (the exp is ~1 ulp, then 3 roundings)."""
    sp = _specials()
    ups = np.array([1.0, -1.0, 0.0, -0.0, 1e-40, -2.5, 1e-20, 7.0], np.float32)
    g = np.repeat(sp, ups.size)
    u = np.tile(ups, sp.size)
    got = cupy.asnumpy(silu_mul(cupy.asarray(g), cupy.asarray(u)))
    _same(got, silu_mul_reference(g, u), "special gates x ups")
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):
        exact = g64 / (1.0 + np.exp(-g64)) * u
    # away from the subnormal range, float32 overflow and exp_neg's cut-off (0 below -87)
    ok = (np.abs(exact) > 1e-36) & (np.abs(exact) < np.finfo(np.float32).max) & (g >= -87)
    err = np.abs(got[ok] - exact[ok]) / np.abs(exact[ok])
    assert (err <= 8 * 2.0 ** -24).all(), (
        f"relative error {err.max():.3g} at gate {g[ok][np.argmax(err)]!r}, "
        f"up {u[ok][np.argmax(err)]!r}")


def test_inf_and_nan_where_the_formula_has_them():
    """NaN payloads differ between CPU and GPU: compare NaN positions, other bits exactly."""
    g = np.array([np.inf, -np.inf, np.nan, 1.0, 3e38, -3e38], np.float32)
    u = np.array([2.0, 2.0, 1.0, np.inf, 10.0, 10.0], np.float32)
    got = cupy.asnumpy(silu_mul(cupy.asarray(g), cupy.asarray(u)))
    want = silu_mul_reference(g, u)
    assert (np.isnan(got) == np.isnan(want)).all(), (got, want)
    keep = ~np.isnan(want)
    _same(got[keep], want[keep], "inf / overflow")


def test_views_empty_and_errors():
    rng = np.random.default_rng(3)
    g, u = _gate_up(rng, (6, 40))
    gg, ug = cupy.asarray(g), cupy.asarray(u)
    _same(cupy.asnumpy(silu_mul(gg[:, ::2], ug[:, 1::2])),
          silu_mul_reference(g[:, ::2], u[:, 1::2]), "strided views")
    assert silu_mul(gg[:0], ug[:0]).shape == (0, 40)
    with pytest.raises(ValueError, match="differ"):
        silu_mul(gg, ug[:3])
    with pytest.raises(TypeError, match="float32"):
        silu_mul(gg.astype(np.float64), ug)


def test_ops_silu_mul_takes_the_kernel(monkeypatch):
    """On: the kernel's bits (its exp, not CuPy's); off: the fallback silu(g) * u."""
    rng = np.random.default_rng(9)
    g, u = _gate_up(rng, (5, 300))
    ops = Ops(cupy, np.float32)
    gg, ug = cupy.asarray(g), cupy.asarray(u)
    _same(cupy.asnumpy(ops.silu_mul(gg, ug)), silu_mul_reference(g, u), "Ops.silu_mul")
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "none")
    _same(cupy.asnumpy(ops.silu_mul(gg, ug)), cupy.asnumpy(ops.silu(gg) * ug),
          "Ops.silu_mul, switch off")


# ---- sigmoid(gate) * x (switch fused_sigmoid) ----------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sigmoid_mul_bits_equal_the_numpy_formula(shape):
    from gpu_worker.kernels.fused_silu import sigmoid_mul, sigmoid_mul_reference

    rng = np.random.default_rng(sum(shape) + 1)
    g, x = _gate_up(rng, shape)
    got = cupy.asnumpy(sigmoid_mul(cupy.asarray(g), cupy.asarray(x)))
    _same(got, sigmoid_mul_reference(g, x), f"shape {shape}")
    with np.errstate(over="ignore"):
        ref = x.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))
    ok = np.isfinite(ref) & (np.abs(ref) > 1e-30)
    assert np.all(np.abs(got[ok] - ref[ok]) <= 4 * np.spacing(np.abs(ref[ok]).astype(np.float32)))


def test_ops_takes_sigmoid_mul_only_when_switched_on(monkeypatch):
    from gpu_worker.kernels.fused_silu import sigmoid_mul_reference

    rng = np.random.default_rng(3)
    g, x = (rng.standard_normal((5, 64)).astype(np.float32) for _ in range(2))
    ops = Ops(cupy, np.float32)
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")
    _same(cupy.asnumpy(ops.sigmoid_mul(cupy.asarray(g), cupy.asarray(x))),
          sigmoid_mul_reference(g, x), "fused_sigmoid on")
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "fused_silu")
    want = cupy.asnumpy(ops.sigmoid(cupy.asarray(g)) * cupy.asarray(x))
    _same(cupy.asnumpy(ops.sigmoid_mul(cupy.asarray(g), cupy.asarray(x))), want, "off")


@pytest.mark.parametrize("rows, width", [(1, 64), (14, 2048), (3, 1)])
def test_sigmoid_mul_takes_one_gate_per_row(rows, width):
    """The shared expert's gate: [R, 1] against [R, H]."""
    from gpu_worker.kernels.fused_silu import sigmoid_mul, sigmoid_mul_reference

    rng = np.random.default_rng(rows + width)
    g = (rng.standard_normal((rows, 1)) * 4).astype(np.float32)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    got = cupy.asnumpy(sigmoid_mul(cupy.asarray(g), cupy.asarray(x)))
    _same(got, sigmoid_mul_reference(g, x), f"{rows} x {width}")
    with pytest.raises(ValueError):
        sigmoid_mul(cupy.zeros((rows, 2), cupy.float32), cupy.asarray(x))


@pytest.mark.parametrize("rows, width, per_row", [(1, 64, True), (14, 2048, True),
                                                   (5, 300, False)])
def test_sigmoid_mul_add_is_the_product_then_the_add(rows, width, per_row):
    """The MoE output: ``base + sigmoid(gate) * x`` in one launch, the bits of the product
    (its NumPy formula) then a float32 add, subnormal sums kept; Ops takes it when switched
    on and gives the same bits off."""
    from gpu_worker.kernels.fused_silu import sigmoid_mul_add, sigmoid_mul_reference

    rng = np.random.default_rng(rows * width)
    g = (rng.standard_normal((rows, 1 if per_row else width)) * 4).astype(np.float32)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    base = rng.standard_normal((rows, width)).astype(np.float32)
    base[0, :2] = [1e-39, -2e-39]
    x[0, :2] = 0.0  # sums of a subnormal and +0
    want = (base + sigmoid_mul_reference(g, x)).astype(np.float32)
    got = cupy.asnumpy(sigmoid_mul_add(cupy.asarray(g), cupy.asarray(x), cupy.asarray(base)))
    _same(got, want, f"{rows} x {width}")
    ops = Ops(cupy, np.float32)
    via_ops = ops.sigmoid_mul_add(cupy.asarray(g), cupy.asarray(x), cupy.asarray(base))
    _same(cupy.asnumpy(via_ops), want, "Ops.sigmoid_mul_add")
    with pytest.raises(ValueError):
        sigmoid_mul_add(cupy.asarray(g), cupy.asarray(x), cupy.zeros((rows, 1), cupy.float32))


# ---- rotate-half RoPE (switch fused_rope) ----------------------------------------------------
@pytest.mark.parametrize("R, H, D, rot", [(1, 16, 128, 128), (5, 2, 256, 64), (3, 4, 32, 32),
                                          (20, 3, 20, 4)])
def test_rope_bits_equal_the_numpy_formula(R, H, D, rot):
    from gpu_worker.kernels.fused_rope import rope, rope_reference

    rng = np.random.default_rng(R * H + D)
    x = rng.standard_normal((R, H, D)).astype(np.float32)
    x.reshape(-1)[:6] = [1e-40, -3e-39, 0.0, -0.0, 3e38, -1e-45]  # subnormals, zeros, huge
    ang = rng.uniform(0, 100, (R, rot // 2))
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    got = rope(cupy.asarray(x), cupy.asarray(cos), cupy.asarray(sin)).get()
    _same(got, rope_reference(x, cos, sin), f"{R}x{H}x{D} rot {rot}")


def test_ops_takes_rope_only_when_switched_on(monkeypatch):
    from gpu_worker.kernels.fused_rope import rope_reference

    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 2, 64)).astype(np.float32)
    emb = np.tile(rng.uniform(0, 9, (4, 8)), 2)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    ops = Ops(cupy, np.float32)
    want = rope_reference(x, cos, sin)
    for kernels in ("all", "rowtile"):  # normal values: both paths give the IEEE bits
        monkeypatch.setenv("TANDEM_GPU_KERNELS", kernels)
        got = ops.apply_rope(cupy.asarray(x), cupy.asarray(cos), cupy.asarray(sin)).get()
        _same(got, want, kernels)
