"""The router's top-k kernel (gpu_worker/kernels/topk.py) picks a stable descending sort's
ids: random rows, rows full of ties, zeros and subnormals, expert counts around the warp."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.topk import topk_rows

cupy = pytest.importorskip("cupy")


def _want(p: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-p, axis=-1, kind="stable")[:, :k]


@pytest.mark.parametrize("E, k", [(8, 2), (33, 8), (128, 8), (512, 10), (64, 64)])
def test_random_rows(E, k):
    rng = np.random.default_rng(E + k)
    logits = rng.normal(size=(37, E)).astype(np.float32)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    assert np.array_equal(topk_rows(cupy.asarray(p), k).get(), _want(p, k))


def test_ties_zeros_and_subnormals_keep_the_lower_id():
    rng = np.random.default_rng(3)
    values = np.array([0.0, 1e-45, 2e-45, 1e-40, 0.25, 0.5], np.float32)  # two subnormals
    p = values[rng.integers(0, values.size, size=(64, 96))]
    for k in (1, 5, 17, 96):
        assert np.array_equal(topk_rows(cupy.asarray(p), k).get(), _want(p, k)), k


def test_no_rows_and_bad_arguments():
    assert topk_rows(cupy.zeros((0, 16), cupy.float32), 4).shape == (0, 4)
    with pytest.raises(ValueError):
        topk_rows(cupy.zeros((2, 16), cupy.float32), 17)
    with pytest.raises(TypeError):
        topk_rows(cupy.zeros((2, 16), cupy.float64), 2)
