"""The on-disk format: Qwen3-Next checkpoint names (experts split per expert), bf16 shards, and
the ``export`` / ``interpolate`` sub-commands that write it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3NextConfig

from scripts.train.model import TinyModel, make_config

MAX_SHARD_BYTES = 12 * 1024 * 1024


def to_hf_state(model: TinyModel, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Model + MTP weights under Qwen3-Next checkpoint names, experts split per expert."""
    out: dict[str, torch.Tensor] = {}
    items = [(k, v) for k, v in model.lm.state_dict().items()]
    items += [("mtp." + k, v) for k, v in model.mtp.state_dict().items()]
    for k, v in items:
        if k == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        v = v.detach().to("cpu", dtype)
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v.contiguous()
    return out


def from_hf_state(model: TinyModel, state: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`to_hf_state` (loads into fused or per-expert module layouts)."""
    lm_sd, mtp_sd = model.lm.state_dict(), model.mtp.state_dict()
    new_lm: dict[str, torch.Tensor] = {}
    new_mtp: dict[str, torch.Tensor] = {}
    for target, prefix, new in ((lm_sd, "", new_lm), (mtp_sd, "mtp.", new_mtp)):
        for k, ref in target.items():
            src = prefix + k
            if src in state:
                new[k] = state[src]
            elif k == "lm_head.weight":
                new[k] = state["model.embed_tokens.weight"]
            elif k.endswith("mlp.experts.gate_up_proj"):
                base = src[: -len("gate_up_proj")]
                new[k] = torch.stack([
                    torch.cat([state[f"{base}{e}.gate_proj.weight"],
                               state[f"{base}{e}.up_proj.weight"]], 0)
                    for e in range(ref.shape[0])])
            elif k.endswith("mlp.experts.down_proj"):
                base = src[: -len("down_proj")]
                new[k] = torch.stack([state[f"{base}{e}.down_proj.weight"]
                                      for e in range(ref.shape[0])])
            else:
                raise KeyError(f"checkpoint lacks {src}")
            new[k] = new[k].to(ref.dtype)
    model.lm.load_state_dict(new_lm)
    model.mtp.load_state_dict(new_mtp)


CONFIG_DROP = {"transformers_version", "output_router_logits", "output_hidden_states",
               "output_attentions", "return_dict", "chunk_size_feed_forward",
               "is_encoder_decoder", "id2label", "label2id", "problem_type"}


def clean_config(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in CONFIG_DROP}


def config_dict(cfg: Qwen3NextConfig) -> dict:
    d = clean_config(cfg.to_dict())
    d["architectures"] = ["Qwen3NextForCausalLM"]
    d["model_type"] = "qwen3_next"
    d["torch_dtype"] = "bfloat16"
    d["dtype"] = "bfloat16"
    d["mtp_num_hidden_layers"] = 1
    d["full_attention_interval"] = 4
    d["partial_rotary_factor"] = 0.25
    d["rope_theta"] = 10000.0
    return d


def save_checkpoint(model: TinyModel, out: Path, meta: dict) -> None:
    """bf16 weights in <= 12 MiB shards + index + config + train_state.json."""
    out.mkdir(parents=True, exist_ok=True)
    state = to_hf_state(model)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(state):
        nbytes = state[k].numel() * state[k].element_size()
        if size + nbytes > MAX_SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][k] = state[k]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config_dict(model.config), indent=2) + "\n")
    (out / "train_state.json").write_text(json.dumps(meta, indent=1) + "\n")


def load_state_dir(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_model(path: Path, dtype: torch.dtype = torch.float32) -> TinyModel:
    cfg_d = json.loads((path / "config.json").read_text())
    cfg = make_config(cfg_d["vocab_size"], cfg_d["bos_token_id"], cfg_d["eos_token_id"])
    model = TinyModel(cfg)
    from_hf_state(model, load_state_dir(path))
    return model.to(dtype)


def export(ckpt: Path, model_dir: Path) -> None:
    """Merge checkpoint shards into one model.safetensors + config + generation_config."""
    state = load_state_dir(ckpt)
    save_file({k: state[k].contiguous() for k in sorted(state)},
              str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = clean_config(json.loads((ckpt / "config.json").read_text()))
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "pad_token_id": cfg["pad_token_id"],
           "eos_token_id": [cfg["eos_token_id"], cfg["bos_token_id"]],
           "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
           "transformers_version": "5.17.0"}
    (model_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    print("wrote", model_dir / "model.safetensors",
          (model_dir / "model.safetensors").stat().st_size, "bytes")


def interpolate(base: Path, tuned: Path, weight: float, out: Path) -> None:
    """Weight-space interpolation (WiSE-FT): (1 - weight) * base + weight * tuned, per tensor,
    rounded to bf16; written as a checkpoint (``tuned``'s config and train state)."""
    a, b = load_state_dir(base), load_state_dir(tuned)
    if a.keys() != b.keys():
        raise KeyError("the two checkpoints hold different tensors")
    mixed = {k: ((1 - weight) * a[k].float() + weight * b[k].float()).to(torch.bfloat16)
             for k in a}
    model = TinyModel(make_config())
    from_hf_state(model, mixed)
    state_file = tuned / "train_state.json"
    meta = json.loads(state_file.read_text()) if state_file.exists() else {}
    meta["interpolation"] = {"base": str(base), "tuned": str(tuned), "weight": weight}
    save_checkpoint(model, out, meta)

