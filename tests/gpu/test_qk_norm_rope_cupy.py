"""Attention's q/k norm and RoPE in one launch (gpu_worker/kernels/qk_norm_rope.py) on the
device: q and k bytes equal to the four launches it replaces (rms_norm_rows, then rope, of
each) and to their NumPy formulas, over head dims 64-256, full and partial rotary, plain and
zero-centred norms, GQA groups, large positions and strided heads; Ops.qk_norm_rope taking it
only where it should; whole-model logits bytes unchanged; and, on the CPU emulator, the
launches an attention layer makes. A failure says in one line what differs."""

from __future__ import annotations

import numpy as np
import pytest

import gpu_worker.model.ops as ops_module
from gpu_worker.kernels.fused_norm import rms_norm_rows
from gpu_worker.kernels.fused_rope import rope
from gpu_worker.kernels.qk_norm_rope import MAX_DIM, fits, qk_norm_rope, qk_norm_rope_reference
from gpu_worker.model.ops import Ops
from tests.gpu.bits import assert_same_bits as _same

cupy = pytest.importorskip("cupy")

EPS = 1e-6
# R, Hq, Hkv, hd, rot, zero_centered
CASES = [(1, 16, 2, 256, 64, True),  # the 80B's attention (Qwen3-Next): a quarter rotated
         (5, 32, 4, 128, 128, False),  # Qwen3-MoE: full rotary, groups of 8
         (3, 8, 8, 64, 64, False),  # Hq == Hkv
         (7, 4, 1, 64, 32, True),  # half rotated: partners 16 lanes away
         (2, 3, 1, 256, 256, False),  # full rotary of 256: partners 4 registers away
         (37, 2, 1, 100, 20, True),  # hd not a multiple of 32, rot / 2 = 10; partial blocks
         (4, 2, 2, 32, 2, False),  # the smallest rot
         (2, 4, 2, 16, 4, True)]  # the tiny Qwen3-Next's heads
POSITIONS = np.array([0, 1, 2, 17, 4095, 32767, 131071, 1_000_000, 2 ** 24 + 3, 262_143])


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    """The model takes the kernels under test (gpu_worker/kernels/enabled.py)."""
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")


def _heads(rng, R: int, H: int, hd: int) -> np.ndarray:
    """[R, H, hd] with a zero head (d = sqrt(eps)), a large one, subnormals and signed zeros."""
    x = rng.standard_normal((R, H, hd)).astype(np.float32)
    flat = x.reshape(-1, hd)
    if len(flat) > 3:
        flat[1] = 0.0
        flat[2] *= 1e3
        flat[3, :4] = [1e-39, -3e-40, -0.0, 1e-30][: min(hd, 4)]
    flat[0, :2] = [-1e-45, 0.0][: min(hd, 2)]
    return x


