"""Write a tiny safetensors model (scripts/tiny_model.py) as a GGUF, the way llama.cpp's
``convert_hf_to_gguf.py`` does for qwen3moe / qwen3next: its metadata keys, the names of
the ``gguf`` package's own TensorNameMap (not Tandem's mapping), the converter's value
changes (qwen3next: norms + 1, A_log -> -exp(A_log), conv1d squeezed, in_proj_qkvz split
into attn_qkv + attn_gate), the tokenizer as ``tokenizer.ggml.*`` and the chat template.
Quantized with ``gguf.quants`` where it has a quantizer; for the K-quants and IQ4_XS (which
it only dequantizes) the blocks are random with small finite scales.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from gpu_worker.weights.checkpoint import CheckpointSource

ARCH = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT}
QUANTIZABLE = (T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
SCALE_BYTES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}  # fp16 d, dmin
MTP_NAMES = {"mtp.fc.weight": "nextn.eh_proj.weight",
             "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
             "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
             "mtp.norm.weight": "nextn.shared_head_norm.weight"}
QType = Callable[[str, np.ndarray], T]  # (GGUF name, array) -> type to store it in


def default_types(name: str, arr: np.ndarray) -> T:
    return T.F32


def experts_in(qtype: T, rest: T = T.F32) -> QType:
    """Routed experts (``*_exps``) in ``qtype``, other matrices in ``rest``."""
    def pick(name: str, arr: np.ndarray) -> T:
        want = qtype if "_exps." in name else rest
        if arr.ndim < 2 or arr.shape[-1] % GGML_QUANT_SIZES[want][0]:
            return T.F32  # vectors, and rows of no whole block (ssm_conv1d), stay F32
        return qtype if "_exps." in name else rest
    return pick


def write_gguf(model_dir: Path, out: Path, *, types: QType = default_types,
               split_max_tensors: int = 0, mtp: bool = True, seed: int = 0,
               skip: tuple[str, ...] = (), arch_name: str | None = None) -> Path:
    """``model_dir`` (a tiny model) as GGUF ``out``; returns the path to load (the first
    file when split). ``skip``: GGUF tensor names left out; ``arch_name``: another
    ``general.architecture`` (error tests)."""
    src = CheckpointSource(model_dir, include_mtp=mtp)
    cfg, raw = src.config, json.loads((model_dir / "config.json").read_text())
    arch = ARCH[cfg.arch]
    nextn = cfg.num_mtp_layers if mtp else 0
    writer = gguf.GGUFWriter(out, arch_name or gguf.MODEL_ARCH_NAMES[arch],
                             split_max_tensors=split_max_tensors)
    _metadata(writer, cfg, raw, nextn)
    _tokenizer(writer, model_dir, cfg.vocab_size)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers + nextn)
    rng = np.random.default_rng(seed)
    for canonical in src.shapes():
        if canonical == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        for name, arr in _converted(canonical, src.read(canonical, np.float32), cfg, names):
            if name not in skip:
                _add(writer, name, arr, types(name, arr), rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out if split_max_tensors == 0 else writer.format_shard_names(out)[0]


def _metadata(w: gguf.GGUFWriter, cfg, raw: dict, nextn: int) -> None:
    w.add_block_count(cfg.num_hidden_layers + nextn)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if cfg.is_next:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        w.add_ssm_state_size(cfg.linear_key_head_dim)
        w.add_ssm_group_count(cfg.linear_num_key_heads)
        w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        w.add_full_attention_interval(raw.get("full_attention_interval", 4))
        w.add_rope_dimension_count(cfg.rotary_dim)
        if nextn:
            w.add_nextn_predict_layers(nextn)


def _tokenizer(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """tokenizer.json -> tokenizer.ggml.* as the converter's gpt2 path writes them."""
    file = model_dir / "tokenizer.json"
    if not file.is_file():
        return
    tok = json.loads(file.read_text())
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = (gguf.TokenType.CONTROL if added["special"]
                              else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    w.add_pad_token_id(gen.get("pad_token_id", 0))
    w.add_add_bos_token(False)
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text())


def _converted(canonical: str, arr: np.ndarray, cfg, names) -> list[tuple[str, np.ndarray]]:
    """What the converter writes for one canonical tensor: [(GGUF name, array)]."""
    hf = canonical
    if hf.startswith("mtp."):
        if hf in MTP_NAMES:
            arr = arr + 1 if MTP_NAMES[hf].endswith("norm.weight") else arr  # enorm too
            return [(f"blk.{cfg.num_hidden_layers}.{MTP_NAMES[hf]}", arr)]
        hf = "model.layers." + str(cfg.num_hidden_layers + int(hf.split(".")[2])) + "." + \
            ".".join(hf.split(".")[3:])
    if ".mlp.experts." in hf:
        hf += ".weight"
    if cfg.is_next:
        if hf.endswith(".A_log"):
            arr = -np.exp(arr)
        elif hf.endswith(".dt_bias"):
            hf = hf.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in hf:
            arr = arr.squeeze()
        elif hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
            arr = arr + 1
        if hf.endswith("in_proj_qkvz.weight"):
            return _split_qkvz(arr, cfg, hf.split(".")[2])
    name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf
    return [(name, arr)]


def _split_qkvz(w: np.ndarray, cfg, block: str) -> list[tuple[str, np.ndarray]]:
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    vr = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim
    heads = w.reshape(nk, 2 * dk + 2 * vr, -1)
    q, k, v, z = np.split(heads, [dk, 2 * dk, 2 * dk + vr], axis=1)
    qkv = np.concatenate([p.reshape(-1, w.shape[1]) for p in (q, k, v)])
    return [(f"blk.{block}.attn_qkv.weight", qkv),
            (f"blk.{block}.attn_gate.weight", z.reshape(-1, w.shape[1]))]


def _add(w: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: T,
         rng: np.random.Generator) -> None:
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == T.F32:
        w.add_tensor(name, arr)
    elif qtype == T.F64:
        w.add_tensor(name, arr.astype(np.float64))
    elif qtype in QUANTIZABLE:
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    else:
        w.add_tensor(name, random_blocks(arr.shape, qtype, rng), raw_dtype=qtype)


def random_blocks(shape: tuple[int, ...], qtype: T, rng: np.random.Generator,
                  scale: float = 2e-4) -> np.ndarray:
    """Random ``qtype`` rows for a float ``shape`` (bytes ``[..., row_bytes]``) whose fp16
    scales are small and finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for at in SCALE_BYTES[qtype]:
        d = rng.uniform(0.5, 1.0, raw.shape[:-1]).astype(np.float32) * scale
        raw[..., at:at + 2] = d.astype("<f2")[..., None].view(np.uint8)
    return raw.reshape(*shape[:-1], -1)
