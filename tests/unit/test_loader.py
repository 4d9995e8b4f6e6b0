"""Checkpoint loading: transformers-saved models, both expert layouts, shards, dtypes, errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from gpu_worker.loader import CheckpointError, load_checkpoint, load_generation_config
from gpu_worker.safetensors_io import SafetensorsFile, write_file
from gpu_worker.weights_spec import expected_tensors
from scripts.tiny_model import make_tiny_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = {"hidden": 32, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 8, "experts": 4,
         "moe_intermediate": 16, "intermediate": 40, "shared_intermediate": 24, "vocab": 320,
         "linear_key_heads": 2, "linear_value_heads": 4, "linear_key_dim": 8,
         "linear_value_dim": 8}


def canonical_state_dict(model) -> dict[str, np.ndarray]:
    """transformers' in-memory weights renamed to Tandem's canonical names."""
    out = {}
    for name, value in model.state_dict().items():
        value = value.detach().float().numpy()
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            prefix = name[: -len(".gate_up_proj")]
            inter = value.shape[1] // 2
            out[f"{prefix}.gate_proj"] = value[:, :inter]
            out[f"{prefix}.up_proj"] = value[:, inter:]
        else:
            out[name] = value
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def hf_model(arch: str, **over):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  num_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_next":
        common.update(shared_expert_intermediate_size=24, linear_num_key_heads=2,
                      linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4)
        config = transformers.Qwen3NextConfig(**{**common, **over})
        model = transformers.Qwen3NextForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(**{**common, **over})
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # make norms / biases non-trivial so a mix-up cannot pass
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


HF_CASES = {
    "moe": ("qwen3_moe", {}),
    "moe_bias_dense_tied": ("qwen3_moe", dict(attention_bias=True, mlp_only_layers=[1],
                                             decoder_sparse_step=1, tie_word_embeddings=True)),
    "moe_sparse_step2": ("qwen3_moe", dict(decoder_sparse_step=2, head_dim=16)),
    "next": ("qwen3_next", {}),
    "next_dense_tied": ("qwen3_next", dict(mlp_only_layers=[0], tie_word_embeddings=True,
                                           attention_bias=True)),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for case, (arch, over) in HF_CASES.items():
        model = hf_model(arch, **over)
        path = tmp_path_factory.mktemp(case)
        model.save_pretrained(path)
        out[case] = (path, canonical_state_dict(model))
    return out


def assert_same(tensors: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert tensors.keys() == reference.keys()
    for name, value in reference.items():
        assert tensors[name].shape == value.shape, name
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


@pytest.mark.parametrize("case", list(HF_CASES))
def test_transformers_save_pretrained_per_expert(hf_dirs, case):
    path, reference = hf_dirs[case]
    on_disk = SafetensorsFile(path / "model.safetensors").tensors
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in on_disk)  # per-expert layout
    ckpt = load_checkpoint(path)
    assert_same(ckpt.tensors, reference)
    assert list(ckpt.tensors) == list(expected_tensors(ckpt.config, include_mtp=True))
    for value in ckpt.tensors.values():
        assert value.dtype == np.float32 and value.flags.c_contiguous


@pytest.mark.parametrize("case", ["moe", "next_dense_tied"])
def test_fused_layout_from_transformers_state_dict(hf_dirs, tmp_path, case):
    """transformers-5's in-memory (fused) names written as-is: gate_up_proj [E, 2I, H]."""
    src, reference = hf_dirs[case]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    write_file(tmp_path / "model.safetensors", state)
    assert_same(load_checkpoint(tmp_path).tensors, reference)


@pytest.mark.parametrize("torch_dtype", ["bfloat16", "float16"])
def test_transformers_half_precision_sharded(tmp_path, torch_dtype):
    model = hf_model("qwen3_next").to(getattr(torch, torch_dtype))
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ckpt = load_checkpoint(tmp_path)
    assert_same(ckpt.tensors, canonical_state_dict(model))  # .float() of the same values


