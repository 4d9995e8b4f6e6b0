"""The model on the CuPy backend equals the NumPy backend (run on a CUDA machine)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.backend import to_numpy
from gpu_worker.loader import load_checkpoint
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_cupy_forward_matches_numpy(tmp_path, arch):
    path = make_tiny_model(tmp_path, arch, seed=3, tokenizer=False)
    ckpt = load_checkpoint(path, dtype=np.float64)
    outs = []
    for xp in (np, cupy):
        model = Model(ckpt.config, ckpt.tensors, xp=xp, dtype=np.float64)
        caches = model.new_caches(2, 64)
        ids = np.arange(1, 20) * 7 % 500
        first = model.forward(RaggedBatch.build([(0, 0, ids[:12]), (1, 0, ids[3:8])]), caches,
                              np.arange(17))
        step = model.forward(RaggedBatch.build([(0, 12, ids[12:13]), (1, 5, ids[8:9])]), caches)
        outs.append((to_numpy(first.logits), to_numpy(step.logits)))
    for a, b in zip(outs[0], outs[1], strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-9)
