"""Tiny random Qwen3-MoE / Qwen3-Next checkpoints in the exact on-disk format of real ones.

Uses only NumPy, the safetensors format (written by `safetensors_io`) and `tokenizers`:
no torch. `scripts/make_tiny_model.py` is the command-line wrapper.

The weights are generated in canonical form (`weights_spec.expected_tensors`) and then
written in the requested expert layout: per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
as the public checkpoints) or transformers-5 fused (`mlp.experts.gate_up_proj` [E, 2I, H],
gate rows first, + `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from gpu_worker.model_config import ModelConfig
from gpu_worker.safetensors_io import write_file
from gpu_worker.weights_spec import expected_tensors
from scripts.tiny_tokenizer import write_tokenizer

ARCH_NAMES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
EXPERT_LAYOUTS = ("per_expert", "fused")
DEFAULT_SIZES: dict[str, Any] = {
    "hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16, "experts": 8,
    "topk": 2, "moe_intermediate": 32, "intermediate": 96, "shared_intermediate": 48,
    "vocab": 512, "linear_key_heads": 2, "linear_value_heads": 4, "linear_key_dim": 16,
    "linear_value_dim": 16, "conv_kernel": 4, "partial_rotary_factor": None,
    "full_attention_interval": 4, "decoder_sparse_step": 1, "mlp_only_layers": (),
    "tie_embeddings": False, "norm_topk_prob": True, "attention_bias": False,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "std": 0.02, "mtp": True,
    "max_position_embeddings": 4096,
}
NORM_STD = 0.1  # spread of random norm weights around their neutral value


def make_tiny_model(out_dir: str | Path, arch: str, seed: int = 0, *, dtype: str = "float32",
                    expert_layout: str = "per_expert", shards: int = 1,
                    tokenizer: bool = True, **sizes: Any) -> Path:
    """Write a tiny random `arch` checkpoint into `out_dir` and return its path.

    `sizes` override DEFAULT_SIZES (keys as there, e.g. hidden=32, experts=4, mtp=False).
    """
    if arch not in ARCH_NAMES:
        raise ValueError(f"arch must be one of {', '.join(ARCH_NAMES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {', '.join(EXPERT_LAYOUTS)}")
    unknown = set(sizes) - set(DEFAULT_SIZES)
    if unknown:
        raise ValueError(f"unknown size options: {', '.join(sorted(unknown))}")
    s = {**DEFAULT_SIZES, **sizes}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    special = write_tokenizer(out, s["vocab"]) if tokenizer else {}
    eos = [special["<|im_end|>"], special["<|endoftext|>"]] if special else [s["vocab"] - 1]
    raw_config = build_config(arch, s, dtype, eos)
    config = ModelConfig.from_dict(raw_config)  # validates the sizes
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    generation = {"bos_token_id": special.get("<|endoftext|>", eos[-1]), "eos_token_id": eos,
                  "pad_token_id": special.get("<|endoftext|>", eos[-1]), "do_sample": True,
                  "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    tensors = random_tensors(config, np.random.default_rng(seed), s["std"])
    on_disk = to_disk_layout(tensors, config, expert_layout)
    _write_shards(out, on_disk, DTYPES[dtype], shards)
    return out


def build_config(arch: str, s: dict[str, Any], dtype: str, eos: list[int]) -> dict[str, Any]:
    """config.json in the style of the public Qwen checkpoints (top-level rope_theta)."""
    is_next = arch == "qwen3_next"
    partial = s["partial_rotary_factor"]
    if partial is None:
        partial = 0.25 if is_next else 1.0
    config: dict[str, Any] = {
        "architectures": [ARCH_NAMES[arch]],
        "model_type": arch,
        "vocab_size": s["vocab"],
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": s["max_position_embeddings"],
        "initializer_range": s["std"],
        "rms_norm_eps": s["rms_norm_eps"],
        "use_cache": True,
        "tie_word_embeddings": bool(s["tie_embeddings"]),
        "rope_theta": s["rope_theta"],
        "rope_scaling": None,
        "attention_bias": bool(s["attention_bias"]),
        "attention_dropout": 0.0,
        "decoder_sparse_step": s["decoder_sparse_step"],
        "moe_intermediate_size": s["moe_intermediate"],
        "num_experts_per_tok": s["topk"],
        "num_experts": s["experts"],
        "norm_topk_prob": bool(s["norm_topk_prob"]),
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "mlp_only_layers": list(s["mlp_only_layers"]),
        "bos_token_id": eos[-1],
        "eos_token_id": eos[0],
        "dtype": dtype,
    }
    if is_next:
        config.update({
            "partial_rotary_factor": partial,
            "full_attention_interval": s["full_attention_interval"],
            "shared_expert_intermediate_size": s["shared_intermediate"],
            "linear_conv_kernel_dim": s["conv_kernel"],
            "linear_key_head_dim": s["linear_key_dim"],
            "linear_value_head_dim": s["linear_value_dim"],
            "linear_num_key_heads": s["linear_key_heads"],
            "linear_num_value_heads": s["linear_value_heads"],
            "mtp_num_hidden_layers": 1 if s["mtp"] else 0,
            "mtp_use_dedicated_embeddings": False,
        })
    else:
        if partial != 1.0:
            raise ValueError("partial_rotary_factor applies to qwen3_next only")
        config.update({"use_sliding_window": False, "sliding_window": None,
                       "max_window_layers": s["layers"]})
    return config


def random_tensors(config: ModelConfig, rng: np.random.Generator,
                   std: float) -> dict[str, np.ndarray]:
    """Canonical float32 tensors: N(0, std) matrices, norms near their neutral value,
    GDN decay parameters in their usual ranges."""
    out = {}
    for name, shape in expected_tensors(config, include_mtp=True).items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            out[name] = out["model.embed_tokens.weight"]
        else:
            out[name] = _init(name, shape, config, rng, std)
    return out


def _init(name: str, shape: tuple[int, ...], config: ModelConfig, rng: np.random.Generator,
          std: float) -> np.ndarray:
    def normal(scale: float) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    if name.endswith("linear_attn.norm.weight"):  # gated norm: plain weight
        return 1.0 + normal(NORM_STD)
    if name.endswith("norm.weight"):  # zero-centred (1 + w) in Qwen3-Next, plain in Qwen3-MoE
        return normal(NORM_STD) if config.zero_centered_norms else 1.0 + normal(NORM_STD)
    if name.endswith(".A_log"):  # A in [1, 16) like transformers' init, kept away from 0
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith(".dt_bias"):  # inverse softplus of dt in [1e-3, 1e-1], log-uniform
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
        return np.log(np.expm1(dt)).astype(np.float32)
    if name.endswith("conv1d.weight"):  # PyTorch's default conv scale, 1/sqrt(kernel)
        bound = 1.0 / math.sqrt(shape[-1])
        return rng.uniform(-bound, bound, shape).astype(np.float32)
    return normal(std)


def to_disk_layout(tensors: dict[str, np.ndarray], config: ModelConfig,
                   expert_layout: str) -> dict[str, np.ndarray]:
    """Canonical tensors -> on-disk names (expert layout, tied lm_head omitted)."""
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith(".mlp.experts.gate_proj"):
            prefix = name[: -len(".gate_proj")]
            gate, up = value, tensors[f"{prefix}.up_proj"]
            if expert_layout == "fused":
                out[f"{prefix}.gate_up_proj"] = np.concatenate([gate, up], axis=1)  # [E, 2I, H]
            else:
                for e in range(gate.shape[0]):
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]  # [I, H]
                    out[f"{prefix}.{e}.up_proj.weight"] = up[e]
        elif name.endswith(".mlp.experts.up_proj"):
            continue
        elif name.endswith(".mlp.experts.down_proj") and expert_layout == "per_expert":
            prefix = name[: -len(".down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = value[e]  # [H, I]
        else:
            out[name] = value
    return out


def _write_shards(out: Path, tensors: dict[str, np.ndarray], st_dtype: str, shards: int) -> None:
    if shards < 1:
        raise ValueError("shards must be >= 1")
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    if shards == 1:
        write_file(out / "model.safetensors", tensors, dtype=st_dtype)
        return
    itemsize = 4 if st_dtype == "F32" else 2
    total = sum(t.size for t in tensors.values()) * itemsize
    groups: list[dict[str, np.ndarray]] = [{} for _ in range(shards)]
    done = 0
    for name, value in tensors.items():  # contiguous runs of about total/shards bytes
        groups[min(shards - 1, done * shards // max(total, 1))][name] = value
        done += value.size * itemsize
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_file(out / file, group, dtype=st_dtype)
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
