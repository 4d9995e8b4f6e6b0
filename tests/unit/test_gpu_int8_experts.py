"""Routed experts held on the backend as int8 blocks of 32 (``[experts] gpu_format = "int8"``,
gpu_worker/kernels/int8_stack.py): the stacks hold the CPU experts' int8 bytes, a model loaded
so computes exactly what the same model with those values as float weights computes, serving
with speculation gives plain decoding's tokens, and the config and memory plan know the
format."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cpu_experts.quant import quantize_ref
from daemon.config import REPO_ROOT, ConfigError, ExpertsSection
from gpu_worker.engine import Engine, load_model
from gpu_worker.kernels.int8_stack import Int8Stack, quantize_stack
from gpu_worker.memory_plan import PlanError, describe, plan_memory
from gpu_worker.model_config import ModelConfig
from protocol.worker_config import WorkerConfig
from scripts.tiny_model import make_tiny_model
from tests.unit.test_cpu_int4_model import _serve

IDS = np.arange(3, 40) * 7 % 500


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def tiny(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=5, tokenizer=False)


def test_stack_is_the_cpu_rule_and_its_values_are_exact():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 5, 96)) * np.exp(rng.uniform(-8, 3, (3, 5, 96)))).astype(
        np.float32)
    s = quantize_stack(w)
    q, d = quantize_ref(w.reshape(-1, 96))
    assert s.q.tobytes() == q.tobytes() and s.d.tobytes() == d.view(np.uint16).tobytes()
    exact = s.q.astype(np.float64).reshape(3, 5, 3, 32) * d.astype(np.float64).reshape(
        3, 5, 3, 1)
    assert s.values().astype(np.float64).tobytes() == exact.reshape(w.shape).tobytes()
    assert s.nbytes == w.size + 2 * w.size // 32
    assert np.array_equal(s.expert(1, np.float64), s.values()[1])
    assert np.abs(s.values() - w).max() <= np.abs(w).max() / 127
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_stack(w[..., :40])
    w[1, 2, 3] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        quantize_stack(w)
    with pytest.raises(ValueError, match="uint16"):
        Int8Stack(s.q, s.d.astype(np.int32))


def test_model_equals_float_model_of_the_int8_values(tiny):
    """Float64 NumPy: a model loaded with gpu_format int8 holds Int8Stacks and scores exactly
    as the float64 model whose experts are the stacks' values; it differs from the float
    model (the format reached the experts) by about int8's rounding."""
    model, _ = load_model(tiny, dtype="float64", gpu_format="int8")
    ref, _ = load_model(tiny, dtype="float64")
    plain = Engine(ref, max_slots=1, max_len=64).score(IDS)
    n = 0
    pairs = list(zip(model.layers, ref.layers, strict=True))
    if model.mtp_layer is not None:
        pairs.append((model.mtp_layer, ref.mtp_layer))
    for layer, ref_layer in pairs:
        for k, a in layer.mlp.items():
            if k.startswith("experts."):
                assert isinstance(a, Int8Stack)
                assert a.q.tobytes() == quantize_stack(ref_layer.mlp[k]).q.tobytes()
                ref_layer.mlp[k] = a.values().astype(np.float64)
                n += 1
    assert n >= 3
    got = Engine(model, max_slots=1, max_len=64).score(IDS)
    assert got.tobytes() == Engine(ref, max_slots=1, max_len=64).score(IDS).tobytes()
    err = float(np.abs(got - plain).max() / np.abs(plain).max())
    assert 0 < err < 0.05, err


def test_split_int8_gpu_and_speculation_stay_exact(tiny):
    """Split placement (int8 on the backend, int8 on a CPU worker): serving with wide and
    narrow speculation gives plain decoding's tokens."""
    model, experts = load_model(tiny, dtype="float64", placement="split",
                                cpu_experts_per_layer=3, cpu_workers=1, gpu_format="int8")
    try:
        assert isinstance(model.layers[-1].mlp["experts.gate_proj"], Int8Stack)
        plain = _serve(model, experts, "off")
        assert _serve(model, experts, "wide") == plain
        assert _serve(model, experts, "narrow") == plain
    finally:
        experts.close()


def test_config_and_memory_plan_know_the_format(tiny):
    assert ExpertsSection(gpu_format="int8").gpu_format == "int8"
    with pytest.raises(ConfigError, match="gpu_format"):
        ExpertsSection(gpu_format="int4")
    with pytest.raises(ValueError, match="gpu_format"):
        WorkerConfig(run_dir="/tmp", model=str(tiny), gpu_format="fp8")
    with pytest.raises(ValueError, match="gpu_format"):
        load_model(tiny, gpu_format="int4")
    cfg = ModelConfig.from_file(REPO_ROOT / "configs/models/qwen3-next-80b-a3b.json")
    budget = 40 * 2**30
    plans = {f: plan_memory(cfg, gpu_budget_bytes=budget, host_available_bytes=None,
                            gpu_format=f) for f in ("model", "int8")}
    weights = 3 * cfg.moe_intermediate_size * cfg.hidden_size
    assert plans["int8"].gpu_bytes_per_expert * 32 == weights * 34
    assert plans["model"].gpu_bytes_per_expert == weights * 2
    assert plans["int8"].experts_gpu_per_layer > 1.8 * plans["model"].experts_gpu_per_layer
    assert any("int8" in line for line in describe(plans["int8"]))
    odd = dataclasses.replace(cfg, moe_intermediate_size=500)
    with pytest.raises(PlanError, match="gpu_format"):
        plan_memory(odd, gpu_budget_bytes=budget, host_available_bytes=None, gpu_format="int8")
