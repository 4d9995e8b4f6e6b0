"""The load's threads change nothing: a bf16 split load of a synthetic model on 4 threads,
in runs of one expert, holds exactly the bytes of a one-thread load (backend weights and the
CPU workers' shards); the threaded bf16 rounding equals ml_dtypes' bit for bit; the
synthetic source's float32 fast path gives the float64 path's values."""

from __future__ import annotations

import numpy as np

from gpu_worker.engine import load_model
from gpu_worker.kernels.bf16 import BF16, round_into, to_bf16
from gpu_worker.weights import stream
from gpu_worker.weights.synthetic import SyntheticSource
from tests.unit.test_synthetic import _config


def _load(monkeypatch, threads: int) -> tuple[dict[str, bytes], dict[int, bytes]]:
    monkeypatch.setattr(stream, "default_threads", lambda: threads)
    cfg = _config("qwen3_next")
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    model, experts = load_model(SyntheticSource(cfg, seed=5), dtype="bfloat16",
                                placement="split", cpu_experts_per_layer=cfg.num_experts // 2,
                                cpu_workers=1, chunk_bytes=per_expert, log=lambda *a, **f: None)
    try:
        mlp = {f"{i}.{k}": np.asarray(v).tobytes() for i, layer in enumerate(model.layers)
               for k, v in layer.mlp.items()}
        cpu = {i: layer.canonical().gate_q.tobytes() + layer.canonical().down_s.tobytes()
               for i, layer in experts.pool.layers.items()}
    finally:
        experts.close()
    return mlp, cpu


def test_threaded_load_is_byte_identical(monkeypatch):
    mlp1, cpu1 = _load(monkeypatch, 1)
    mlp4, cpu4 = _load(monkeypatch, 4)
    assert any(k.endswith("experts.up_proj") for k in mlp1)  # GPU experts compared too
    assert mlp4 == mlp1
    assert cpu1 and cpu4 == cpu1


def test_round_into_equals_ml_dtypes_on_every_kind_of_value():
    rng = np.random.default_rng(0)
    u = rng.integers(0, 2**32, 3 * 2**20 + 7, dtype=np.uint32)  # 4 chunks, the last partial
    u[:10] = [0x7F800001, 0x7FFFFFFF, 0xFFC00001, 0x7FBFFFFF, 0x7F7FFFFF,  # NaNs, max
              0xFF7FFFFF, 0x00008000, 0x00018000, 0x7F800000, 0x3F808000]  # ties, inf
    x = u.view(np.float32)
    with np.errstate(invalid="ignore"):
        want = x.astype(BF16).view(np.uint16)
    for threads in (1, 3):
        got = np.empty(x.shape, np.uint16)
        round_into(x, got, threads)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(to_bf16(x[:-7].reshape(3, -1)).view(np.uint16).reshape(-1),
                                  want[:-7])
    with np.errstate(invalid="ignore"):  # the NaNs above, cast by ml_dtypes
        assert to_bf16(x.astype(np.float64)[:100]).dtype == BF16  # other dtypes: ml_dtypes


def test_synthetic_float32_fast_path_equals_the_float64_path():
    src = SyntheticSource(_config("qwen3_moe"), seed=2)
    for name in ("model.layers.1.mlp.experts.down_proj", "model.embed_tokens.weight"):
        f32 = src.read(name, np.float32)
        assert f32.std() > 0
        np.testing.assert_array_equal(f32, src.read(name, np.float64).astype(np.float32))
