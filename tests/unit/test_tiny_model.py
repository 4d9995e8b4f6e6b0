"""make_tiny_model: real on-disk format (transformers loads it), determinism, init, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_worker.loader import load_checkpoint
from gpu_worker.model_config import ModelConfig
from gpu_worker.safetensors_io import SafetensorsFile
from scripts.tiny_model import make_tiny_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SMALL = {"hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "experts": 4,
         "moe_intermediate": 16, "intermediate": 40, "shared_intermediate": 24, "vocab": 320,
         "linear_key_heads": 2, "linear_value_heads": 4, "linear_key_dim": 8,
         "linear_value_dim": 8}
CASES = {
    "moe": ("qwen3_moe", {}),
    "moe_odd": ("qwen3_moe", dict(expert_layout="fused", tie_embeddings=True, dtype="bfloat16",
                                  shards=2, norm_topk_prob=False, mlp_only_layers=(1,),
                                  decoder_sparse_step=2, head_dim=12, attention_bias=True,
                                  rope_theta=1e6)),
    "next": ("qwen3_next", {}),
    "next_odd": ("qwen3_next", dict(expert_layout="fused", tie_embeddings=True, dtype="float16",
                                    linear_key_heads=2, linear_value_heads=6,
                                    linear_value_dim=4, partial_rotary_factor=0.5,
                                    full_attention_interval=2, mlp_only_layers=(0,),
                                    attention_bias=True, head_dim=16)),
}


def canonical_state_dict(model) -> dict[str, np.ndarray]:
    out = {}
    for name, value in model.state_dict().items():
        value = value.detach().float().numpy()
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            inter = value.shape[1] // 2
            prefix = name[: -len(".gate_up_proj")]
            out[f"{prefix}.gate_proj"] = value[:, :inter]
            out[f"{prefix}.up_proj"] = value[:, inter:]
        else:
            out[name] = value
    return out


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {case: make_tiny_model(tmp_path_factory.mktemp(case), arch, seed=1,
                                  **{**SMALL, **over})
            for case, (arch, over) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_it_exactly(tiny_dirs, case):
    path = tiny_dirs[case]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, dtype=torch.float32)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    assert not info["mismatched_keys"] and not info.get("error_msgs")
    arch = CASES[case][0]
    assert type(model).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM",
                                    "qwen3_next": "Qwen3NextForCausalLM"}[arch]

    ours = load_checkpoint(path)
    theirs = canonical_state_dict(model)
    mtp = {n for n in ours.tensors if n.startswith("mtp.")}
    assert bool(mtp) == (arch == "qwen3_next")
    assert ours.tensors.keys() - mtp == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours.tensors[name], value, err_msg=name)

    # the config means the same to both
    cfg, hf = ours.config, model.config
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.partial_rotary_factor == hf.rope_parameters.get("partial_rotary_factor", 1.0)
    assert cfg.layer_types == tuple(getattr(hf, "layer_types", None) or cfg.layer_types)
    assert cfg.norm_topk_prob == hf.norm_topk_prob
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert logits.shape == (1, 5, SMALL["vocab"]) and torch.isfinite(logits).all()


def test_on_disk_layouts(tiny_dirs):
    per_expert = SafetensorsFile(tiny_dirs["next"] / "model.safetensors").tensors
    assert per_expert["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (16, 32)
    assert per_expert["mtp.layers.0.mlp.experts.3.down_proj.weight"].shape == (32, 16)
    assert per_expert["mtp.fc.weight"].shape == (32, 64)
    assert "lm_head.weight" in per_expert
    assert {i.dtype for i in per_expert.values()} == {"F32"}
    index = json.loads((tiny_dirs["moe_odd"] / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    fused = {}
    for file in files:
        fused.update(SafetensorsFile(tiny_dirs["moe_odd"] / file).tensors)
    assert fused.keys() == index["weight_map"].keys()
    assert fused["model.layers.3.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    assert "lm_head.weight" not in fused and {i.dtype for i in fused.values()} == {"BF16"}
    assert index["metadata"]["total_size"] == sum(i.nbytes for i in fused.values())
    config = json.loads((tiny_dirs["next"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["mtp_num_hidden_layers"] == 1
    generation = json.loads((tiny_dirs["next"] / "generation_config.json").read_text())
    assert len(generation["eos_token_id"]) == 2


def test_seed_determinism(tmp_path):
    a = make_tiny_model(tmp_path / "a", "qwen3_next", seed=5, **SMALL)
    b = make_tiny_model(tmp_path / "b", "qwen3_next", seed=5, **SMALL)
    c = make_tiny_model(tmp_path / "c", "qwen3_next", seed=6, **SMALL)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_initial_values(tmp_path):
    nxt = load_checkpoint(make_tiny_model(tmp_path / "n", "qwen3_next", std=0.05, **SMALL))
    t = nxt.tensors
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.3.self_attn.q_norm.weight",
                 "model.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        assert abs(t[name].mean()) < 0.1 and 0.02 < t[name].std() < 0.3, name  # zero-centred
    gated = t["model.layers.0.linear_attn.norm.weight"]
    assert abs(gated.mean() - 1) < 0.1  # plain weight
    a = np.exp(t["model.layers.0.linear_attn.A_log"])
    assert (a >= 1).all() and (a < 16).all()
    dt = np.log1p(np.exp(t["model.layers.0.linear_attn.dt_bias"]))  # softplus
    assert (dt > 0.99e-3).all() and (dt < 1.01e-1).all()
    assert abs(t["model.layers.0.mlp.experts.gate_proj"].std() - 0.05) < 0.005
    moe = load_checkpoint(make_tiny_model(tmp_path / "m", "qwen3_moe", **SMALL)).tensors
    assert abs(moe["model.norm.weight"].mean() - 1) < 0.1  # plain norms around 1
    assert abs(moe["model.embed_tokens.weight"].std() - 0.02) < 0.002


def test_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="unknown size options: hiden"):
        make_tiny_model(tmp_path, "qwen3_moe", hiden=8)
    with pytest.raises(ValueError, match="vocab must be at least"):
        make_tiny_model(tmp_path, "qwen3_moe", vocab=100)
    with pytest.raises(ValueError, match="num_attention_heads"):
        make_tiny_model(tmp_path, "qwen3_moe", heads=3, kv_heads=2)


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.make_tiny_model", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_script(tmp_path):
    out = tmp_path / "cli"
    done = run_script("--arch", "qwen3_next", "--out", str(out), "--seed", "2", "--hidden", "48",
                      "--layers", "2", "--full-attention-interval", "2", "--experts", "3",
                      "--topk", "1", "--mlp-only-layers", "0", "--no-mtp", "--shards", "2",
                      "--dtype", "bfloat16", "--expert-layout", "fused", "--tie-embeddings",
                      "--no-norm-topk-prob", "--partial-rotary-factor", "0.5", "--vocab", "300")
    assert done.returncode == 0, done.stderr
    cfg = load_checkpoint(out).config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.num_mtp_layers) == \
        (48, 2, 3, 0)
    assert cfg.layer_types == ("linear_attention", "full_attention")
    assert cfg.mlp_only_layers == (0,) and not cfg.is_sparse(0) and cfg.is_sparse(1)
    assert cfg.tie_word_embeddings and not cfg.norm_topk_prob
    assert cfg.partial_rotary_factor == 0.5 and cfg.vocab_size == 300
    bad = run_script("--arch", "qwen3_moe", "--out", str(tmp_path / "x"), "--mlp-only-layers",
                     "a,b")
    assert bad.returncode == 2 and "--mlp-only-layers" in bad.stderr
    bad = run_script("--arch", "qwen3_moe", "--out", str(tmp_path / "x"), "--heads", "3")
    assert bad.returncode == 2 and "num_attention_heads" in bad.stderr


def test_uses_no_torch(tmp_path):
    code = ("import sys; from scripts.tiny_model import make_tiny_model; "
            f"make_tiny_model({str(tmp_path)!r}, 'qwen3_next', layers=2); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert ModelConfig.from_file(tmp_path / "config.json").num_hidden_layers == 2
