"""QFUSE CuPy kernels: byte-identical to the NumPy reference quantizer (runs where a GPU is)."""

import numpy as np
import pytest

from cpu_experts.quant import NonFiniteActivation, quantize, quantize_ref

cp = pytest.importorskip("cupy")

from gpu_worker.kernels import qfuse  # noqa: E402


def adversarial() -> np.ndarray:
    """Rows of 64 values (two blocks each) covering the rule's corner cases."""
    f32 = np.float32
    rows = [
        [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -126.5, 125.5],  # ties, d = 1
        [],                                                              # all-zero blocks
        [1e7, -5e6, 1.0], [3e38, -3e38], [65504.0 * 127],                # scale overflow
        [1e-9, -5e-10], [1e-5, -3e-6, 2e-7], [127 * 2.0**-25],           # underflow
        [127 * 0.125, 0.0625, -0.1875, 3.0],                             # amax representable
        [f32(127 * (1 + 2.0**-11))], [f32(127 * (1 + 3 * 2.0**-11))],    # fp16 scale ties
        [-0.0, 0.0, -1e-45, 1e-45],                                      # signed zeros, denormals
    ]
    out = np.zeros((len(rows), 64), np.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
        out[i, 32:32 + len(r)] = np.asarray(r, np.float32)[::-1] * -1
    return out


def random_rows() -> np.ndarray:
    rng = np.random.default_rng(0)
    scales = np.logspace(-8, 8, 33)[:, None].astype(np.float32)
    return (rng.standard_normal((33, 2048)) * scales).astype(np.float32)


@pytest.mark.parametrize("make", [adversarial, random_rows])
def test_standalone_quantizer_matches_numpy_and_numba(make) -> None:
    x = make()
    q_ref, d_ref = quantize_ref(x)
    q_nb, d_nb = quantize(x)
    q, d = qfuse.quantize(cp.asarray(x))
    assert q.get().tobytes() == q_ref.tobytes() == q_nb.tobytes()
    assert d.get().tobytes() == d_ref.tobytes() == d_nb.tobytes()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_raises(bad: float) -> None:
    x = np.ones((4, 64), np.float32)
    x[3, 7] = bad
    with pytest.raises(NonFiniteActivation):
        qfuse.quantize(cp.asarray(x))
    with pytest.raises(NonFiniteActivation):
        qfuse.rmsnorm_qfuse(cp.asarray(x), cp.ones(64, cp.float32), 1e-6)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("H", [64, 2048, 4096])
def test_fused_rmsnorm_quantizer(H: int, zero_centered: bool) -> None:
    rng = np.random.default_rng(H)
    x = (rng.standard_normal((16, H)) * 3).astype(np.float32)
    x[2] = 0  # an all-zero row: y = 0, d16 = 0
    w = (rng.standard_normal(H) * 0.1 + (0 if zero_centered else 1)).astype(np.float32)
    y, q, d = qfuse.rmsnorm_qfuse(cp.asarray(x), cp.asarray(w), 1e-6, zero_centered=zero_centered)
    y_h = y.get()
    g = (1 + w) if zero_centered else w
    want = (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)) * g
    assert np.allclose(y_h, want, rtol=2e-6, atol=1e-7)
    q_ref, d_ref = quantize_ref(y_h)  # fused == standalone quantizer applied to the same y
    assert q.get().tobytes() == q_ref.tobytes() and d.get().tobytes() == d_ref.tobytes()
    y_off, q_off, d_off = qfuse.rmsnorm_qfuse(cp.asarray(x), cp.asarray(w), 1e-6,
                                             zero_centered=zero_centered, quantize=False)
    assert q_off is None and d_off is None and y_off.get().tobytes() == y_h.tobytes()
    assert not d.get()[2].any()