def test_sharded_bf16_fp16_match_single_fp32(tmp_path):
    sizes = dict(SMALL, tokenizer=False)
    ref = load_checkpoint(make_tiny_model(tmp_path / "f32", "qwen3_next", seed=3, **sizes))
    for dtype, shards, layout in (("bfloat16", 3, "fused"), ("float16", 2, "per_expert")):
        path = make_tiny_model(tmp_path / dtype, "qwen3_next", seed=3, dtype=dtype,
                               shards=shards, expert_layout=layout, **sizes)
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == shards
        got = load_checkpoint(path)
        # independent reference: the safetensors package, through torch (which has bf16)
        from safetensors.torch import load_file
        disk = {}
        for file in sorted(set(index["weight_map"].values())):
            disk.update(load_file(path / file))
        torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float16
        assert disk["model.embed_tokens.weight"].dtype == torch_dtype
        np.testing.assert_array_equal(got.tensors["model.embed_tokens.weight"],
                                      disk["model.embed_tokens.weight"].float().numpy())
        np.testing.assert_array_equal(got.tensors["mtp.layers.0.mlp.experts.down_proj"][2],
                                      disk["mtp.layers.0.mlp.experts.2.down_proj.weight"]
                                      .float().numpy() if layout == "per_expert" else
                                      disk["mtp.layers.0.mlp.experts.down_proj"][2]
                                      .float().numpy())
        assert got.tensors.keys() == ref.tensors.keys()
        tol = 1e-2 if dtype == "bfloat16" else 1e-3  # rounding of the stored values
        for name, value in ref.tensors.items():
            np.testing.assert_allclose(got.tensors[name], value, rtol=tol, atol=1e-6,
                                       err_msg=name)


def test_dtype_and_mtp_options(tmp_path):
    path = make_tiny_model(tmp_path / "m", "qwen3_next", tokenizer=False, **SMALL)
    full = load_checkpoint(path, dtype=np.float64)
    assert all(v.dtype == np.float64 for v in full.tensors.values())
    assert "mtp.fc.weight" in full.tensors
    assert full.tensors["mtp.fc.weight"].shape == (32, 64)
    assert full.tensors["mtp.layers.0.mlp.experts.gate_proj"].shape == (4, 16, 32)
    no_mtp = load_checkpoint(path, include_mtp=False)
    assert not any(n.startswith("mtp.") for n in no_mtp.tensors)
    assert no_mtp.tensors.keys() == {n for n in full.tensors if not n.startswith("mtp.")}


def test_tied_embeddings_fill_lm_head(tmp_path):
    path = make_tiny_model(tmp_path / "t", "qwen3_moe", tokenizer=False, tie_embeddings=True,
                           **SMALL)
    assert "lm_head.weight" not in SafetensorsFile(path / "model.safetensors").tensors
    ckpt = load_checkpoint(path)
    np.testing.assert_array_equal(ckpt.tensors["lm_head.weight"],
                                  ckpt.tensors["model.embed_tokens.weight"])


def test_checkpoint_without_mtp(tmp_path):
    path = make_tiny_model(tmp_path / "n", "qwen3_next", tokenizer=False, mtp=False, **SMALL)
    assert load_checkpoint(path).config.num_mtp_layers == 0  # config says no MTP: fine
    # config declares an MTP layer but the weights lack it
    config = json.loads((path / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensor mtp\.fc\.weight"):
        load_checkpoint(path)
    assert "mtp.fc.weight" not in load_checkpoint(path, include_mtp=False).tensors


def test_progress_bar(tmp_path, capsys):
    path = make_tiny_model(tmp_path / "p", "qwen3_moe", tokenizer=False, **SMALL)
    load_checkpoint(path)
    assert capsys.readouterr().err == ""  # small checkpoint: no bar
    load_checkpoint(path, progress=True)
    err = capsys.readouterr().err
    assert "loading p" in err and "100%" in err


def test_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_generation_config(tmp_path)["eos_token_ids"] == [7]  # fallback to config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3,
                                                                "top_k": 20}))
    assert load_generation_config(tmp_path) == {"eos_token_id": 3, "top_k": 20,
                                                "eos_token_ids": [3]}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert load_generation_config(tmp_path)["eos_token_ids"] == [5, 6]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_generation_config(tmp_path)