def _tables(R: int, rot: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [R, rot] float32 at positions up to 2^24 and past (Ops.rope_tables)."""
    pos = np.resize(POSITIONS, R)
    return Ops(np, np.float32).rope_tables(pos, rot, theta)


def _inputs(case, seed: int = 0):
    R, hq, hkv, hd, rot, zc = case
    rng = np.random.default_rng(seed + R * hq + hd + rot)
    q, k = _heads(rng, R, hq, hd), _heads(rng, R, hkv, hd)
    qw, kw = ((0.1 * rng.standard_normal(hd) + (0.0 if zc else 1.0)).astype(np.float32)
              for _ in range(2))
    cos, sin = _tables(R, rot, 1e7 if zc else 1e6)
    return q, k, qw, kw, cos, sin


def _dev(*arrays):
    return tuple(cupy.asarray(a) for a in arrays)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "R{}_q{}_kv{}_hd{}_rot{}_{}".format(
    *c[:5], "zc" if c[5] else "plain"))
def test_bits_equal_the_four_launches_and_the_numpy_formulas(case):
    zc = case[5]
    q, k, qw, kw, cos, sin = _inputs(case)
    dq, dk, dqw, dkw, dcos, dsin = _dev(q, k, qw, kw, cos, sin)
    got_q, got_k = (a.get() for a in qk_norm_rope(dq, dk, dqw, dkw, dcos, dsin, EPS,
                                                   zero_centered=zc))
    for name, x, w, got in (("q", dq, dqw, got_q), ("k", dk, dkw, got_k)):
        four = rope(rms_norm_rows(x, w, EPS, zero_centered=zc), dcos, dsin).get()
        _same(got, four, f"{case} {name} against rms_norm_rows + rope")
    want_q, want_k = qk_norm_rope_reference(q, k, qw, kw, cos, sin, EPS, zero_centered=zc)
    _same(got_q, want_q, f"{case} q against the NumPy formulas")
    _same(got_k, want_k, f"{case} k against the NumPy formulas")


def test_strided_heads_are_read_in_place_or_copied():
    """q a slice of [R, Hq, 2 hd] (the gated q_proj before regrouping: one row stride) and k
    a slice of heads that no one stride walks (copied first): the contiguous inputs' bits."""
    case = (3, 4, 2, 64, 16, True)
    R, hq, hkv, hd, rot, zc = case
    q, k, qw, kw, cos, sin = _inputs(case, seed=5)
    rng = np.random.default_rng(6)
    q2 = rng.standard_normal((R, hq, 2 * hd)).astype(np.float32)
    q2[..., :hd] = q
    k2 = rng.standard_normal((R, hkv + 1, hd)).astype(np.float32)
    k2[:, :hkv] = k
    dq2, dk2, dqw, dkw, dcos, dsin = _dev(q2, k2, qw, kw, cos, sin)
    got = qk_norm_rope(dq2[..., :hd], dk2[:, :hkv], dqw, dkw, dcos, dsin, EPS,
                       zero_centered=zc)
    want = qk_norm_rope_reference(q, k, qw, kw, cos, sin, EPS, zero_centered=zc)
    for name, g, w in zip("qk", got, want, strict=True):
        assert g.flags.c_contiguous and g.shape == w.shape
        _same(g.get(), w, f"strided {name}")


def test_empty_shapes_and_errors():
    q, k, qw, kw, cos, sin = _dev(*_inputs((2, 4, 2, 64, 64, False)))
    oq, ok = qk_norm_rope(q[:0], k[:0], qw, kw, cos[:0], sin[:0], EPS, zero_centered=False)
    assert oq.shape == (0, 4, 64) and ok.shape == (0, 2, 64)
    with pytest.raises(TypeError, match="float32"):
        qk_norm_rope(q.astype(np.float64), k, qw, kw, cos, sin, EPS, zero_centered=False)
    with pytest.raises(ValueError):
        qk_norm_rope(q, k[:1], qw, kw, cos, sin, EPS, zero_centered=False)  # rows differ
    with pytest.raises(ValueError):
        qk_norm_rope(q, k, qw, kw, cos[:, :63], sin[:, :63], EPS, zero_centered=False)
    assert fits(MAX_DIM, 2) and not fits(MAX_DIM + 32, 64) and not fits(64, 0)
    assert not fits(64, 66) and not fits(64, 7)


def _spy(monkeypatch) -> list[int]:
    """Count Ops' calls of the fused kernel (the real one still runs)."""
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return qk_norm_rope(*args, **kwargs)

    monkeypatch.setattr(ops_module, "qk_norm_rope", counted)
    return calls


@pytest.mark.parametrize("kernels, fused", [("all", True), ("fused_norm,fused_rope", True),
                                            ("fused_norm", False), ("fused_rope", False),
                                            ("rowtile", False)])
def test_ops_takes_the_kernel_only_with_both_switches(monkeypatch, kernels, fused):
    """Both switches on: one fused launch, the reference's bits. Either off: the four calls
    (each with its own switch), whose bits are those of Ops.rms_norm then Ops.apply_rope."""
    case = (3, 4, 2, 64, 16, True)
    q, k, qw, kw, cos, sin = _inputs(case, seed=2)
    monkeypatch.setenv("TANDEM_GPU_KERNELS", kernels)
    calls = _spy(monkeypatch)
    ops = Ops(cupy, np.float32)
    dq, dk, dqw, dkw, dcos, dsin = _dev(q, k, qw, kw, cos, sin)
    got = ops.qk_norm_rope(dq, dk, dqw, dkw, EPS, dcos, dsin, zero_centered=True)
    assert len(calls) == int(fused), (kernels, calls)
    for name, x, w, g in (("q", dq, dqw, got[0]), ("k", dk, dkw, got[1])):
        want = ops.apply_rope(ops.rms_norm(x, w, EPS, zero_centered=True), dcos, dsin)
        _same(g.get(), want.get(), f"Ops.qk_norm_rope {name}, kernels {kernels}")
    if fused:
        for g, w in zip(got, qk_norm_rope_reference(q, k, qw, kw, cos, sin, EPS,
                                                    zero_centered=True), strict=True):
            _same(g.get(), w, "Ops.qk_norm_rope against the NumPy formulas")


def test_ops_keeps_the_four_calls_for_float64_and_long_heads(monkeypatch):
    calls = _spy(monkeypatch)
    q, k, qw, kw, cos, sin = _inputs((2, 2, 1, 64, 16, False))
    ops64 = Ops(cupy, np.float64)
    d64 = _dev(*(a.astype(np.float64) for a in (q, k, qw, kw, cos, sin)))
    got = ops64.qk_norm_rope(*d64[:4], EPS, *d64[4:], zero_centered=False)
    assert got[0].dtype == np.float64 and not calls
    ops = Ops(cupy, np.float32)
    q, k, qw, kw, cos, sin = _inputs((2, 2, 1, 2 * MAX_DIM, 64, False))
    dq, dk, dqw, dkw, dcos, dsin = _dev(q, k, qw, kw, cos, sin)
    got = ops.qk_norm_rope(dq, dk, dqw, dkw, EPS, dcos, dsin, zero_centered=False)
    assert not calls  # a head of 512 takes the norm's 2-warp rows, then rope
    four = rope(rms_norm_rows(dq, dqw, EPS, zero_centered=False), dcos, dsin)
    _same(got[0].get(), four.get(), "a head of 512")


def _tiny(tmp_path, arch: str):
    from gpu_worker.kernels.bf16 import BF16  # noqa: PLC0415
    from gpu_worker.loader import load_checkpoint  # noqa: PLC0415
    from gpu_worker.model.model import Model  # noqa: PLC0415
    from scripts.tiny_model import make_tiny_model  # noqa: PLC0415

    path = make_tiny_model(tmp_path, arch, seed=11, tokenizer=False, mtp=False)
    ckpt = load_checkpoint(path, dtype=np.float32)
    return Model(ckpt.config, ckpt.tensors, xp=cupy, dtype=BF16)


def _steps(model) -> list[bytes]:
    """Logits bytes of a prefill of two slots (one a long chunk of 20 rows: the matrix
    products), then a decode row each (the paged kernels), on fresh caches."""
    from gpu_worker.model.batch import RaggedBatch  # noqa: PLC0415

    caches = model.new_caches(2, 64)
    ids = np.arange(1, 40) * 13 % 500
    first = model.forward(RaggedBatch.build([(0, 0, ids[:20]), (1, 0, ids[20:25])]), caches,
                          np.arange(25))
    step = model.forward(RaggedBatch.build([(0, 20, ids[30:31]), (1, 5, ids[31:32])]), caches)
    return [first.logits.get().tobytes(), step.logits.get().tobytes()]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_moe"])
def test_whole_model_logits_bytes_are_unchanged(tmp_path, monkeypatch, arch):
    """A tiny bf16 model's logits with the fused launch equal those of the four launches
    (both switches on; the fused path refused by its size check)."""
    model = _tiny(tmp_path, arch)
    calls = _spy(monkeypatch)
    fused = _steps(model)
    assert calls, "the model never took the fused kernel"
    monkeypatch.setattr(ops_module, "qk_norm_rope_fits", lambda hd, rot: False)
    assert _steps(model) == fused


@pytest.mark.parametrize("arch, per_layer", [("qwen3_next", 7), ("qwen3_moe", 6)])
def test_an_attention_layer_makes_its_launches(tmp_path, arch, per_layer):
    """On the CPU emulator's fake CuPy (scripts/cuda_emu/audit.py): a decode step's attention
    layer is the q/k/v(/gate) product, qk_norm_rope, the K/V write, paged attention and its
    merge, (Qwen3-Next: the output gate,) o_proj. Was 10 / 9 with separate norms and RoPE."""
    if "cuda_emu" not in getattr(cupy, "__file__", ""):
        pytest.skip("launches are counted by the CPU emulator's fake CuPy")
    from gpu_worker.model.batch import RaggedBatch  # noqa: PLC0415
    from scripts.cuda_emu.audit import audit  # noqa: PLC0415

    model = _tiny(tmp_path, arch)
    caches = model.new_caches(2, 64)
    model.forward(RaggedBatch.build([(0, 0, np.arange(1, 9)), (1, 0, np.arange(3, 6))]), caches)
    with audit() as a:
        model.forward(RaggedBatch.build([(0, 8, np.array([9])), (1, 3, np.array([6]))]),
                      caches)
    layers = sum(la.full for la in model.layers)
    names = {n for (kind, n), _ in a.launches.items() if kind == "attention"}
    assert a.launches_by_kind()["attention"] == per_layer * layers, a.launches
    assert "qk_norm_rope" in names and not names & {"rope", "rms_norm_rows"}, names
