"""The NumPy reference of the merged GPU expert kernels (gpu_worker/kernels/moe_merged_ref.py)
without a GPU: its exp, its lists, and its sums against the float64 formula."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from gpu_worker.kernels.moe_merged_ref import (
    build_lists_reference,
    exp_neg,
    experts_merged_reference,
    lane_dot,
)
from gpu_worker.model.moe import experts_local
from gpu_worker.model.ops import Ops


def test_exp_neg_is_within_one_ulp():
    t = -np.linspace(0, 86.9, 400_001).astype(np.float32)
    got, want = exp_neg(t).astype(np.float64), np.exp(t.astype(np.float64))
    assert (np.abs(got - want) / want).max() < 2 ** -23
    assert exp_neg(np.float32([-100, -np.inf])).tolist() == [0, 0]
    assert np.isnan(exp_neg(np.float32([np.nan]))).all()


def test_lane_dot_is_a_dot_product():
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((5, 300)), rng.standard_normal((3, 300))
    np.testing.assert_allclose(lane_dot(w, x), x @ w.T, rtol=1e-13)


def test_lists_are_sorted_by_expert_then_row():
    ids = np.array([[3, 1, -1], [1, 3, 9], [2, 2, 1]])  # 9 >= E: skipped; row 2 names 2 twice
    got = build_lists_reference(ids, 5)
    assert got["act_expert"].tolist() == [1, 2, 3] and int(got["n_active"]) == 3
    assert got["act_count"].tolist() == [3, 1, 2] and got["act_start"].tolist() == [0, 3, 4]
    assert got["list_row"].tolist() == [0, 1, 2, 2, 0, 1]
    assert got["pair_q"].tolist() == [[4, 0, -1], [1, 5, -1], [3, 3, 2]]


def test_the_reference_agrees_with_the_float64_formula():
    rng = np.random.default_rng(1)
    E, I, H, R, k = 7, 20, 72, 9, 3
    stacks = [rng.standard_normal(s) * 0.1 for s in ((E, I, H), (E, I, H), (E, H, I))]
    x, w = rng.standard_normal((R, H)), rng.random((R, k))
    ids = np.stack([rng.permutation(E)[:k] for _ in range(R)])
    ids[rng.random((R, k)) < 0.3] = -1
    want = experts_local(Ops(np, np.float64), *stacks, x, ids, w)
    f64 = experts_merged_reference(x, ids, w, *stacks)
    np.testing.assert_allclose(f64, want, rtol=0, atol=1e-13 * np.abs(want).max())
    bf = [a.astype(ml_dtypes.bfloat16) for a in stacks]
    f32 = experts_merged_reference(x.astype(np.float32), ids, w.astype(np.float32), *bf)
    wide = experts_local(Ops(np, np.float64), *(a.astype(np.float64) for a in bf), x, ids, w)
    assert f32.dtype == np.float32
    np.testing.assert_allclose(f32, wide, rtol=0, atol=2e-6 * np.abs(wide).max())
    bits = experts_merged_reference(x.astype(np.float32), ids, w.astype(np.float32),
                                    *(a.view(np.uint16) for a in bf))
    assert bits.tobytes() == f32.tobytes()
