"""bf16 weights with float32 compute (docs/bf16.md) on the NumPy backend, both architectures.

Three claims, each against the float32 model as the reference:
* on the bf16-ROUNDED weights the float32 model gives the bf16 model's bits exactly (widening
  bf16 -> float32 is exact and the arithmetic after it is the same), so a bf16 checkpoint is
  served identically in float32 and in bf16, CPU experts included;
* against the unrounded float32 weights the logits move by at most
  ``n_matrices * 2^-8 * max|logits|`` (each matrix on a token's path perturbed by <= 2^-8);
* greedy decoding of 64 tokens: the argmax differs only at near-ties (teacher-forced), and
  the count of prompts whose 64 free-running tokens are all equal is reported.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from daemon.config_sections import DEFAULT_MODEL, ModelSection
from gpu_worker.engine import Engine, load_model
from gpu_worker.kernels.bf16 import BF16, UNIT_ROUNDOFF, widen_reference
from gpu_worker.loader import load_checkpoint
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from gpu_worker.model.ops import Ops, is_matrix
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model

ARCHS = ["qwen3_moe", "qwen3_next"]
GREEDY = SamplingParams(temperature=0)
PROMPTS, TOKENS = 16, 64


def _prompts(vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(4, 24))) for _ in range(PROMPTS)]


def _rounded(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32 tensors holding exactly the values a bf16 model stores."""
    return {k: v.astype(BF16).astype(np.float32) if is_matrix(k, v.shape) else v
            for k, v in tensors.items()}


def num_matrices(tensors: dict[str, np.ndarray]) -> int:
    """The weight matrices a token's path can pass through (the MTP head's aside)."""
    return sum(is_matrix(k, v.shape) for k, v in tensors.items() if not k.startswith("mtp."))


def check_unrounded(z: np.ndarray, z_ref: np.ndarray, n_matrices: int) -> np.ndarray:
    """bf16 logits ``z`` [T, V] against the unrounded float32 model's ``z_ref``: within
    ``n_matrices * u * max|z_ref|`` per row, argmax flips only where the reference's top-two
    gap is below twice that. Returns the rows whose argmax agrees [T] (bool)."""
    bound = n_matrices * UNIT_ROUNDOFF * np.abs(z_ref).max(axis=1)  # [T]
    assert (np.abs(z - z_ref).max(axis=1) <= bound).all()
    assert np.abs(z - z_ref).max() > 0  # the weights did change
    top2 = np.sort(z_ref, axis=1)[:, -2:]
    same = z.argmax(axis=1) == z_ref.argmax(axis=1)
    assert (top2[~same, 1] - top2[~same, 0] <= 2 * bound[~same]).all()  # a near-tie
    return same


def _engine(ckpt, tensors, dtype) -> Engine:
    return Engine(Model(ckpt.config, tensors, dtype=dtype), max_slots=2, max_len=128)


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=1, tokenizer=False)
    return load_checkpoint(path, dtype=np.float32)


def test_rounding_error_is_at_most_the_unit_roundoff():
    w = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    rel = np.abs(w.astype(BF16).astype(np.float32) - w) / np.abs(w)
    assert rel.max() <= UNIT_ROUNDOFF and rel.max() > UNIT_ROUNDOFF / 2  # 2^-8, attained
    bits = w.astype(BF16).view(np.uint16)
    assert widen_reference(bits).tobytes() == w.astype(BF16).astype(np.float32).tobytes()


