"""A tiny synthetic model with its routing model on CuPy matches the NumPy reference (same
routed experts: the ids of the device's routing kernel and of the host's routing model; rows
keyed by slot and by a request's routing key; float64 on both)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.backend import to_numpy
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from gpu_worker.model_config import ModelConfig
from gpu_worker.weights.routing import RoutingParams
from gpu_worker.weights.synthetic import SyntheticSource
from scripts.tiny_model import DEFAULT_SIZES, build_config


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_moe"])
def test_synthetic_routing_on_cupy_matches_numpy(arch):
    import cupy

    cfg = ModelConfig.from_dict(build_config(arch, DEFAULT_SIZES, "bfloat16", [0]))
    src = SyntheticSource(cfg, seed=5, routing=RoutingParams(0.7, 0.4))
    tensors = {n: src.read(n, np.float64) for n in src.shapes()}
    parts = [(0, 0, np.arange(1, 30)), (2, 3, np.arange(40, 44))]
    for keys in (None, {0: 2**63 - 1, 2: 3835311112964728579}):  # slots; requests' keys
        batch = RaggedBatch.build(parts, keys)
        out = []
        for xp in (np, cupy):
            model = Model(cfg, tensors, xp=xp, dtype=np.float64, exact=True,
                          routing=src.routing)
            res = model.forward(batch, model.new_caches(3, 64), np.arange(batch.num_rows))
            out.append(to_numpy(res.logits))
        np.testing.assert_allclose(out[1], out[0], rtol=1e-9, atol=1e-9)
