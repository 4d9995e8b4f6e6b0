"""The fused router (gpu_worker/kernels/router.py, switch fused_router): ids and weights equal
its NumPy formula bit for bit over expert counts around the warp, with and without
renormalisation, rows of ties, zeros and subnormal probabilities; the ids those of a stable
sort of the probabilities; the weights within a few ulp of the float64 softmax; and
moe.route taking it only when switched on. Its given-ids mode (router_given, synthetic
models) likewise, and equal to router_topk's weights at router_topk's own ids."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.router import (
    router_given,
    router_given_reference,
    router_reference,
    router_topk,
)
from tests.gpu.bits import assert_same_bits as _same

cupy = pytest.importorskip("cupy")


def _float64_weights(logits: np.ndarray, ids: np.ndarray, renorm: bool) -> np.ndarray:
    """The softmax's probabilities at ``ids`` (renormalised or not) in float64."""
    p = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ref = np.take_along_axis(p, ids, 1)
    return ref / ref.sum(1, keepdims=True) if renorm else ref


@pytest.mark.parametrize("E, k", [(16, 4), (33, 8), (128, 8), (512, 10), (64, 64)])
@pytest.mark.parametrize("renorm", [True, False])
def test_bits_equal_the_numpy_formula(E, k, renorm):
    rng = np.random.default_rng(E * 7 + k)
    logits = (rng.standard_normal((17, E)) * 3).astype(np.float32)
    ids, w = router_topk(cupy.asarray(logits), k, renorm)
    want_ids, want_w = router_reference(logits, k, renorm)
    assert np.array_equal(ids.get(), want_ids)
    _same(w.get(), want_w, f"E {E} k {k} renorm {renorm}")
    assert np.allclose(w.get(), _float64_weights(logits, want_ids, renorm), rtol=4e-6,
                       atol=1e-30)


def test_ties_and_far_below_the_maximum():
    """Quantized logits tie often; -100 below the maximum underflows to 0."""
    rng = np.random.default_rng(4)
    logits = rng.choice(np.array([0.0, 0.5, 1.0, -100.0, -87.3], np.float32), size=(9, 96))
    logits[0] = -100.0  # one row of nothing but ties
    for k in (1, 5, 17):
        ids, w = router_topk(cupy.asarray(logits), k, True)
        want_ids, want_w = router_reference(logits, k, True)
        assert np.array_equal(ids.get(), want_ids), k
        _same(w.get(), want_w, f"k {k}")


def test_route_takes_it_only_when_switched_on(monkeypatch):
    from gpu_worker.model.moe import route
    from gpu_worker.model.ops import Ops
    from gpu_worker.model_config import ModelConfig
    from scripts.tiny_model import DEFAULT_SIZES, build_config

    cfg = ModelConfig.from_dict(build_config("qwen3_moe", DEFAULT_SIZES, "float32", [0]))
    rng = np.random.default_rng(2)
    x = cupy.asarray(rng.standard_normal((5, cfg.hidden_size)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal((cfg.num_experts, cfg.hidden_size)).astype(np.float32))
    ops = Ops(cupy, np.float32)
    logits = ops.linear(x, w).get()
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")
    ids, weights = route(ops, cfg, w, x)
    want_ids, want_w = router_reference(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    assert np.array_equal(ids.get(), want_ids)
    _same(weights.get(), want_w, "route with fused_router")
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "rowtile")
    ids_off, _ = route(ops, cfg, w, x)
    assert np.array_equal(ids_off.get(), want_ids)  # the same experts either way here


def test_bad_arguments():
    with pytest.raises(ValueError):
        router_topk(cupy.zeros((2, 8), cupy.float32), 9, True)
    with pytest.raises(TypeError):
        router_topk(cupy.zeros((2, 8), cupy.float64), 2, True)
    assert router_topk(cupy.zeros((0, 8), cupy.float32), 2, True)[0].shape == (0, 2)


@pytest.mark.parametrize("R, E, k", [(1, 16, 4), (17, 33, 8), (40, 128, 8), (9, 512, 10),
                                     (5, 64, 64), (3, 2048, 1)])
@pytest.mark.parametrize("renorm", [True, False])
def test_given_ids_bits_equal_the_numpy_formula(R, E, k, renorm):
    """Arbitrary ids (not the top-k, repeats allowed) and, at the top-k's own ids, exactly
    router_topk's weights."""
    rng = np.random.default_rng(R * 31 + E + k)
    logits = (rng.standard_normal((R, E)) * 3).astype(np.float32)
    ids = rng.integers(0, E, (R, k)).astype(np.int64)
    ids[0] = rng.permutation(E)[:k]
    w = router_given(cupy.asarray(logits), cupy.asarray(ids), renorm)
    want = router_given_reference(logits, ids, renorm)
    _same(w.get(), want, f"R {R} E {E} k {k} renorm {renorm}")
    assert np.allclose(w.get(), _float64_weights(logits, ids, renorm), rtol=4e-6, atol=1e-30)
    top_ids, top_w = router_topk(cupy.asarray(logits), k, renorm)
    _same(router_given(cupy.asarray(logits), top_ids, renorm).get(), top_w.get(),
          "at router_topk's ids")


def test_route_with_chosen_ids_takes_it_when_switched_on(monkeypatch):
    from gpu_worker.model.moe import route
    from gpu_worker.model.ops import Ops
    from gpu_worker.model_config import ModelConfig
    from scripts.tiny_model import DEFAULT_SIZES, build_config

    cfg = ModelConfig.from_dict(build_config("qwen3_moe", DEFAULT_SIZES, "float32", [0]))
    rng = np.random.default_rng(3)
    x = cupy.asarray(rng.standard_normal((6, cfg.hidden_size)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal((cfg.num_experts, cfg.hidden_size)).astype(np.float32))
    chosen = rng.integers(0, cfg.num_experts, (6, cfg.num_experts_per_tok)).astype(np.int64)
    ops = Ops(cupy, np.float32)
    logits = ops.linear(x, w).get()
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")
    ids, weights = route(ops, cfg, w, x, cupy.asarray(chosen))
    assert ids.dtype == np.int64 and np.array_equal(ids.get(), chosen)
    want = router_given_reference(logits, chosen, cfg.norm_topk_prob)
    _same(weights.get(), want, "route with chosen ids and fused_router")
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "rowtile")
    ids_off, weights_off = route(ops, cfg, w, x, cupy.asarray(chosen))
    assert np.array_equal(ids_off.get(), chosen)
    assert np.allclose(weights_off.get(), want, rtol=1e-5, atol=0)  # ops.softmax: other bits


def test_given_bad_arguments():
    logits = cupy.zeros((2, 8), cupy.float32)
    with pytest.raises(ValueError):
        router_given(logits, cupy.zeros((3, 2), cupy.int64), True)  # rows differ
    with pytest.raises(ValueError):
        router_given(logits, cupy.zeros((2, 2), cupy.int32), True)
    with pytest.raises(ValueError):
        router_given(logits, cupy.zeros((2, 9), cupy.int64), True)
    assert router_given(cupy.zeros((0, 8), cupy.float32), cupy.zeros((0, 2), cupy.int64),
                        True).shape == (0, 2)
