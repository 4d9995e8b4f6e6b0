"""GGUF files written by llama.cpp's own convert_hf_to_gguf.py, loaded by Tandem.

Two parts (docs/gguf.md, "Checked against llama.cpp's converter"):

* the committed fixtures (tests/fixtures/gguf_llamacpp/, README there): F32 and Q8_0 files
  the converter wrote from small tiny models; checked against the same tiny models made
  again here. These always run.
* the converter itself, when ``TANDEM_LLAMACPP_CONVERTER`` names its convert_hf_to_gguf.py
  (skipped otherwise): the default tiny models converted to F32, F16 and Q8_0, every tensor,
  the config, the logits and the tokenizer compared with the safetensors model.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from daemon.tokenizer import Tokenizer
from gpu_worker.engine import Engine
from gpu_worker.model_config import FULL_ATTENTION, LINEAR_ATTENTION
from gpu_worker.weights.checkpoint import CheckpointSource
from gpu_worker.weights.gguf_names import config_dict
from gpu_worker.weights.gguf_source import GGUFSource
from gpu_worker.weights.resolve import open_source
from scripts.check_llamacpp_gguf import (
    ENV,
    FIXTURE_SIZES,
    IDS,
    OUTTYPES,
    SEED,
    convert,
    converter_problem,
)
from scripts.tiny_model import make_tiny_model
from tests.unit.test_gguf_model import Q8_GAP
from tests.unit.test_gguf_tokenizer import TEXTS

FIXTURES = Path(__file__).parents[1] / "fixtures" / "gguf_llamacpp"
# sha256 of the fixture models' canonical float32 tensors (names and bytes, sorted): if
# scripts/tiny_model.py makes other weights now, regenerate the fixtures (README there)
FIXTURE_WEIGHTS = {
    "qwen3_moe": "2fbca178f548e26dc44f26a6847f5ae519dd022178b67f270c72e9444bf0f707",
    "qwen3_next": "cdcf6790771982487ea3090e5ab2cc52e3343e149bd44edb6852108896f520b0",
}
# qwen3next values the converter changes in float32 (norms w + 1, A_log -> -exp(A_log))
# come back within one float32 rounding
CHANGED = ("norm.weight", "norm_embedding.weight", "norm_hidden.weight", ".A_log")
PROBLEM = converter_problem(os.environ.get(ENV))
needs_converter = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")


def weights_digest(src: CheckpointSource) -> str:
    h = hashlib.sha256()
    for name in sorted(src.shapes()):
        h.update(name.encode())
        h.update(src.read(name, np.float32).tobytes())
    return h.hexdigest()


def expected(ckpt: np.ndarray, stored: str) -> np.ndarray:
    """The safetensors tensor as the converter stores it in type ``stored`` (rounded to
    F16, or quantized to Q8_0 by the gguf package, llama.cpp's reference quantizer)."""
    if stored == "F16":
        return ckpt.astype(np.float16).astype(np.float32)
    if stored == "Q8_0":
        return quants.dequantize(quants.quantize(ckpt, T.Q8_0), T.Q8_0).reshape(ckpt.shape)
    assert stored == "F32", stored
    return ckpt


def assert_reads_as(file: Path, model: Path) -> None:
    """Config, shapes and every canonical tensor of GGUF ``file`` equal the safetensors
    model's, each rounded as the file stores it."""
    gguf, ckpt = open_source(file), CheckpointSource(model)
    assert isinstance(gguf, GGUFSource)
    assert gguf.config == ckpt.config
    assert gguf.shapes() == ckpt.shapes()
    assert gguf.config.num_mtp_layers == (1 if gguf.arch == "qwen3next" else 0)
    for name in ckpt.shapes():
        ours, theirs = gguf.read(name, np.float32), ckpt.read(name, np.float32)
        want = expected(theirs, gguf.stored_type(name))
        if gguf.arch == "qwen3next" and name.endswith(CHANGED):
            np.testing.assert_allclose(ours, want, rtol=0, atol=2.4e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(ours, want, err_msg=name)


def assert_logits(file: Path, model: Path, outtype: str) -> float:
    """F32: qwen3moe bit for bit, qwen3next within 1e-6; F16 within 2e-3; Q8_0 within
    Q8_GAP (docs/gguf.md). Returns the largest difference."""
    ours = Engine.from_dir(file, dtype="float32").score(IDS)
    theirs = Engine.from_dir(model, dtype="float32").score(IDS)
    diff = float(np.abs(ours - theirs).max())
    limit = {"f32": 1e-6, "f16": 2e-3, "q8_0": Q8_GAP}[outtype]
    assert diff <= limit, (file.name, diff)
    assert outtype != "q8_0" or diff > 0  # really quantized
    return diff


# -- the committed fixtures ---------------------------------------------------------------
@pytest.fixture(scope="module")
def small_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llamacpp_small")
    return {arch: make_tiny_model(root / arch, arch, seed=SEED, **FIXTURE_SIZES)
            for arch in FIXTURE_WEIGHTS}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_fixture_models_unchanged(small_models, arch: str) -> None:
    digest = weights_digest(CheckpointSource(small_models[arch]))
    assert digest == FIXTURE_WEIGHTS[arch], (
        "scripts/tiny_model.py makes other weights than the fixtures were converted from: "
        "regenerate tests/fixtures/gguf_llamacpp (README there)")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_fixture_loads_as_the_safetensors_model(small_models, arch: str,
                                                outtype: str) -> None:
    file = FIXTURES / f"{arch}-{outtype}.gguf"
    assert file.stat().st_size < 1 << 20
    assert_reads_as(file, small_models[arch])
    assert_logits(file, small_models[arch], outtype)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_fixture_metadata_and_tokenizer(arch: str) -> None:
    """What the converter took from generation_config.json and the tokenizer files (the
    tokenizer is trained on this Python's sources, so only round trips are checked)."""
    src = GGUFSource(FIXTURES / f"{arch}-f32.gguf")
    gen = src.generation_config()
    assert gen == {"eos_token_ids": [315, 313], "temperature": 0.7, "top_p": 0.8,
                   "top_k": 20}
    if arch == "qwen3_next":
        assert src.meta("qwen3next.attention.recurrent_layers") == [True] * 3 + [False] * 2
        assert src.config.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    tok = Tokenizer.from_dir(FIXTURES / f"{arch}-f32.gguf")
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.template_tokens["eos_token"] == "<|im_end|>"


def test_recurrent_layers_decide_the_layer_kinds() -> None:
    """``attention.recurrent_layers`` wins over ``full_attention_interval`` (as in
    llama.cpp), MTP blocks beyond the model's layers ignored."""
    src = GGUFSource(FIXTURES / "qwen3_next-f32.gguf")
    pattern = [False, True, True, False, False]  # not every 4th layer: layers 0 and 3 full

    def meta(key: str):
        return pattern if key == "qwen3next.attention.recurrent_layers" else src.meta(key)

    shapes = {n: t.shape for n, t in src.tensors.items()}
    raw = config_dict(meta, "qwen3next", shapes)
    assert raw["layer_types"] == [FULL_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION,
                                  FULL_ATTENTION]


# -- the converter, where there is one ----------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(arch, outtype) -> (converted GGUF, safetensors model), the default tiny models."""
    root = tmp_path_factory.mktemp("llamacpp")
    out = {}
    for arch in ("qwen3_moe", "qwen3_next"):
        model = make_tiny_model(root / arch, arch, seed=SEED)
        for outtype in OUTTYPES:
            file = convert(os.environ[ENV], model, root / f"{arch}-{outtype}.gguf", outtype)
            out[arch, outtype] = (file, model)
    return out


@needs_converter
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
@pytest.mark.parametrize("outtype", OUTTYPES)
def test_converter_output_loads(converted, arch: str, outtype: str) -> None:
    file, model = converted[arch, outtype]
    assert_reads_as(file, model)
    assert_logits(file, model, outtype)


@needs_converter
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_converter_tokenizer_and_generation_config(converted, arch: str) -> None:
    file, model = converted[arch, "f32"]
    ours, theirs = Tokenizer.from_dir(file), Tokenizer.from_dir(model)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    assert ours.chat_template == theirs.chat_template
    assert sorted(ours.eos_token_ids) == sorted(theirs.eos_token_ids)
    gen = GGUFSource(file).generation_config()
    assert {k: gen[k] for k in ("temperature", "top_p", "top_k")} == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20}
