"""A MoE layer's router and shared-expert projections stacked in one matrix on CuPy
(gpu_worker/model/model.py ``stack_moe_inputs``): one launch, the bits of four, no extra
memory, and the floor's byte counts unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.backend import to_numpy
from gpu_worker.kernels.bf16 import BF16
from gpu_worker.loader import load_checkpoint
from gpu_worker.model import model as model_module
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from gpu_worker.model.moe import IN_STACK, IN_STACK_PARTS
from gpu_worker.weights.stream import resident_bytes
from scripts.step_floor import dense_read_bytes
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=3, tokenizer=False)
    return load_checkpoint(path, dtype=np.float32)


def _logits(model: Model) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.cfg.vocab_size, size=n) for n in (6, 3)]
    caches = model.new_caches(2, 32)
    first = model.forward(RaggedBatch.build([(s, 0, p) for s, p in enumerate(prompts)]), caches)
    step = model.forward(RaggedBatch.build([(s, len(p), np.array([5 + s]))
                                            for s, p in enumerate(prompts)]), caches)
    return to_numpy(first.logits).tobytes(), to_numpy(step.logits).tobytes()


def test_the_stack_gives_the_four_products_bits_and_holds_them_once(ckpt, monkeypatch):
    stacked = Model(ckpt.config, ckpt.tensors, xp=cupy, dtype=BF16)
    monkeypatch.setattr(model_module, "stack_moe_inputs", lambda xp, w: None)
    plain = Model(ckpt.config, ckpt.tensors, xp=cupy, dtype=BF16)
    sparse = [layer for layer in stacked.layers if layer.sparse]
    assert sparse and all(IN_STACK in layer.mlp for layer in sparse)
    assert not any(IN_STACK in layer.mlp for layer in plain.layers)
    for layer in sparse:  # the four names are views into the stack, in order
        stack, start = layer.mlp[IN_STACK], 0
        for name in IN_STACK_PARTS:
            part = layer.mlp[name]
            assert part.data.ptr == stack.data.ptr + start * stack.shape[1] * stack.itemsize
            start += part.shape[0]
        assert start == stack.shape[0]
    assert _logits(stacked) == _logits(plain)
    assert resident_bytes(stacked) == resident_bytes(plain)
    assert dense_read_bytes(stacked, 3) == dense_read_bytes(plain, 3)


def test_parts_that_differ_in_dtype_stay_apart(ckpt):
    tensors = dict(ckpt.tensors)
    key = next(k for k in tensors if k.endswith("mlp.shared_expert_gate.weight"))
    w = {k: cupy.asarray(v) for k, v in tensors.items() if k.startswith(key[:-len(
        "shared_expert_gate.weight")])}
    w[key] = w[key].astype(cupy.float64)
    model_module.stack_moe_inputs(cupy, w)
    assert not any(k.endswith(IN_STACK) for k in w)
