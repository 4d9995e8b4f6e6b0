"""Models loaded from GGUF: logits of an F32 GGUF against the safetensors model, a Q8_0
GGUF's CPU experts against the file's blocks, greedy tokens of a Q8_0 model against the
float model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from gpu_worker.engine import Engine, load_model
from gpu_worker.experts.split import plan_split
from gpu_worker.weights.gguf_source import GGUFSource
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model
from tests.unit.gguf_tiny import experts_in, write_gguf

IDS = [5, 17, 300, 42, 7, 99, 250, 3, 128, 64]
# Q8_0 greedy tolerance: teacher-forced on the Q8_0 model's own greedy tokens, the float
# model ranks each of them within this much of its best logit, and the prompt's logits
# differ by less (logits here span ~1.2; measured: <= 0.013)
Q8_GAP = 0.025


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_model")
    return {arch: make_tiny_model(root / arch, arch, seed=7)
            for arch in ("qwen3_moe", "qwen3_next")}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_f32_gguf_logits_equal_safetensors(models, tmp_path: Path, arch: str,
                                           dtype: str) -> None:
    """qwen3moe: bit-identical. qwen3next: the converter stored norms as w + 1 and A_log as
    -exp(A_log) in float32; undone, they are within one float32 rounding, which moves the
    logits by < 1e-6 here."""
    file = write_gguf(models[arch], tmp_path / "m.gguf")
    ours = Engine.from_dir(file, dtype=dtype).score(IDS)
    theirs = Engine.from_dir(models[arch], dtype=dtype).score(IDS)
    if arch == "qwen3_moe":
        np.testing.assert_array_equal(ours, theirs)
    else:
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("arch", "qtype", "fmt"), [
    ("qwen3_moe", T.Q8_0, "int8"), ("qwen3_next", T.Q8_0, "int8"),
    ("qwen3_moe", T.Q4_0, "int8"), ("qwen3_next", T.Q4_0, "int4")])
def test_cpu_experts_hold_the_files_blocks(models, tmp_path: Path, arch: str, qtype: T,
                                           fmt: str) -> None:
    """Split placement over a Q8_0 / Q4_0 GGUF: every CPU worker's integers and fp16
    scales, put back together, are the file's blocks (Q8_0: byte for byte)."""
    file = write_gguf(models[arch], tmp_path / "q.gguf", types=experts_in(qtype))
    src = GGUFSource(file)
    split = plan_split(src.config, "split", 5, None)
    model, placement = load_model(src, placement="split", expert_split=split, cpu_workers=1,
                                  cpu_format=fmt)
    stored = {t.name: np.array(t.data) for t in GGUFReader(file).tensors}  # [E, rows, bytes]
    try:
        for layer, tiled in placement.pool.layers.items():
            ql, ids = tiled.canonical(), split.cpu_ids(layer)
            for proj, q, s in (("gate", ql.gate_q, ql.gate_s), ("up", ql.up_q, ql.up_s),
                               ("down", ql.down_q, ql.down_s)):
                raw = stored[f"blk.{layer}.ffn_{proj}_exps.weight"][ids]
                blocks = raw.reshape(*s.shape, -1)  # [n, rows, blocks, bytes per block]
                np.testing.assert_array_equal(s.view(np.uint8).reshape(*s.shape, 2),
                                              blocks[..., :2])
                if qtype == T.Q8_0:
                    np.testing.assert_array_equal(q.reshape(*s.shape, 32).view(np.uint8),
                                                  blocks[..., 2:])
                else:  # Q4_0: 16 bytes of (v + 8) nibbles, v[i] low and v[i + 16] high
                    nib = blocks[..., 2:]
                    v = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.int8) - 8
                    np.testing.assert_array_equal(q.reshape(*s.shape, 32), v)
        engine = Engine(model, placement=placement, max_slots=1, max_len=64)
        assert np.isfinite(engine.score(IDS)).all()
    finally:
        placement.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_q8_0_greedy_tokens_near_the_float_model(models, tmp_path: Path, arch: str) -> None:
    """Every matrix Q8_0: the greedy continuation starts with the float model's token, and
    each of its tokens is within Q8_GAP of the float model's best logit at that step."""
    file = write_gguf(models[arch], tmp_path / "q8.gguf", types=experts_in(T.Q8_0, T.Q8_0))
    assert GGUFSource(file).stored_type("model.embed_tokens.weight") == "Q8_0"
    q8 = Engine.from_dir(file, max_slots=1, max_len=64)
    ref = Engine.from_dir(models[arch], max_slots=1, max_len=64)
    greedy = SamplingParams(temperature=0.0)
    tokens = q8.generate(IDS, params=greedy, max_tokens=16)
    assert tokens[0] == ref.generate(IDS, params=greedy, max_tokens=1)[0]
    logits = ref.score(IDS + tokens)[len(IDS) - 1:-1]  # the float model at each step
    gaps = logits.max(axis=1) - logits[np.arange(len(tokens)), tokens]
    assert gaps.max() <= Q8_GAP, gaps
    diff = np.abs(q8.score(IDS) - ref.score(IDS)).max()
    assert 0 < diff < Q8_GAP  # quantized, and close
