"""The fused router (gpu_worker/kernels/router.py, switch fused_router): ids and weights equal
its NumPy formula bit for bit over expert counts around the warp, with and without
renormalisation, rows of ties, zeros and subnormal probabilities; the ids those of a stable
sort of the probabilities; the weights within a few ulp of the float64 softmax; and
moe.route taking it only when switched on."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.router import router_reference, router_topk
from tests.gpu.bits import assert_same_bits as _same

cupy = pytest.importorskip("cupy")


@pytest.mark.parametrize("E, k", [(16, 4), (33, 8), (128, 8), (512, 10), (64, 64)])
@pytest.mark.parametrize("renorm", [True, False])
def test_bits_equal_the_numpy_formula(E, k, renorm):
    rng = np.random.default_rng(E * 7 + k)
    logits = (rng.standard_normal((17, E)) * 3).astype(np.float32)
    ids, w = router_topk(cupy.asarray(logits), k, renorm)
    want_ids, want_w = router_reference(logits, k, renorm)
    assert np.array_equal(ids.get(), want_ids)
    _same(w.get(), want_w, f"E {E} k {k} renorm {renorm}")
    p = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ref = np.take_along_axis(p, want_ids, 1)
    if renorm:
        ref /= ref.sum(1, keepdims=True)
    assert np.allclose(w.get(), ref, rtol=4e-6, atol=1e-30)


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
