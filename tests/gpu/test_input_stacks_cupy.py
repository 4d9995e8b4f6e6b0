"""Matrices that read the same rows stacked in one on CuPy (gpu_worker/model/model.py
``stack_inputs``): a MoE layer's router and shared-expert projections, attention's q/k/v,
Gated DeltaNet's input projections (in_proj_qkvz regrouped into the conv's input and z
first; a gated q_proj into query and gate). One launch each, the bits of separate products,
no extra memory, and the floor's byte counts unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.backend import to_numpy
from gpu_worker.kernels.bf16 import BF16
from gpu_worker.loader import load_checkpoint
from gpu_worker.model import model as model_module
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import INPUT_STACKS, Model
from gpu_worker.weights.stream import resident_bytes
from scripts.step_floor import dense_read_bytes
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")
# the blocks each architecture stacks (Qwen3-MoE: no shared expert, no Gated DeltaNet)
STACKED = {"qwen3_moe": {"self_attn."},
           "qwen3_next": {"mlp.", "self_attn.", "linear_attn."}}


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")


@pytest.fixture(scope="module", params=sorted(STACKED))
def ckpt(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=3, tokenizer=False)
    return request.param, load_checkpoint(path, dtype=np.float32)


def _logits(model: Model) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.cfg.vocab_size, size=n) for n in (6, 3)]
    caches = model.new_caches(2, 32)
    first = model.forward(RaggedBatch.build([(s, 0, p) for s, p in enumerate(prompts)]), caches)
    step = model.forward(RaggedBatch.build([(s, len(p), np.array([5 + s]))
                                            for s, p in enumerate(prompts)]), caches)
    return to_numpy(first.logits).tobytes(), to_numpy(step.logits).tobytes()


def _blocks(layer) -> dict[str, dict]:
    return {"mlp.": layer.mlp, "self_attn.": layer.attn, "linear_attn.": layer.attn}


def test_stacks_give_the_separate_products_bits_and_hold_them_once(ckpt, monkeypatch):
    arch, ck = ckpt
    stacked = Model(ck.config, ck.tensors, xp=cupy, dtype=BF16)
    monkeypatch.setattr(model_module, "stack_inputs", lambda xp, w, cfg: None)
    plain = Model(ck.config, ck.tensors, xp=cupy, dtype=BF16)
    seen = set()
    for layer in stacked.layers:
        for block, stack_name, parts in INPUT_STACKS:
            d = _blocks(layer)[block]
            if stack_name not in d or parts[0] not in d:
                continue
            seen.add(block)
            stack, start = d[stack_name], 0  # the parts are views into it, in order
            for name in parts:
                assert d[name].data.ptr == (stack.data.ptr
                                            + start * stack.shape[1] * stack.itemsize)
                start += d[name].shape[0]
            assert start == stack.shape[0]
    assert seen == STACKED[arch]
    full = [la for la in stacked.layers if la.full]
    assert all(("q_query.weight" in la.attn) == ck.config.gated_attention for la in full)
    assert not any(model_module.is_stack(k) for layer in plain.layers
                   for k in [*layer.attn, *layer.mlp])
    assert _logits(stacked) == _logits(plain)
    assert resident_bytes(stacked) == resident_bytes(plain)
    assert dense_read_bytes(stacked, 3) == dense_read_bytes(plain, 3)


def test_parts_that_differ_in_dtype_or_have_a_bias_stay_apart(ckpt):
    _, ck = ckpt
    w = {k: cupy.asarray(v) for k, v in ck.tensors.items() if k.startswith("model.layers.")}
    for q in [k for k in w if k.endswith("q_proj.weight")]:
        w[q.replace(".weight", ".bias")] = cupy.zeros(w[q].shape[0], w[q].dtype)
    others = [k for k in w if k.endswith(("in_proj_ba.weight", "shared_expert_gate.weight"))]
    for k in others:
        w[k] = w[k].astype(cupy.float64)
    model_module.stack_inputs(cupy, w, ck.config)
    assert not any(model_module.is_stack(k) for k in w)


def test_regrouped_gdn_rows_without_a_stack_give_the_same_bits(ckpt, monkeypatch):
    """in_proj_qkvz regrouped (in_proj_mixed, in_proj_z) but left apart from in_proj_ba:
    three products, the bits of the unregrouped path."""
    arch, ck = ckpt
    if arch != "qwen3_next":
        pytest.skip("no Gated DeltaNet layers")
    apart = tuple(g for g in INPUT_STACKS if g[0] != "linear_attn.")
    monkeypatch.setattr(model_module, "INPUT_STACKS", apart)
    regrouped = Model(ck.config, ck.tensors, xp=cupy, dtype=BF16)
    gdn_layers = [la for la in regrouped.layers if not la.full]
    assert gdn_layers and all("in_proj_mixed.weight" in la.attn and "in_proj_qkvz.weight"
                              not in la.attn for la in gdn_layers)
    monkeypatch.setattr(model_module, "stack_inputs", lambda xp, w, cfg: None)
    plain = Model(ck.config, ck.tensors, xp=cupy, dtype=BF16)
    assert _logits(regrouped) == _logits(plain)
    assert resident_bytes(regrouped) == resident_bytes(plain)
