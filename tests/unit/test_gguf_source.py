"""GGUFSource: tiny qwen3moe / qwen3next models written as GGUF the way llama.cpp's converter
writes them read back as the safetensors model's canonical tensors; split files; errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import quants as ref

from gpu_worker.weights.checkpoint import CheckpointSource
from gpu_worker.weights.gguf_source import GGUFSource
from gpu_worker.weights.resolve import model_config, open_source
from gpu_worker.weights.source import CheckpointError
from scripts.tiny_model import make_tiny_model
from tests.unit.gguf_tiny import experts_in, write_gguf

# qwen3next values the converter changes in float32 (norms w + 1, A_log -> -exp(A_log))
# come back within one float32 rounding; everything else is bit-exact
CHANGED = ("norm.weight", "norm_embedding.weight", "norm_hidden.weight", ".A_log")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ("qwen3_moe", "qwen3_next"):
        model = make_tiny_model(root / arch, arch, seed=3)
        out[arch] = (model, write_gguf(model, root / f"{arch}.gguf"))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_f32_gguf_reads_as_the_safetensors_model(models, arch: str) -> None:
    model, file = models[arch]
    gguf, ckpt = open_source(file), CheckpointSource(model)
    assert isinstance(gguf, GGUFSource)
    assert gguf.config == ckpt.config == model_config(file)
    assert gguf.shapes() == ckpt.shapes()
    assert arch == "qwen3_moe" or gguf.config.num_mtp_layers == 1
    for name in ckpt.shapes():
        ours, theirs = gguf.read(name, np.float32), ckpt.read(name, np.float32)
        if arch == "qwen3_next" and name.endswith(CHANGED):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=2.4e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=name)
    name = "model.layers.1.mlp.experts.down_proj"
    np.testing.assert_array_equal(gguf.read(name, np.float64, experts=[5, 0]),
                                  ckpt.read(name, np.float64, experts=[5, 0]))
    assert gguf.nbytes(name) == ckpt.nbytes(name)  # both F32
    assert gguf.generation_config()["eos_token_ids"] == [507, 505]


def test_split_gguf(models, tmp_path: Path) -> None:
    model, single = models["qwen3_next"]
    first = write_gguf(model, tmp_path / "m.gguf", split_max_tensors=25)
    assert first.name == "m-00001-of-00004.gguf"
    split, whole = GGUFSource(first), GGUFSource(single)
    assert split.config == whole.config
    for name in whole.shapes():
        np.testing.assert_array_equal(split.read(name, np.float32),
                                      whole.read(name, np.float32))
    with pytest.raises(CheckpointError, match="give the first file of a split GGUF"):
        GGUFSource(tmp_path / "m-00002-of-00004.gguf")
    (tmp_path / "m-00003-of-00004.gguf").unlink()
    with pytest.raises(CheckpointError, match=r"m-00003-of-00004.gguf: missing part"):
        GGUFSource(first)


def test_errors_name_the_problem(models, tmp_path: Path) -> None:
    model, _ = models["qwen3_moe"]
    bad = write_gguf(model, tmp_path / "llama.gguf", arch_name="llama")
    with pytest.raises(CheckpointError, match="unknown architecture 'llama'"):
        GGUFSource(bad)
    gone = write_gguf(model, tmp_path / "gone.gguf", skip=("blk.2.ffn_up_exps.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor blk.2.ffn_up_exps.weight "
                                              r"\(for model.layers.2.mlp.experts.up_proj"):
        GGUFSource(gone)
    f64 = write_gguf(model, tmp_path / "f64.gguf",
                     types=lambda n, a: T.F64 if n == "blk.0.attn_norm.weight" else T.F32)
    with pytest.raises(CheckpointError, match="blk.0.attn_norm.weight has unsupported "
                                              "type F64"):
        GGUFSource(f64)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(CheckpointError, match="junk.gguf: not a readable GGUF file"):
        GGUFSource(tmp_path / "junk.gguf")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.Q4_0, T.Q8_0])
def test_quantized_experts_dequantize_like_gguf(tmp_path: Path, qtype: T) -> None:
    """Experts stored 4-bit (random blocks; Q4_0 / Q8_0 by gguf's quantizer) read as the
    gguf reference's dequantization of the same stored bytes, any expert subset."""
    model = make_tiny_model(tmp_path / "m", "qwen3_moe", tokenizer=False, hidden=256,
                            moe_intermediate=256, experts=4, layers=2, heads=2, kv_heads=1,
                            head_dim=64, intermediate=256)
    file = write_gguf(model, tmp_path / "q.gguf", types=experts_in(qtype))
    src = GGUFSource(file)
    stored = {t.name: t for t in GGUFReader(file).tensors}
    for layer in range(2):
        for proj, gguf_proj in (("gate_proj", "gate"), ("down_proj", "down")):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            t = stored[f"blk.{layer}.ffn_{gguf_proj}_exps.weight"]
            assert src.stored_type(name) == qtype.name and src.nbytes(name) == t.n_bytes
            theirs = ref.dequantize(np.array(t.data), qtype)  # [E, rows, cols] float32
            np.testing.assert_array_equal(src.read(name, np.float32), theirs)
            np.testing.assert_array_equal(src.read(name, np.float32, experts=[3, 1]),
                                          theirs[[3, 1]])
    blocks = src.read_blocks("model.layers.0.mlp.experts.up_proj", [2, 0])
    assert (blocks is not None) == (qtype in (T.Q8_0, T.Q4_0))
    if blocks is not None:  # the integers and scales as stored: their product, exactly
        q, s = blocks.values()
        values = (q.astype(np.float32).reshape(*s.shape, 32)
                  * s.astype(np.float32)[..., None]).reshape(q.shape)
        np.testing.assert_array_equal(
            values, src.read("model.layers.0.mlp.experts.up_proj", np.float32, experts=[2, 0]))
