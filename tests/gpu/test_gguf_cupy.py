"""A GGUF model on CuPy (run on a CUDA machine): Q4_K experts (GPU and CPU-held) and Q8_0
matrices dequantized at load give the NumPy backend's logits, in float64 and in bf16."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from gpu_worker.backend import to_numpy
from gpu_worker.engine import load_model
from gpu_worker.kernels.bf16 import UNIT_ROUNDOFF
from gpu_worker.loader import load_checkpoint
from gpu_worker.model.batch import RaggedBatch
from scripts.tiny_model import make_tiny_model
from tests.unit.gguf_tiny import experts_in, write_gguf
from tests.unit.test_bf16 import num_matrices

cupy = pytest.importorskip("cupy")


def _logits(model, experts=None) -> np.ndarray:
    caches = model.new_caches(1, 64)
    batch = RaggedBatch.build([(0, 0, np.arange(3, 30) * 7 % 500)])
    if experts is None:
        return to_numpy(model.forward(batch, caches, np.arange(27)).logits)
    return to_numpy(experts.run_step(
        lambda: model.forward(batch, caches, np.arange(27), experts)).logits)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("placement", ["gpu", "split"])
def test_gguf_on_cupy_matches_numpy(tmp_path, arch: str, placement: str) -> None:
    model_dir = make_tiny_model(tmp_path / "m", arch, seed=5, tokenizer=False, hidden=256,
                                moe_intermediate=256, intermediate=256, shared_intermediate=256)
    file = write_gguf(model_dir, tmp_path / "m.gguf", types=experts_in(T.Q4_K, T.Q8_0))
    kw = {"placement": placement, "cpu_workers": 1, "cpu_experts_per_layer": 3} \
        if placement == "split" else {}
    outs = {}
    for backend, dtype in (("numpy", "float64"), ("cupy", "float64"), ("cupy", "bfloat16")):
        model, experts = load_model(file, backend=backend, dtype=dtype, **kw)
        try:
            outs[backend, dtype] = _logits(model, experts)
        finally:
            if experts is not None:
                experts.close()
    ref = outs["numpy", "float64"]
    np.testing.assert_allclose(outs["cupy", "float64"], ref, rtol=0, atol=1e-6)
    # bf16: the first-order bound of docs/bf16.md (each matrix rounded once more to bf16
    # after its GGUF dequantization), per row
    n_matrices = num_matrices(load_checkpoint(model_dir, dtype=np.float32).tensors)
    bound = n_matrices * UNIT_ROUNDOFF * np.abs(ref).max(axis=1)
    err = np.abs(outs["cupy", "bfloat16"] - ref).max(axis=1)
    assert (err <= bound).all(), f"bf16 error {err.max():.4g} over the bound {bound.min():.4g}"
    assert err.max() > 0  # the rounding did happen
