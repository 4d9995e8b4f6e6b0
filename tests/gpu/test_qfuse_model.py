"""QFUSE at model level (CuPy backend, all experts on a CPU worker): the activations the fused
GPU norm kernel quantizes give the same tokens and the same bits of the logits through the
launched path (GPU kernels drive the workers) as through the host path (NumPy copies,
``dispatch_quantized``). Issue 4: >= 2,000 greedy tokens per architecture, logits at 150
positions. (The fused quantizer against the standalone ones: tests/gpu/test_qfuse_cupy.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.engine import Engine
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")

TOKENS, POSITIONS = 2000, 150


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_launched_and_host_paths_give_identical_tokens(tmp_path, arch):
    """QFUSE through the pinned ring (launched) against the host path."""
    path = make_tiny_model(tmp_path, arch, seed=9, tokenizer=False, moe_intermediate=64,
                           std=0.1)
    prompt = np.arange(3, 40) * 11 % 500
    runs = {}
    for mode in ("launched", "host"):
        engine = Engine.from_dir(path, backend="cupy", placement="cpu", cpu_workers=1,
                                 max_slots=1, max_len=TOKENS + 64)
        try:
            assert engine.placement.norm is not None
            if mode == "host":
                engine.placement.use_host_path()
            tokens = engine.generate(prompt, params=SamplingParams(temperature=0),
                                     max_tokens=TOKENS)
            logits = engine.score(np.concatenate([prompt, tokens])[:POSITIONS])
        finally:
            engine.close()
        runs[mode] = (tokens, logits)
    (t1, l1), (t2, l2) = runs["launched"], runs["host"]
    assert len(t1) == TOKENS and t1 == t2
    assert l1.shape == (POSITIONS, 512)
    assert l1.tobytes() == l2.tobytes()
    assert len(set(t1)) > 5  # not a degenerate constant stream


@pytest.mark.parametrize("dispatch", ["host", "launched"])
def test_non_finite_activations_fail_the_step_and_the_next_one_runs(tmp_path, dispatch):
    """The fused quantizer flags inf/nan on the device (no host sync per layer); the step's
    end raises NonFiniteActivation, and the flag does not leak into the next step."""
    from cpu_experts.errors import NonFiniteActivation

    path = make_tiny_model(tmp_path, "qwen3_moe", seed=9, tokenizer=False, moe_intermediate=64,
                           std=0.1)
    engine = Engine.from_dir(path, backend="cupy", placement="cpu", cpu_workers=1,
                             max_slots=2, max_len=64)
    try:
        if dispatch == "host":
            engine.placement.use_host_path()
        prompt = np.arange(3, 20) * 11 % 500
        greedy = SamplingParams(temperature=0)
        before = engine.generate(prompt, params=greedy, max_tokens=8, slot=1)
        embed = engine.model.embed
        saved = embed[7].copy()
        embed[7] = cupy.inf
        with pytest.raises(NonFiniteActivation, match="non-finite"):
            engine.forward([(0, 0, np.array([5, 7, 9]))])
        embed[7] = saved
        assert engine.generate(prompt, params=greedy, max_tokens=8, slot=1) == before
    finally:
        engine.close()
