"""Model configuration parsed from a Hugging Face ``config.json``.

One frozen dataclass for both supported architectures. Every key variant listed in
docs/architecture.md §11 is accepted here, so the rest of the code reads plain attributes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


class ModelConfigError(ValueError):
    """A config.json that Tandem cannot serve; the message names the key."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # "qwen3_moe" | "qwen3_next"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    # Qwen3-Next only (zero / empty for Qwen3-MoE)
    shared_expert_intermediate_size: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES.values():
            raise ModelConfigError(f"unsupported architecture {self.arch!r}")
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim")
        for key in positive:
            if getattr(self, key) <= 0:
                raise ModelConfigError(f"{key} must be positive, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError("num_experts_per_tok must be in 1..num_experts")
        if self.decoder_sparse_step <= 0:
            raise ModelConfigError("decoder_sparse_step must be positive")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelConfigError("layer_types must have num_hidden_layers entries")
        for kind in self.layer_types:
            if kind not in (FULL_ATTENTION, LINEAR_ATTENTION):
                raise ModelConfigError(f"layer_types: unknown layer kind {kind!r}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ModelConfigError(
                "partial_rotary_factor * head_dim must be an even number <= head_dim")
        if self.is_next and LINEAR_ATTENTION in self.layer_types:
            if self.linear_num_key_heads <= 0 or self.linear_num_value_heads <= 0:
                raise ModelConfigError(
                    "linear_num_key_heads / linear_num_value_heads must be positive")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ModelConfigError(
                    "linear_num_value_heads must be a multiple of linear_num_key_heads")

    # ---- derived -------------------------------------------------------------------------
    @property
    def is_next(self) -> bool:
        return self.arch == "qwen3_next"

    @property
    def zero_centered_norms(self) -> bool:
        return self.is_next

    @property
    def gated_attention(self) -> bool:
        return self.is_next

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL_ATTENTION

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_full_attention(i))

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_full_attention(i))

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN causal conv: [all q | all k | all v]."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except OSError as exc:
            raise ModelConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path}: not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path}: expected a JSON object")
        try:
            return _parse(raw)
        except ModelConfigError as exc:
            raise ModelConfigError(f"{path}: {exc}") from None


def _arch_of(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = raw.get("model_type")
    if model_type in ARCHITECTURES.values():
        return model_type
    shown = ", ".join(names) if names else f"model_type={model_type!r}"
    raise ModelConfigError(f"unsupported architecture {shown}; Tandem serves "
                      f"{', '.join(ARCHITECTURES)}")


def _parse(raw: dict[str, Any]) -> ModelConfig:
    arch = _arch_of(raw)
    is_next = arch == "qwen3_next"

    def need(key: str, kind: type = int) -> Any:
        if key not in raw:
            raise ModelConfigError(f"missing key {key!r}")
        return _typed(key, raw[key], kind)

    def opt(key: str, default: Any, kind: type = int) -> Any:
        value = raw.get(key)
        return default if value is None else _typed(key, value, kind)

    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelConfigError("rope_parameters must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":  # yarn / linear / dynamic scaling would silently change logits
        raise ModelConfigError(f"rope_parameters: unsupported rope_type {rope_type!r} "
                          "(only 'default' RoPE is implemented)")
    rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    partial = raw.get("partial_rotary_factor",
                      rope.get("partial_rotary_factor", 0.25 if is_next else 1.0))

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    layers = need("num_hidden_layers")
    if "num_experts" in raw and raw["num_experts"] is not None:
        experts = _typed("num_experts", raw["num_experts"], int)
    else:
        experts = opt("num_local_experts", 0)

    layer_types = raw.get("layer_types")
    if layer_types is None:
        if is_next:
            interval = opt("full_attention_interval", 4)
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                           for i in range(layers)]
        else:
            layer_types = [FULL_ATTENTION] * layers
    if not isinstance(layer_types, list):
        raise ModelConfigError("layer_types must be a list")

    mtp_layers = raw.get("mtp_num_hidden_layers", raw.get("num_nextn_predict_layers", 0))
    mlp_only = raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list):
        raise ModelConfigError("mlp_only_layers must be a list of layer indices")

    return ModelConfig(
        arch=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=opt("num_key_value_heads", heads),
        # transformers: Qwen3-Next's config defaults head_dim to 256, Qwen3-MoE's to H / heads
        head_dim=opt("head_dim", 256 if is_next else hidden // heads),
        intermediate_size=opt("intermediate_size", 0),
        moe_intermediate_size=opt("moe_intermediate_size", 0),
        num_experts=experts,
        num_experts_per_tok=opt("num_experts_per_tok", 0),
        norm_topk_prob=opt("norm_topk_prob", is_next, bool),  # transformers' defaults
        decoder_sparse_step=opt("decoder_sparse_step", 1),
        mlp_only_layers=tuple(_typed("mlp_only_layers", i, int) for i in mlp_only),
        rms_norm_eps=opt("rms_norm_eps", 1e-6, float),
        rope_theta=_typed("rope_theta", rope_theta, float),
        partial_rotary_factor=_typed("partial_rotary_factor", partial, float),
        tie_word_embeddings=opt("tie_word_embeddings", False, bool),
        attention_bias=opt("attention_bias", False, bool),
        max_position_embeddings=opt("max_position_embeddings", 32768),
        layer_types=tuple(layer_types),
        shared_expert_intermediate_size=opt("shared_expert_intermediate_size", 0) if is_next else 0,
        linear_num_key_heads=opt("linear_num_key_heads", 0) if is_next else 0,
        linear_num_value_heads=opt("linear_num_value_heads", 0) if is_next else 0,
        linear_key_head_dim=opt("linear_key_head_dim", 0) if is_next else 0,
        linear_value_head_dim=opt("linear_value_head_dim", 0) if is_next else 0,
        linear_conv_kernel_dim=opt("linear_conv_kernel_dim", 4) if is_next else 0,
        num_mtp_layers=_typed("mtp_num_hidden_layers", mtp_layers or 0, int) if is_next else 0,
    )


def _typed(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if not isinstance(value, bool):
            raise ModelConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    raise TypeError(kind)
