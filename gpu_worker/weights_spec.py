"""Canonical tensor names and shapes of Tandem's in-memory model.

Canonical names are the Hugging Face names (as in transformers 5.x's modeling files),
except that routed experts are stacked per layer:

    {prefix}.mlp.experts.gate_proj  [E, I, H]
    {prefix}.mlp.experts.up_proj    [E, I, H]
    {prefix}.mlp.experts.down_proj  [E, H, I]

`lm_head.weight` is always present (the loader copies the embedding when tied).
MTP weights (`mtp.*`, Qwen3-Next only) follow the names of the public checkpoints; each
MTP layer is a full-attention decoder layer with the sparse MoE block.
"""

from __future__ import annotations

from gpu_worker.model_config import ModelConfig

Shape = tuple[int, ...]

# NOTE: the on-disk per-expert names and the fused transformers-5 names map onto these.
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def expected_tensors(config: ModelConfig, *, include_mtp: bool) -> dict[str, Shape]:
    """Every canonical tensor of `config`'s model with its shape, in a stable order."""
    H, V = config.hidden_size, config.vocab_size
    out: dict[str, Shape] = {"model.embed_tokens.weight": (V, H)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        if config.is_full_attention(layer):
            out.update(_attention(config, prefix))
        else:
            out.update(_linear_attention(config, prefix))
        if config.is_sparse(layer):
            out.update(_sparse_moe(config, prefix))
        else:
            out.update(_mlp(f"{prefix}.mlp", H, config.intermediate_size))
        out.update(_layer_norms(config, prefix))
    out["model.norm.weight"] = (H,)
    out["lm_head.weight"] = (V, H)
    if include_mtp and config.num_mtp_layers:
        out.update(_mtp(config))
    return out


def is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


def _layer_norms(config: ModelConfig, prefix: str) -> dict[str, Shape]:
    H = config.hidden_size
    return {f"{prefix}.input_layernorm.weight": (H,),
            f"{prefix}.post_attention_layernorm.weight": (H,)}


def _attention(config: ModelConfig, prefix: str) -> dict[str, Shape]:
    H, hd = config.hidden_size, config.head_dim
    q_out = config.num_attention_heads * hd * (2 if config.gated_attention else 1)
    kv_out = config.num_key_value_heads * hd
    outs = {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out}
    p = f"{prefix}.self_attn"
    shapes: dict[str, Shape] = {}
    for name, rows in outs.items():
        shapes[f"{p}.{name}.weight"] = (rows, H)
        if config.attention_bias:
            shapes[f"{p}.{name}.bias"] = (rows,)
    shapes[f"{p}.o_proj.weight"] = (H, config.num_attention_heads * hd)
    if config.attention_bias:  # transformers puts attention_bias on o_proj too
        shapes[f"{p}.o_proj.bias"] = (H,)
    shapes[f"{p}.q_norm.weight"] = (hd,)
    shapes[f"{p}.k_norm.weight"] = (hd,)
    return shapes


def _linear_attention(config: ModelConfig, prefix: str) -> dict[str, Shape]:
    H = config.hidden_size
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    Hv = config.linear_num_value_heads
    p = f"{prefix}.linear_attn"
    return {
        f"{p}.in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, H),
        f"{p}.in_proj_ba.weight": (2 * Hv, H),
        f"{p}.conv1d.weight": (config.linear_conv_dim, 1, config.linear_conv_kernel_dim),
        f"{p}.dt_bias": (Hv,),
        f"{p}.A_log": (Hv,),
        f"{p}.norm.weight": (config.linear_value_head_dim,),
        f"{p}.out_proj.weight": (H, value_dim),
    }


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, Shape]:
    return {f"{prefix}.gate_proj.weight": (inter, hidden),
            f"{prefix}.up_proj.weight": (inter, hidden),
            f"{prefix}.down_proj.weight": (hidden, inter)}


def _sparse_moe(config: ModelConfig, prefix: str) -> dict[str, Shape]:
    H, E, I = config.hidden_size, config.num_experts, config.moe_intermediate_size
    p = f"{prefix}.mlp"
    shapes: dict[str, Shape] = {
        f"{p}.gate.weight": (E, H),
        f"{p}.experts.gate_proj": (E, I, H),
        f"{p}.experts.up_proj": (E, I, H),
        f"{p}.experts.down_proj": (E, H, I),
    }
    if config.is_next:
        shapes.update(_mlp(f"{p}.shared_expert", H, config.shared_expert_intermediate_size))
        shapes[f"{p}.shared_expert_gate.weight"] = (1, H)
    return shapes


def _mtp(config: ModelConfig) -> dict[str, Shape]:
    H = config.hidden_size
    shapes: dict[str, Shape] = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
    }
    for layer in range(config.num_mtp_layers):
        prefix = f"mtp.layers.{layer}"
        shapes.update(_attention(config, prefix))
        if config.num_experts:
            shapes.update(_sparse_moe(config, prefix))
        else:
            shapes.update(_mlp(f"{prefix}.mlp", H, config.intermediate_size))
        shapes.update(_layer_norms(config, prefix))
    shapes["mtp.norm.weight"] = (H,)
    return shapes
