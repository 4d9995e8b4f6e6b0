"""The grouped expert kernels (gpu_worker/kernels/moe_experts.py) against the NumPy formula
(``experts_local`` on NumPy), and a row's bits independent of its batch."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.model.moe import experts_local
from gpu_worker.model.ops import Ops

cupy = pytest.importorskip("cupy")

E, I, H = 12, 96, 160  # I and H not multiples of 32 (tails of the warps' strides)


def _layer(seed: int, rows: int, k: int):
    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((E, I, H)) * 0.1
    up = rng.standard_normal((E, I, H)) * 0.1
    down = rng.standard_normal((E, H, I)) * 0.1
    x = rng.standard_normal((rows, H))
    ids = np.stack([rng.permutation(E)[:k] for _ in range(rows)])  # distinct per row, unsorted
    ids[rng.random((rows, k)) < 0.25] = -1  # pairs computed elsewhere
    ids[0] = -1  # a row with no expert here
    weights = rng.random((rows, k))
    return x, ids, weights, gate, up, down


def _on_gpu(dtype, *arrays):
    return [cupy.asarray(a if a.dtype.kind == "i" else a.astype(dtype)) for a in arrays]


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_grouped_kernels_equal_the_numpy_formula(dtype, tol):
    from gpu_worker.kernels.moe_experts import experts_grouped

    x, ids, w, gate, up, down = _layer(1, 16, 8)
    want = experts_local(Ops(np, np.float64), gate, up, down, x, ids, w)
    got = cupy.asnumpy(experts_grouped(*_on_gpu(dtype, x, ids, w, gate, up, down)))
    assert got.dtype == dtype and got.shape == (16, H)
    assert not got[0].any()  # no expert of row 0 is on this device
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_rows_bits_do_not_depend_on_its_batch(dtype):
    from gpu_worker.kernels.moe_experts import experts_grouped

    x, ids, w, gate, up, down = _layer(2, 16, 10)
    xg, idg, wg, gg, ug, dg = _on_gpu(dtype, x, ids, w, gate, up, down)
    batch = cupy.asnumpy(experts_grouped(xg, idg, wg, gg, ug, dg))
    for r in range(16):
        alone = cupy.asnumpy(experts_grouped(xg[r:r + 1], idg[r:r + 1], wg[r:r + 1], gg, ug, dg))
        assert alone.tobytes() == batch[r:r + 1].tobytes(), f"row {r}"
    order = np.random.default_rng(0).permutation(16)
    perm = cupy.asnumpy(experts_grouped(xg[order], idg[order], wg[order], gg, ug, dg))
    assert perm.tobytes() == batch[order].tobytes()
    # the slot order of a row's experts does not matter either: ascending id is the sum order
    flip = cupy.asnumpy(experts_grouped(xg, idg[:, ::-1], wg[:, ::-1], gg, ug, dg))
    assert flip.tobytes() == batch.tobytes()


def test_experts_local_on_cupy_uses_them_up_to_the_row_limit():
    from gpu_worker.model import moe

    x, ids, w, gate, up, down = _layer(3, moe.GROUPED_MAX_ROWS + 8, 4)
    ops = Ops(cupy, np.float64)
    args = _on_gpu(np.float64, gate, up, down, x, ids, w)
    want = experts_local(Ops(np, np.float64), gate, up, down, x, ids, w)
    small = cupy.asnumpy(experts_local(ops, *args[:3], args[3][:8], args[4][:8], args[5][:8]))
    large = cupy.asnumpy(experts_local(ops, *args))  # the per-expert loop
    np.testing.assert_allclose(small, want[:8], rtol=0, atol=1e-12 * np.abs(want).max())
    np.testing.assert_allclose(large, want, rtol=0, atol=1e-12 * np.abs(want).max())


def test_bad_shapes_are_refused():
    from gpu_worker.kernels.moe_experts import experts_grouped

    x, ids, w, gate, up, down = _on_gpu(np.float32, *_layer(4, 2, 3))
    with pytest.raises(ValueError, match="do not fit"):
        experts_grouped(x[:, :-1], ids, w, gate, up, down)
    with pytest.raises(TypeError, match="dtype"):
        experts_grouped(x, ids, w, gate.astype(cupy.float64), up, down)
