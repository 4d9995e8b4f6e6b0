"""QFUSE on vs off at model level (CuPy backend, all experts on a CPU worker): quantizing in
the fused GPU norm kernel or with the standalone Numba quantizer changes no token and no bit
of the logits. Issue 4: >= 2,000 greedy tokens per architecture, logits at 150 positions."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.engine import Engine
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")

TOKENS, POSITIONS = 2000, 150


@pytest.mark.parametrize("dispatch", ["sync", "launched"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_fused_and_standalone_quantizer_give_identical_tokens(tmp_path, arch, dispatch):
    """QFUSE fused (through the pinned ring, ``dispatch``) against standalone (the host path)."""
    path = make_tiny_model(tmp_path, arch, seed=9, tokenizer=False, moe_intermediate=64,
                           std=0.1)
    prompt = np.arange(3, 40) * 11 % 500
    runs = {}
    for mode in ("fused", "standalone"):
        engine = Engine.from_dir(path, backend="cupy", placement="cpu", cpu_workers=1,
                                 qfuse=mode, max_slots=1, max_len=TOKENS + 64,
                                 cpu_dispatch=dispatch)
        try:
            assert engine.model.moe_norm is not None
            tokens = engine.generate(prompt, params=SamplingParams(temperature=0),
                                     max_tokens=TOKENS)
            logits = engine.score(np.concatenate([prompt, tokens])[:POSITIONS])
        finally:
            engine.close()
        runs[mode] = (tokens, logits)
    (t1, l1), (t2, l2) = runs["fused"], runs["standalone"]
    assert len(t1) == TOKENS and t1 == t2
    assert l1.shape == (POSITIONS, 512)
    assert l1.tobytes() == l2.tobytes()
    assert len(set(t1)) > 5  # not a degenerate constant stream


@pytest.mark.parametrize("dispatch", ["sync", "launched"])
def test_non_finite_activations_fail_the_step_and_the_next_one_runs(tmp_path, dispatch):
    """The fused quantizer flags inf/nan on the device (no host sync per layer); the step's
    end raises NonFiniteActivation, and the flag does not leak into the next step."""
    from cpu_experts.quant import NonFiniteActivation

    path = make_tiny_model(tmp_path, "qwen3_moe", seed=9, tokenizer=False, moe_intermediate=64,
                           std=0.1)
    engine = Engine.from_dir(path, backend="cupy", placement="cpu", cpu_workers=1,
                             qfuse="fused", max_slots=2, max_len=64, cpu_dispatch=dispatch)
    try:
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
