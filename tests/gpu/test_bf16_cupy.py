"""bf16 weights on the CuPy backend (uint16 bits, docs/bf16.md) against the NumPy float32
reference, both architectures; the grouped expert kernels' bf16 variant; batch invariance."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.config_sections import DEFAULT_MODEL
from gpu_worker.backend import to_numpy
from gpu_worker.engine import Engine, load_model
from gpu_worker.kernels.bf16 import BF16, BITS, widen_reference
from gpu_worker.loader import load_checkpoint
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from gpu_worker.model.moe import experts_local
from gpu_worker.model.ops import Ops
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model
from tests.unit.test_bf16 import PROMPTS, TOKENS, _prompts, _rounded, check_unrounded, num_matrices

cupy = pytest.importorskip("cupy")

GREEDY = SamplingParams(temperature=0)
F32_TOL = 1e-4  # CuPy vs NumPy float32: summation order only, relative to max |logits|


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next"])
def ckpt(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=1, tokenizer=False)
    return load_checkpoint(path, dtype=np.float32)


def _engine(ckpt, tensors, dtype, xp, *, exact: bool = False) -> Engine:
    return Engine(Model(ckpt.config, tensors, xp=xp, dtype=dtype, exact=exact), max_slots=4,
                  max_len=128)


def test_widening_is_exact_for_every_bit_pattern():
    from gpu_worker.kernels.bf16 import widen

    bits = np.arange(1 << 16, dtype=np.uint16)  # zeros, subnormals, inf, nan included
    got = cupy.asnumpy(widen(cupy.asarray(bits)))
    assert got.dtype == np.float32
    assert got.tobytes() == widen_reference(bits).tobytes()


def test_grouped_kernels_read_bf16_weights():
    from gpu_worker.kernels.moe_experts import experts_grouped

    E, I, H, R, k = 12, 96, 160, 16, 8  # I, H not multiples of 32: the warps' tails
    rng = np.random.default_rng(1)
    stacks = [(rng.standard_normal(s) * 0.1).astype(BF16) for s in ((E, I, H), (E, I, H),
                                                                    (E, H, I))]
    x = rng.standard_normal((R, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(R)])
    ids[rng.random((R, k)) < 0.25] = -1
    w = rng.random((R, k)).astype(np.float32)
    xg, idg, wg = cupy.asarray(x), cupy.asarray(ids), cupy.asarray(w)
    bits = [cupy.asarray(s.view(np.uint16)) for s in stacks]
    f32 = [cupy.asarray(s.astype(np.float32)) for s in stacks]
    got = experts_grouped(xg, idg, wg, *bits)
    # the same float32 arithmetic as float32 weights holding the same values
    assert cupy.asnumpy(got).tobytes() == cupy.asnumpy(experts_grouped(xg, idg, wg, *f32)).tobytes()
    want = experts_local(Ops(np, np.float64), *(s.astype(np.float64) for s in stacks), x, ids, w)
    np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=0, atol=2e-5 * np.abs(want).max())
    for r in range(R):  # a row's bits do not depend on its batch
        alone = experts_grouped(xg[r:r + 1], idg[r:r + 1], wg[r:r + 1], *bits)
        assert cupy.asnumpy(alone).tobytes() == cupy.asnumpy(got[r:r + 1]).tobytes()


def test_cupy_bf16_against_the_numpy_float32_reference(ckpt):
    """Rounded weights: float32 agreement (and bit-equality with CuPy float32); unrounded:
    the first-order bound, near-tie flips only, and the count of equal greedy prompts."""
    rounded = _rounded(ckpt.tensors)
    gpu = _engine(ckpt, ckpt.tensors, BF16, cupy)
    assert gpu.model.embed.dtype == BITS and gpu.model.final_norm.dtype == np.float32
    gpu_f32 = _engine(ckpt, rounded, np.float32, cupy)
    ref_rounded = _engine(ckpt, rounded, np.float32, np)
    ref = _engine(ckpt, ckpt.tensors, np.float32, np)
    n_matrices = num_matrices(ckpt.tensors)
    equal_rounded = equal = agree = positions = 0
    for prompt in _prompts(ckpt.config.vocab_size):
        want = ref.generate(prompt, params=GREEDY, max_tokens=TOKENS)
        got = gpu.generate(prompt, params=GREEDY, max_tokens=TOKENS)
        equal += got == want
        equal_rounded += got == ref_rounded.generate(prompt, params=GREEDY, max_tokens=TOKENS)
        seq = np.concatenate([prompt, want])
        z = gpu.score(seq)[len(prompt) - 1:]  # [65, V]
        assert z.tobytes() == gpu_f32.score(seq)[len(prompt) - 1:].tobytes()
        z_rounded = ref_rounded.score(seq)[len(prompt) - 1:]
        np.testing.assert_allclose(z, z_rounded, rtol=0, atol=F32_TOL * np.abs(z_rounded).max())
        same = check_unrounded(z, ref.score(seq)[len(prompt) - 1:], n_matrices)
        agree, positions = agree + same.sum(), positions + same.size
    print(f"{ckpt.config.arch}: CuPy bf16 vs NumPy float32: {equal}/{PROMPTS} prompts equal "
          f"over {TOKENS} greedy tokens (rounded weights: {equal_rounded}/{PROMPTS}); "
          f"teacher-forced agreement {agree}/{positions}")
    assert equal_rounded >= PROMPTS - 1
    assert agree >= 0.97 * positions and equal >= PROMPTS // 4


def test_a_rows_logits_alone_equal_its_logits_in_a_batch(ckpt):
    """exact=True (row-at-a-time matrix products) in bf16 on CuPy, the grouped expert kernels
    for the routed experts: a row's bits do not depend on the rest of its batch."""
    model = Model(ckpt.config, ckpt.tensors, xp=cupy, dtype=BF16, exact=True)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, ckpt.config.vocab_size, size=n) for n in (9, 4, 13)]
    nxt = [np.array([int(t)]) for t in rng.integers(0, ckpt.config.vocab_size, size=3)]
    caches = model.new_caches(3, 64)
    first = model.forward(RaggedBatch.build([(s, 0, p) for s, p in enumerate(prompts)]),
                          caches)
    step = model.forward(RaggedBatch.build([(s, len(p), nxt[s])
                                            for s, p in enumerate(prompts)]), caches)
    for s, p in enumerate(prompts):
        alone = model.new_caches(3, 64)
        a = model.forward(RaggedBatch.build([(s, 0, p)]), alone)
        b = model.forward(RaggedBatch.build([(s, len(p), nxt[s])]), alone)
        assert to_numpy(a.logits).tobytes() == to_numpy(first.logits[s:s + 1]).tobytes(), s
        assert to_numpy(b.logits).tobytes() == to_numpy(step.logits[s:s + 1]).tobytes(), s


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_a_bf16_checkpoint_with_cpu_experts_gives_float32_bits(tmp_path, arch):
    """split placement on CuPy (QFUSE norm, launched path): the bf16 model of a bf16
    checkpoint gives the float32 model's bits, GPU and CPU experts alike."""
    path = make_tiny_model(tmp_path, arch, seed=2, tokenizer=False, dtype="bfloat16")
    ids = np.arange(3, 30) * 7 % 500
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine.from_dir(path, dtype=dtype, backend="cupy", placement="split",
                                 cpu_experts_per_layer=4, cpu_workers=1, max_slots=1,
                                 max_len=64)
        try:
            logits[dtype] = engine.score(ids)
        finally:
            engine.close()
    assert logits["bfloat16"].tobytes() == logits["float32"].tobytes()


def test_the_trained_qwen3_next_gives_the_float32_tokens_in_bf16():
    """The embedded model (a trained Qwen3-Next, a bf16 checkpoint like every Qwen3 release):
    CuPy bf16 against the NumPy float32 reference, 64 free-running greedy tokens from each
    of 16 prompts. Trained logits are not flat, so near-ties (docs/bf16.md) are rare."""
    ref = Engine(load_model(DEFAULT_MODEL, dtype="float32")[0], max_slots=1, max_len=160)
    gpu = Engine(load_model(DEFAULT_MODEL, backend="cupy", dtype="bfloat16")[0], max_slots=1,
                 max_len=160)
    equal = sum(gpu.generate(p, params=GREEDY, max_tokens=TOKENS)
                == ref.generate(p, params=GREEDY, max_tokens=TOKENS)
                for p in _prompts(ref.model.cfg.vocab_size, seed=3))
    print(f"embedded Qwen3-Next: {equal}/{PROMPTS} prompts equal over {TOKENS} greedy tokens")
    assert equal >= PROMPTS - 1