def test_matrices_are_stored_in_bf16_and_the_rest_in_float32(ckpt):
    model = Model(ckpt.config, ckpt.tensors, dtype=ml_dtypes.bfloat16)
    assert model.ops.dtype == np.float32 and model.ops.bf16
    assert model.embed.dtype == BF16 and model.lm_head.dtype == BF16
    assert model.final_norm.dtype == np.float32
    for layer in model.layers:
        assert layer.input_norm.dtype == layer.post_norm.dtype == np.float32
        for name, w in {**layer.attn, **layer.mlp}.items():
            want = BF16 if w.ndim == 2 or name.startswith("experts.") else np.float32
            assert w.dtype == want, name
    small = [layer.attn[k] for layer in model.layers if not layer.full
             for k in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")]  # Qwen3-Next
    assert len(small) == 4 * len(ckpt.config.linear_attention_layers)
    assert all(w.dtype == np.float32 for w in small)
    if model.mtp is not None:
        assert model.mtp["fc.weight"].dtype == BF16
        assert model.mtp["norm.weight"].dtype == np.float32
    caches = model.new_caches(1, 16)
    assert caches.kv.k.dtype == np.float32  # KV and GDN states in the compute dtype


def test_weight_takes_bf16_host_arrays_and_refuses_raw_bits():
    ops = Ops(np, ml_dtypes.bfloat16)
    w = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    stored = ops.weight("x.weight", w)
    assert stored.tobytes() == ops.weight("x.weight", w.astype(BF16)).tobytes()
    assert ops.up(stored).tobytes() == w.astype(BF16).astype(np.float32).tobytes()
    assert ops.weight("n.weight", w[0].astype(BF16)).dtype == np.float32  # a vector
    f32 = Ops(np, np.float32).weight("x.weight", w.astype(BF16))  # a bf16 source, exactly
    assert f32.dtype == np.float32 and f32.tobytes() == ops.up(stored).tobytes()
    with pytest.raises(TypeError, match="x.weight: weights come as floats"):
        ops.weight("x.weight", w.astype(BF16).view(np.uint16))


def test_bf16_equals_float32_on_the_rounded_weights_bit_for_bit(ckpt):
    rounded = _rounded(ckpt.tensors)
    outs = []
    for tensors, dtype in ((rounded, np.float32), (ckpt.tensors, BF16)):
        model = Model(ckpt.config, tensors, dtype=dtype)
        caches = model.new_caches(2, 64)
        ids = np.arange(1, 30) * 7 % ckpt.config.vocab_size
        first = model.forward(RaggedBatch.build([(0, 0, ids[:12]), (1, 0, ids[3:8])]), caches,
                              np.arange(17))
        step = model.forward(RaggedBatch.build([(0, 12, ids[12:13]), (1, 5, ids[8:9])]),
                             caches)
        outs.append([first.logits, step.logits, first.hidden])
        if model.mtp is not None:
            mtp = model.mtp_forward(RaggedBatch.build([(0, 0, ids[1:13])]), first.hidden[:12],
                                    caches)
            outs[-1].append(mtp.logits)
    for want, got in zip(*outs, strict=True):
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes()
    ref, bf16 = _engine(ckpt, rounded, np.float32), _engine(ckpt, ckpt.tensors, BF16)
    for prompt in _prompts(ckpt.config.vocab_size)[:4]:
        want = ref.generate(prompt, params=GREEDY, max_tokens=TOKENS)
        assert bf16.generate(prompt, params=GREEDY, max_tokens=TOKENS) == want


def test_against_the_unrounded_float32_model(ckpt):
    """The looser check: logits within the first-order bound, argmax flips only at
    near-ties, and how many prompts keep all 64 greedy tokens (see docs/bf16.md)."""
    n_matrices = num_matrices(ckpt.tensors)
    ref, bf16 = _engine(ckpt, ckpt.tensors, np.float32), _engine(ckpt, ckpt.tensors, BF16)
    equal = agree = positions = 0
    for prompt in _prompts(ckpt.config.vocab_size):
        want = ref.generate(prompt, params=GREEDY, max_tokens=TOKENS)
        equal += bf16.generate(prompt, params=GREEDY, max_tokens=TOKENS) == want
        seq = np.concatenate([prompt, want])
        z_ref = ref.score(seq)[len(prompt) - 1:]  # [65, V]: the rows that chose the tokens
        z = bf16.score(seq)[len(prompt) - 1:]
        same = check_unrounded(z, z_ref, n_matrices)
        agree, positions = agree + same.sum(), positions + same.size
    print(f"{ckpt.config.arch}: {equal}/{PROMPTS} prompts equal over {TOKENS} greedy "
          f"tokens; teacher-forced argmax agreement {agree}/{positions}")
    assert agree >= 0.97 * positions
    assert equal >= PROMPTS // 4


@pytest.mark.parametrize("arch", ARCHS)
def test_a_bf16_checkpoint_is_served_identically_cpu_experts_included(tmp_path, arch):
    path = make_tiny_model(tmp_path, arch, seed=2, tokenizer=False, dtype="bfloat16")
    ids = np.arange(3, 30) * 7 % 500
    logits = {}
    for dtype in ("float32", "bfloat16"):
        model, _ = load_model(path, dtype=dtype)
        logits[dtype, "gpu"] = Engine(model, max_slots=1, max_len=64).score(ids)
        engine = Engine.from_dir(path, dtype=dtype, placement="split", cpu_experts_per_layer=4,
                                 cpu_workers=1, max_slots=1, max_len=64)
        try:
            logits[dtype, "split"] = engine.score(ids)
        finally:
            engine.close()
    for where in ("gpu", "split"):
        assert logits["bfloat16", where].tobytes() == logits["float32", where].tobytes()
    assert not np.array_equal(logits["float32", "gpu"], logits["float32", "split"])  # int8


def test_the_embedded_bf16_model_is_served_identically():
    ids = np.arange(5, 60) * 37 % 8000
    logits = [Engine(load_model(DEFAULT_MODEL, dtype=dtype)[0], max_slots=1, max_len=64)
              .score(ids) for dtype in ("float32", "bfloat16")]
    assert logits[0].tobytes() == logits[1].tobytes()


def test_bfloat16_is_the_default_dtype_on_cupy_only():
    assert ModelSection(backend="cupy").dtype == "bfloat16"
    assert ModelSection().dtype == "float32"
    assert ModelSection(backend="cupy", dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model("/nonexistent", dtype="float16")
