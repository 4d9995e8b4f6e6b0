"""ModelConfig: every config.json key variant (docs/architecture.md §11), checked against
transformers."""

from __future__ import annotations

import json

import pytest

from gpu_worker.model_config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, ModelConfigError

transformers = pytest.importorskip("transformers")


def moe_raw(**over):
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
           "norm_topk_prob": True}
    raw.update(over)
    return {k: v for k, v in raw.items() if v is not None}


def next_raw(**over):
    raw = moe_raw(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                  head_dim=8, shared_expert_intermediate_size=24, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    raw.update(over)
    return {k: v for k, v in raw.items() if v is not None}


def hf_config(raw):
    """transformers' own reading of the same dict (the reference)."""
    cls = transformers.Qwen3NextConfig if raw["model_type"] == "qwen3_next" else \
        transformers.Qwen3MoeConfig
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    return cls(**fields)


def hf_rope(hf):
    params = hf.rope_parameters
    return params["rope_theta"], params.get("partial_rotary_factor", 1.0)


def hf_head_dim(hf):
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


@pytest.mark.parametrize("raw", [
    moe_raw(),
    moe_raw(num_experts=None, num_local_experts=6),
    moe_raw(rope_theta=1e6),
    moe_raw(rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    moe_raw(head_dim=16),  # != H / heads, like Qwen3-30B-A3B (128 vs 64)
    moe_raw(norm_topk_prob=None),
    moe_raw(mlp_only_layers=[0, 2]),
    moe_raw(decoder_sparse_step=2),
    moe_raw(decoder_sparse_step=2, mlp_only_layers=[3]),
    next_raw(),
    next_raw(head_dim=None),
    next_raw(partial_rotary_factor=0.5),
    next_raw(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                              "partial_rotary_factor": 0.5}),
    next_raw(rope_theta=1e7, partial_rotary_factor=0.25),
    next_raw(full_attention_interval=2, num_hidden_layers=6),
    next_raw(layer_types=["full_attention", "linear_attention", "linear_attention",
                          "full_attention"]),
    next_raw(norm_topk_prob=None, mlp_only_layers=[1], decoder_sparse_step=1),
], ids=lambda raw: ",".join(sorted(set(raw) - set(moe_raw()))) or raw["model_type"])
def test_variants_match_transformers(raw):
    cfg = ModelConfig.from_dict(raw)
    hf = hf_config(raw)
    theta, partial = hf_rope(hf)
    assert cfg.rope_theta == theta
    assert cfg.partial_rotary_factor == partial
    assert cfg.head_dim == hf_head_dim(hf)
    assert cfg.num_experts == hf.num_experts
    assert cfg.norm_topk_prob == hf.norm_topk_prob
    expected_types = tuple(getattr(hf, "layer_types", None) or
                           [FULL_ATTENTION] * hf.num_hidden_layers)
    assert cfg.layer_types == expected_types
    # transformers' decoder-layer rule for a sparse MoE block
    for i in range(cfg.num_hidden_layers):
        hf_sparse = (i not in hf.mlp_only_layers and hf.num_experts > 0
                     and (i + 1) % hf.decoder_sparse_step == 0)
        assert cfg.is_sparse(i) == hf_sparse, i


def test_defaults_named_in_models_md():
    cfg = ModelConfig.from_dict(moe_raw())
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.head_dim) == (10000.0, 1.0, 8)
    nxt = ModelConfig.from_dict(next_raw())
    assert nxt.partial_rotary_factor == 0.25 and nxt.rotary_dim == 2
    assert nxt.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert nxt.linear_conv_dim == 2 * 2 * 8 + 4 * 8
    assert nxt.num_mtp_layers == 0
    assert ModelConfig.from_dict(next_raw(mtp_num_hidden_layers=1)).num_mtp_layers == 1


def test_top_level_keys_win_over_rope_parameters():
    cfg = ModelConfig.from_dict(next_raw(rope_theta=123.0, rope_parameters={
        "rope_type": "default", "rope_theta": 456.0, "partial_rotary_factor": 0.5}))
    assert cfg.rope_theta == 123.0 and cfg.partial_rotary_factor == 0.5


@pytest.mark.parametrize("raw, words", [
    (moe_raw(architectures=["LlamaForCausalLM"], model_type="llama"),
     ["unsupported architecture", "LlamaForCausalLM"]),
    (moe_raw(hidden_size=None), ["hidden_size"]),
    (moe_raw(num_hidden_layers="4"), ["num_hidden_layers", "integer"]),
    (moe_raw(norm_topk_prob=1), ["norm_topk_prob", "true or false"]),
    (moe_raw(num_key_value_heads=3), ["num_key_value_heads"]),
    (moe_raw(num_experts_per_tok=5), ["num_experts_per_tok"]),
    (moe_raw(decoder_sparse_step=0), ["decoder_sparse_step"]),
    (moe_raw(mlp_only_layers="0,1"), ["mlp_only_layers"]),
    (next_raw(layer_types=["full_attention"] * 3), ["layer_types"]),
    (next_raw(layer_types=["full_attention"] * 3 + ["sliding"]), ["layer_types", "sliding"]),
    (next_raw(linear_num_value_heads=3), ["linear_num_value_heads"]),
    (next_raw(partial_rotary_factor=1.5), ["partial_rotary_factor"]),
    (moe_raw(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["rope_type", "yarn"]),
    (moe_raw(rope_parameters=[1, 2]), ["rope_parameters"]),
])
def test_bad_configs_name_the_key(raw, words):
    with pytest.raises(ModelConfigError) as info:
        ModelConfig.from_dict(raw)
    for word in words:
        assert word in str(info.value)


def test_from_file_names_the_file(tmp_path):
    good = tmp_path / "config.json"
    good.write_text(json.dumps(next_raw()))
    assert ModelConfig.from_file(good).is_next
    cases = {"missing.json": None, "bad.json": "{not json", "list.json": "[1, 2]",
             "arch.json": json.dumps(moe_raw(architectures=["GPT2LMHeadModel"],
                                             model_type="gpt2"))}
    for name, text in cases.items():
        file = tmp_path / name
        if text is not None:
            file.write_text(text)
        with pytest.raises(ModelConfigError, match=name):
            ModelConfig.from_file(file)
