"""llama.cpp's names and metadata for qwen3moe / qwen3next GGUF files -> Tandem's.

What llama.cpp's ``convert_hf_to_gguf.py`` writes for these architectures, and how each
canonical tensor (gpu_worker/weights_spec.py) is found again (docs/gguf.md has the table):

* names: ``token_embd``, ``output_norm``, ``output`` (absent: tied), ``blk.N.attn_norm``,
  ``blk.N.ffn_norm`` (qwen3moe) / ``blk.N.post_attention_norm`` (qwen3next),
  ``blk.N.attn_{q,k,v,output}``, ``blk.N.attn_{q,k}_norm``, ``blk.N.ffn_gate_inp``
  (router), ``blk.N.ffn_{gate,up,down}_exps`` (stacked experts, or ``ffn_gate_up_exps``),
  ``blk.N.ffn_{gate,up,down}_shexp`` + ``ffn_gate_inp_shexp`` (shared expert),
  ``blk.N.ssm_*`` / ``attn_qkv`` / ``attn_gate`` (Gated DeltaNet).
* values the converter changed, undone here: qwen3next's zero-centred norms were stored
  as ``w + 1`` (every ``*norm.weight`` but the DeltaNet's gated ``ssm_norm``), ``A_log`` as
  ``-exp(A_log)``, ``conv1d`` [C, 1, K] squeezed to [C, K], and ``in_proj_qkvz`` (rows
  interleaved per key head: q, k, v, z) split into ``attn_qkv`` ([all q | all k | all v])
  and ``attn_gate`` (all z).
* qwen3next's layer kinds: ``attention.recurrent_layers`` (one bool per block) where
  present, as llama.cpp reads it; else every ``full_attention_interval``-th layer is full.
* MTP (qwen3next; written by the converter since llama.cpp added next-token layers for
  Qwen3-Next, docs/gguf.md): a file that declares ``qwen3next.nextn_predict_layers`` = n
  has ``block_count`` counting them, block ``L + i`` is MTP layer i
  (its attention and MoE under the names above), and ``blk.L.nextn.{eh_proj, enorm,
  hnorm, shared_head_norm}`` are ``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.norm``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gpu_worker.model_config import FULL_ATTENTION, LINEAR_ATTENTION

ARCHS = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen3next": "Qwen3NextForCausalLM"}

NORM_SHIFT = "norm_shift"  # stored w + 1 -> w
A_LOG = "a_log"            # stored -exp(A_log) -> A_log
QKVZ = "qkvz"              # attn_qkv + attn_gate -> in_proj_qkvz

_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_MLP = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_LINEAR = {"in_proj_ba.weight": "ssm_ba.weight", "conv1d.weight": "ssm_conv1d.weight",
           "dt_bias": "ssm_dt.bias", "A_log": "ssm_a", "norm.weight": "ssm_norm.weight",
           "out_proj.weight": "ssm_out.weight"}
_MTP = {"mtp.fc.weight": "nextn.eh_proj.weight",
        "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
        "mtp.norm.weight": "nextn.shared_head_norm.weight"}


@dataclasses.dataclass(frozen=True, slots=True)
class Stored:
    """Where a canonical tensor lies in the file: one GGUF tensor (or two for QKVZ), the
    rows of it (``part``: gate or up of a fused ``ffn_gate_up_exps``) and the transform."""

    names: tuple[str, ...]
    transform: str | None = None
    part: int | None = None  # 0: first half of axis 1 (gate), 1: second half (up)


def gguf_name(canonical: str, arch: str, num_layers: int) -> Stored:
    """Where canonical tensor ``canonical`` is stored; KeyError for a name of no GGUF."""
    next_ = arch == "qwen3next"
    shift = NORM_SHIFT if next_ else None
    top = {"model.embed_tokens.weight": Stored(("token_embd.weight",)),
           "lm_head.weight": Stored(("output.weight",)),
           "model.norm.weight": Stored(("output_norm.weight",), shift)}
    if canonical in top:
        return top[canonical]
    if canonical in _MTP:
        # the converter renames mtp.* to blk.L.nextn.* before it adds 1 to every name
        # ending in norm.weight: enorm and hnorm are shifted too, eh_proj is not
        return Stored((f"blk.{num_layers}.{_MTP[canonical]}",),
                      shift if _MTP[canonical].endswith("norm.weight") else None)
    parts = canonical.split(".")
    if parts[0] == "model" and parts[1] == "layers":
        block, rest = int(parts[2]), ".".join(parts[3:])
    elif parts[0] == "mtp" and parts[1] == "layers":
        block, rest = num_layers + int(parts[2]), ".".join(parts[3:])
    else:
        raise KeyError(canonical)
    found = _layer_name(rest, next_)
    if found is None:
        raise KeyError(canonical)
    name, transform, part = found
    if transform == NORM_SHIFT and not next_:
        transform = None
    names = tuple(f"blk.{block}.{n}" for n in name.split("+"))
    return Stored(names, transform, part)


def _layer_name(rest: str, next_: bool) -> tuple[str, str | None, int | None] | None:
    """(GGUF name(s) joined by '+', transform, part) of a layer tensor ``rest``."""
    post = "post_attention_norm" if next_ else "ffn_norm"
    norms = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": f"{post}.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight"}
    if rest in norms:
        return norms[rest], NORM_SHIFT, None
    kind, _, leaf = rest.partition(".")
    if kind == "self_attn":
        proj, _, suffix = leaf.partition(".")
        return (f"{_ATTN[proj]}.{suffix}", None, None) if proj in _ATTN else None
    if kind == "linear_attn":
        if leaf == "in_proj_qkvz.weight":
            return "attn_qkv.weight+attn_gate.weight", QKVZ, None
        if leaf in _LINEAR:
            return _LINEAR[leaf], A_LOG if leaf == "A_log" else None, None
        return None
    if kind != "mlp":
        return None
    if leaf == "gate.weight":
        return "ffn_gate_inp.weight", None, None
    if leaf == "shared_expert_gate.weight":
        return "ffn_gate_inp_shexp.weight", None, None
    sub, _, proj = leaf.partition(".")
    if sub == "experts" and proj in _MLP:
        return f"ffn_{_MLP[proj]}_exps.weight", None, None
    if sub == "shared_expert" and proj.removesuffix(".weight") in _MLP:
        return f"ffn_{_MLP[proj.removesuffix('.weight')]}_shexp.weight", None, None
    if sub in _MLP and proj == "weight":  # a dense MLP layer
        return f"ffn_{_MLP[sub]}.weight", None, None
    return None


def config_dict(meta: Callable[[str], Any], arch: str, tensors: dict[str, tuple[int, ...]]
                ) -> dict[str, Any]:
    """A Hugging Face style config.json dict from GGUF metadata (``meta(key)``: the value
    or None) and the tensors' numpy shapes, for ModelConfig.from_dict."""
    def need(key: str) -> Any:
        value = meta(f"{arch}.{key}")
        if value is None:
            raise KeyError(f"{arch}.{key}")
        return value

    def opt(key: str, default: Any = None) -> Any:
        value = meta(f"{arch}.{key}")
        return default if value is None else value

    mtp = int(opt("nextn_predict_layers", 0)) if arch == "qwen3next" else 0
    layers = int(need("block_count")) - mtp
    heads, kv = _one(need("attention.head_count")), _one(opt("attention.head_count_kv"))
    hidden = int(need("embedding_length"))
    head_dim = int(opt("attention.key_length", hidden // heads))
    raw: dict[str, Any] = {
        "architectures": [ARCHS[arch]],
        "vocab_size": int(opt("vocab_size", tensors["token_embd.weight"][0])),
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv if kv is not None else heads, "head_dim": head_dim,
        "intermediate_size": int(opt("feed_forward_length", 0)),
        "num_experts": int(opt("expert_count", 0)),
        "num_experts_per_tok": int(opt("expert_used_count", 0)),
        "norm_topk_prob": bool(opt("expert_weights_norm", True)),  # llama.cpp: always on
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(opt("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(opt("context_length", 32768)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in tensors),
        "mlp_only_layers": [i for i in range(layers)
                            if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
    }
    gate = next((s for n, s in tensors.items() if n.endswith("_exps.weight")), None)
    raw["moe_intermediate_size"] = int(opt("expert_feed_forward_length",
                                           gate[1] if gate else 0))
    scaling = opt("rope.scaling.type")
    if scaling not in (None, "none"):
        raw["rope_scaling"] = {"rope_type": scaling}  # ModelConfig names it unsupported
    rope_dims = opt("rope.dimension_count")
    if rope_dims is not None:
        raw["partial_rotary_factor"] = int(rope_dims) / head_dim
    if arch == "qwen3next":
        value_heads = int(need("ssm.time_step_rank"))
        shexp = tensors.get("blk.0.ffn_gate_shexp.weight")
        raw.update({
            "full_attention_interval": int(opt("full_attention_interval", 4)),
            "shared_expert_intermediate_size": int(opt(
                "expert_shared_feed_forward_length", shexp[0] if shexp else 0)),
            "linear_conv_kernel_dim": int(need("ssm.conv_kernel")),
            "linear_key_head_dim": int(need("ssm.state_size")),
            "linear_num_key_heads": int(need("ssm.group_count")),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": int(need("ssm.inner_size")) // value_heads,
            "mtp_num_hidden_layers": mtp,
        })
        recurrent = opt("attention.recurrent_layers")  # per block, as llama.cpp prefers it
        if recurrent is not None:
            raw["layer_types"] = [LINEAR_ATTENTION if r else FULL_ATTENTION
                                  for r in list(recurrent)[:layers]]
    return raw


def _one(value: Any) -> int | None:
    """A head count stored as one number or per layer (zeros for layers without
    attention): the one non-zero value."""
    if value is None or isinstance(value, int):
        return value
    counts = {int(v) for v in value if int(v)}
    if len(counts) != 1:
        raise ValueError(f"per-layer head counts differ: {sorted(counts)}")
    return counts.pop()
