"""The streaming load on CuPy (run on a CUDA machine): the same model as on NumPy, and GPU
memory that grows by the backend's resident bytes, not by the whole checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.backend import to_numpy
from gpu_worker.engine import load_model
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.weights.stream import resident_bytes
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")


def _logits(model, experts=None):
    caches = model.new_caches(1, 64)
    batch = RaggedBatch.build([(0, 0, np.arange(3, 30) * 7 % 500)])
    if experts is None:
        return to_numpy(model.forward(batch, caches, np.arange(27)).logits)
    return to_numpy(experts.run_step(
        lambda: model.forward(batch, caches, np.arange(27), experts)).logits)


@pytest.mark.parametrize("placement", ["gpu", "split", "cpu"])
def test_streamed_cupy_model_matches_numpy(tmp_path, placement):
    path = make_tiny_model(tmp_path, "qwen3_next", seed=3, tokenizer=False, shards=3,
                           dtype="bfloat16", moe_intermediate=64)
    kw = {"dtype": "float64"} if placement == "gpu" else {
        "dtype": "float64", "placement": placement, "cpu_workers": 1}
    if placement == "split":
        kw["cpu_experts_per_layer"] = 3
    outs = []
    for backend in ("numpy", "cupy"):
        pool = cupy.get_default_memory_pool()
        pool.free_all_blocks()
        before = pool.used_bytes()
        model, experts = load_model(path, backend=backend, **kw)
        try:
            if backend == "cupy":  # the weights stay on the device, nothing more of the load
                grew, resident = pool.used_bytes() - before, resident_bytes(model)
                assert resident <= grew <= resident * 1.1 + (64 << 20)
            outs.append(_logits(model, experts))
        finally:
            if experts is not None:
                experts.close()
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-6 * np.abs(outs[0]).max())
