"""Checkpoint loading errors: every bad checkpoint is a CheckpointError naming the file and
tensor, raised cleanly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from gpu_worker.engine import load_model
from gpu_worker.loader import CheckpointError, load_checkpoint
from gpu_worker.safetensors_io import SafetensorsFile, write_file
from scripts.tiny_model import make_tiny_model

SMALL = {"hidden": 32, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 8, "experts": 4,
         "moe_intermediate": 16, "intermediate": 40, "shared_intermediate": 24, "vocab": 320,
         "linear_key_heads": 2, "linear_value_heads": 4, "linear_key_dim": 8,
         "linear_value_dim": 8}


# ---- bad checkpoints: every error is a CheckpointError naming the file and tensor -------------
@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("good"), "qwen3_moe", tokenizer=False,
                           **SMALL)


@pytest.fixture
def bad(good_dir, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(good_dir, path)
    return path


def rewrite(path: Path, edit) -> None:
    """Apply `edit` to the tensors of path/model.safetensors and write them back."""
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {name: np.array(f.raw(name)) for name in f.tensors}
    del f
    edit(tensors)
    write_file(path / "model.safetensors", tensors)


def load_error(path: Path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, **kwargs)
    exc = info.value  # raised cleanly: no chained traceback from a lower-level error
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)
    return str(info.value)


def test_not_a_directory_and_bad_dtype(bad):
    assert "not a checkpoint directory" in load_error(bad / "config.json")
    with pytest.raises(ValueError, match="floating"):
        load_checkpoint(bad, dtype=np.int8)


def test_missing_config(bad):
    (bad / "config.json").unlink()
    msg = load_error(bad)
    assert str(bad / "config.json") in msg and "missing config.json" in msg


def test_unsupported_architecture(bad):
    config = json.loads((bad / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (bad / "config.json").write_text(json.dumps(config))
    msg = load_error(bad)
    assert "config.json" in msg and "unsupported architecture LlamaForCausalLM" in msg


def test_bad_config_value(bad):
    config = json.loads((bad / "config.json").read_text())
    config["num_experts_per_tok"] = 99
    (bad / "config.json").write_text(json.dumps(config))
    msg = load_error(bad)
    assert "config.json" in msg and "num_experts_per_tok" in msg


def test_missing_tensor(bad):
    rewrite(bad, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    msg = load_error(bad)
    assert str(bad) in msg and "missing tensor model.layers.2.self_attn.k_norm.weight" in msg


def test_missing_expert(bad):
    rewrite(bad, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    assert "missing tensor model.layers.1.mlp.experts.3.up_proj.weight" in load_error(bad)


def test_unexpected_tensor(bad):
    def add(t):
        t["model.layers.0.mlp.experts.4.up_proj.weight"] = np.zeros((16, 32), np.float32)
    rewrite(bad, add)
    msg = load_error(bad)
    assert str(bad / "model.safetensors") in msg
    assert "unexpected tensor model.layers.0.mlp.experts.4.up_proj.weight" in msg


def test_unexpected_mtp_tensor_in_qwen3_moe(bad):
    rewrite(bad, lambda t: t.update({"mtp.fc.weight": np.zeros((32, 64), np.float32)}))
    assert "unexpected tensor mtp.fc.weight" in load_error(bad)
    assert "mtp.fc.weight" not in load_checkpoint(bad, include_mtp=False).tensors


def test_wrong_shape(bad):
    rewrite(bad, lambda t: t.update({"model.norm.weight": np.ones(31, np.float32)}))
    msg = load_error(bad)
    assert str(bad / "model.safetensors") in msg
    assert "tensor model.norm.weight has shape (31,), expected (32,)" in msg


def test_wrong_dtype(bad):
    rewrite(bad, lambda t: t.update({"lm_head.weight": t["lm_head.weight"].astype(np.int32)}))
    msg = load_error(bad)
    assert str(bad / "model.safetensors") in msg
    assert "tensor lm_head.weight has dtype I32" in msg


def test_both_expert_layouts_in_one_layer(bad):
    rewrite(bad, lambda t: t.update({
        "model.layers.0.mlp.experts.gate_up_proj": np.zeros((4, 32, 32), np.float32)}))
    msg = load_error(bad)
    assert "model.layers.0.mlp.experts.gate_up_proj" in msg and "one layout" in msg


def test_fused_wrong_shape(bad):
    def fuse(t):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for e in range(4):
                t.pop(f"model.layers.0.mlp.experts.{e}.{proj}.weight")
        t["model.layers.0.mlp.experts.gate_up_proj"] = np.zeros((4, 16, 32), np.float32)
        t["model.layers.0.mlp.experts.down_proj"] = np.zeros((4, 32, 16), np.float32)
    rewrite(bad, fuse)
    msg = load_error(bad)
    assert "tensor model.layers.0.mlp.experts.gate_up_proj has shape (4, 16, 32), " \
           "expected (4, 32, 32)" in msg


def test_truncated_file(bad):
    file = bad / "model.safetensors"
    data = file.read_bytes()
    last = max(SafetensorsFile(file).tensors.values(), key=lambda info: info.begin)
    file.write_bytes(data[:-10])
    msg = load_error(bad)
    assert str(file) in msg and f"tensor {last.name}:" in msg and "truncated" in msg
    file.write_bytes(data[:5])
    assert "truncated" in load_error(bad)


def test_corrupt_header(bad):
    file = bad / "model.safetensors"
    file.write_bytes((20).to_bytes(8, "little") + b"\xff" * 20 + b"\0" * 64)
    msg = load_error(bad)
    assert str(file) in msg and "corrupt header" in msg
    file.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    assert "header length" in load_error(bad)


def test_unreadable_file(bad):
    file = bad / "model.safetensors"
    file.unlink()
    file.mkdir()  # exists, but cannot be read as a file
    msg = load_error(bad)
    assert str(file) in msg and "cannot read" in msg


def test_no_weights(bad):
    (bad / "model.safetensors").unlink()
    assert "no model.safetensors" in load_error(bad)
    (bad / "pytorch_model.bin").write_bytes(b"x")
    assert "pytorch_model.bin only" in load_error(bad)


@pytest.fixture
def sharded(tmp_path):
    return make_tiny_model(tmp_path / "s", "qwen3_moe", tokenizer=False, shards=2, **SMALL)


def test_bad_index_json(sharded):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index_file.write_text("{oops")
    msg = load_error(sharded)
    assert str(index_file) in msg and "JSON" in msg
    index_file.write_text(json.dumps({"metadata": {}}))
    assert "weight_map" in load_error(sharded)
    name = "model.norm.weight"
    index_file.write_text(json.dumps({"weight_map": {**index["weight_map"],
                                                     name: "model-00009-of-00009.safetensors"}}))
    msg = load_error(sharded)
    assert f"tensor {name} is in model-00009-of-00009.safetensors" in msg
    index_file.write_text(json.dumps({"weight_map": {**index["weight_map"],
                                                     name: "../escape.safetensors"}}))
    assert "bad index" in load_error(sharded)


def test_index_disagrees_with_shards(sharded):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = "model.norm.weight"
    other = next(f for f in files if f != index["weight_map"][name])
    index["weight_map"][name] = other
    index_file.write_text(json.dumps(index))
    msg = load_error(sharded)
    assert f"tensor {name} is listed in {other}" in msg and str(sharded / other) in msg


# ---- errors a user can act on, found before any tensor data is read -------------------------
def no_data_reads(monkeypatch) -> None:
    """Make any read of tensor bytes fail the test: the error must come from the headers."""
    def fail(*args, **kwargs):
        raise AssertionError("tensor data was read before the error")
    monkeypatch.setattr(SafetensorsFile, "_pread", fail)


def test_missing_shard_file(sharded, monkeypatch):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    file = sorted(set(index["weight_map"].values()))[1]
    (sharded / file).unlink()
    no_data_reads(monkeypatch)
    msg = load_error(sharded)
    assert "missing shard file" in msg and file in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match="missing shard file"):
        load_model(sharded, placement="cpu", cpu_workers=1)


def test_truncated_shard_fails_before_any_data_is_read(sharded, monkeypatch):
    files = sorted(sharded.glob("*.safetensors"))
    last = files[-1]
    data = last.read_bytes()
    end = max(SafetensorsFile(last).tensors.values(), key=lambda info: info.begin)
    last.write_bytes(data[:-100])  # the header promises 100 bytes more than the file has
    no_data_reads(monkeypatch)
    for load in (load_checkpoint, lambda p: load_model(p, placement="cpu", cpu_workers=1)):
        with pytest.raises(CheckpointError) as info:
            load(sharded)
        msg = str(info.value)
        assert str(last) in msg and f"tensor {end.name}" in msg and "truncated" in msg


def _rewrite_bf16(path: Path, edit) -> None:
    """Like rewrite() for a bf16 file: BF16 tensors as ml_dtypes.bfloat16 arrays."""
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {name: np.array(f.raw(name)).view(ml_dtypes.bfloat16) if info.dtype == "BF16"
               else np.array(f.raw(name)) for name, info in f.tensors.items()}
    del f
    edit(tensors)
    write_file(path / "model.safetensors", tensors)


def test_dtype_the_config_does_not_expect(bad, tmp_path):
    config = json.loads((bad / "config.json").read_text())
    assert config["dtype"] == "float32"
    config["dtype"] = "bfloat16"  # but every tensor is F32
    (bad / "config.json").write_text(json.dumps(config))
    msg = load_error(bad)
    assert str(bad / "model.safetensors") in msg
    assert "tensor model.embed_tokens.weight has dtype F32, but config.json says dtype = " \
           "bfloat16" in msg
    # a bf16 checkpoint may keep vectors (norms, biases) in float32, not matrices in float16
    bf16 = make_tiny_model(tmp_path / "bf16", "qwen3_moe", tokenizer=False, dtype="bfloat16",
                           **SMALL)
    _rewrite_bf16(bf16, lambda t: t.update(
        {"model.norm.weight": t["model.norm.weight"].astype(np.float32)}))
    assert load_checkpoint(bf16).tensors["model.norm.weight"].shape == (32,)
    name = "model.layers.1.self_attn.o_proj.weight"
    _rewrite_bf16(bf16, lambda t: t.update({name: t[name].astype(np.float16)}))
    assert f"tensor {name} has dtype F16, but config.json says dtype = bfloat16" in \
        load_error(bf16)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_expert_count_disagrees_with_config(tmp_path, layout):
    path = make_tiny_model(tmp_path / layout, "qwen3_moe", tokenizer=False,
                           expert_layout=layout, **SMALL)
    config = json.loads((path / "config.json").read_text())
    for n in (6, 3):  # more experts in config.json than on disk, then fewer
        (path / "config.json").write_text(json.dumps({**config, "num_experts": n}))
        msg = load_error(path)
        assert "config.json says num_experts = " + str(n) in msg and "\n" not in msg
        if layout == "fused":
            assert "tensor model.layers.0.mlp.experts.gate_up_proj holds 4 experts" in msg
        elif n == 6:
            assert "model.layers.0.mlp.experts has 4 experts on disk" in msg
            assert "missing tensor model.layers.0.mlp.experts.4.gate_proj.weight" in msg
        else:
            assert "unexpected tensor model.layers.0.mlp.experts.3." in msg


def test_router_shape_names_the_config_keys(bad):
    rewrite(bad, lambda t: t.update({"model.layers.2.mlp.gate.weight": np.zeros((4, 16),
                                                                                np.float32)}))
    msg = load_error(bad)
    assert "tensor model.layers.2.mlp.gate.weight has shape (4, 16), expected (4, 32)" in msg
    assert "num_experts = 4" in msg
