#!/usr/bin/env python3
"""Train tandem-tiny: a small Qwen3-Next MoE (transformers' ``Qwen3NextForCausalLM``) plus an MTP
head, jointly, and save it in the real Qwen3-Next on-disk format.

Needs the ``train`` extra (torch, transformers); nothing in Tandem's runtime imports this file.

Sub-commands (see ``docs/training.md`` for the full recipe):

* ``prepare``   tokenize a corpus from ``scripts/build_corpus.py`` into uint16 streams,
* ``train``     train (or resume) on CPU or CUDA under a wall-clock budget, save a checkpoint,
* ``export``    merge a checkpoint's shards into ``models/tandem-tiny/model.safetensors``,
* ``evaluate``  held-out perplexity (code / prose / chat) and MTP agreement (transformers),
* ``reference`` write ``reference_logits.npz`` (float32 logits of transformers and of the MTP head),
* ``sample``    greedy chat completion, to eyeball the model,
* ``compile-rate`` greedy function-body completions of held-out functions (transformers, CPU),
* ``finetune-ul`` sequence-level unlikelihood + self-training fine-tuning on the model's own
  greedy completions (GPU), checkpoints chosen on the validation functions,
* ``interpolate`` weight-space interpolation of two checkpoints (WiSE-FT),
* ``validate``   strict compile figures on the validation functions (held-out minus the
  headline 100), batched greedy decoding with transformers.

MTP (MODELS.md): for position t, x = fc(concat[norm_e(embed(token[t+1])), norm_h(h[t])]) with the
embedding first, one full-attention decoder layer with the sparse MoE block at position t,
``mtp.norm``, the shared lm_head; it predicts token[t+2]. h[t] is the main model's final-normed
hidden state. Loss = CE(main) + mtp_weight * CE(mtp) + aux_weight * load-balancing loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from compile_rule import compiles  # scripts/: on sys.path when a script runs
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as qn

KINDS = ("code", "prose", "chat")  # held-out kinds; train may add "func" (build_corpus.py)
TRAIN_KINDS = (*KINDS, "func")
KIND_WEIGHTS = {"code": 1.0, "prose": 1.5, "chat": 2.5, "func": 1.0}  # sampling weight per token
EOT = "<|endoftext|>"
MAX_SHARD_BYTES = 12 * 1024 * 1024


# --------------------------------------------------------------------------- model


def make_config(vocab_size: int = 8192, bos: int = 8166, eos: int = 8168) -> Qwen3NextConfig:
    """tandem-tiny's shape: 8 layers (every 4th full attention), 16 experts top-4 + shared."""
    layers = 8
    cfg = Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=4096,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        decoder_sparse_step=1,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=128,
        num_experts_per_tok=4,
        num_experts=16,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        mlp_only_layers=[],
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(layers)],
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=bos,
    )
    cfg.full_attention_interval = 4
    cfg.mtp_num_hidden_layers = 1
    cfg.partial_rotary_factor = 0.25
    cfg.rope_theta = 10000.0
    return cfg


class MTPHead(nn.Module):
    """Qwen3-Next multi-token-prediction head; parameter names match ``mtp.*`` on disk."""

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = qn.Qwen3NextRMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = qn.Qwen3NextRMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        layer_cfg = copy.deepcopy(config)
        layer_cfg.layer_types = ["full_attention"]
        layer_cfg.mlp_only_layers = []
        self.layer_config = layer_cfg
        self.layers = nn.ModuleList([qn.Qwen3NextDecoderLayer(layer_cfg, 0)])
        self.norm = qn.Qwen3NextRMSNorm(h, eps=eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor],
                position_ids: torch.Tensor) -> torch.Tensor:
        """hidden: final-normed h[t]; next_embeds: embed(token[t+1]); returns mtp.norm output."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)],
                      dim=-1)
        x = self.fc(x)
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None,
                           position_ids=position_ids)
        if isinstance(x, tuple):
            x = x[0]
        return self.norm(x)


class TinyModel(nn.Module):
    """Qwen3NextForCausalLM + MTPHead, sharing embedding and lm_head."""

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        self.lm = Qwen3NextForCausalLM(config)
        self.mtp = MTPHead(config)
        self.mtp.apply(self.lm._init_weights)
        for mod in self.mtp.modules():  # zero-centred norms start at 0 (i.e. scale 1)
            if isinstance(mod, qn.Qwen3NextRMSNorm):
                nn.init.zeros_(mod.weight)

    @property
    def config(self) -> Qwen3NextConfig:
        return self.lm.config

    def set_experts_impl(self, impl: str) -> None:
        for cfg in (self.lm.config, self.mtp.layer_config):
            cfg._experts_implementation = impl

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm.model(input_ids=ids).last_hidden_state

    def mtp_hidden(self, h: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """MTP output for positions 0..n-1 given h[0..n-1] and token[1..n]."""
        b, n = next_ids.shape
        pos = torch.arange(n, device=next_ids.device)[None].expand(b, n)
        emb = self.lm.model.embed_tokens(next_ids)
        pe = self.lm.model.rotary_emb(h, pos)
        return self.mtp(h, emb, pe, pos)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(x)


def count_params(model: TinyModel) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    cfg = model.config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = cfg.num_experts - cfg.num_experts_per_tok
    inactive = (cfg.num_hidden_layers + 1) * per_expert * idle
    return {"total": total, "mtp": mtp, "main": total - mtp, "active_per_token": total - inactive}


# --------------------------------------------------------------------------- on-disk format


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


# --------------------------------------------------------------------------- data


def prepare(corpus: Path, tokenizer_path: Path, out: Path) -> dict:
    """Tokenize train/heldout JSONL into uint16 streams, one per split and kind."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    eot = tok.token_to_id(EOT)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict = {"eot": eot, "vocab_size": tok.get_vocab_size(), "streams": {}}
    for split in ("train", "heldout"):
        texts: dict[str, list[str]] = {k: [] for k in KINDS}
        with open(corpus / f"{split}.jsonl", encoding="utf-8") as fh:
            for line in fh:
                d = json.loads(line)
                texts.setdefault(d["kind"], []).append(d["text"])
        for kind, docs in texts.items():
            ids: list[int] = []
            for enc in tok.encode_batch(docs, add_special_tokens=False):
                ids.extend(enc.ids)
                ids.append(eot)
            arr = np.asarray(ids, dtype=np.uint16)
            np.save(out / f"{split}_{kind}.npy", arr)
            meta["streams"][f"{split}_{kind}"] = {"docs": len(docs), "tokens": int(arr.size)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def load_streams(data: Path, split: str, device: torch.device,
                 kinds: tuple[str, ...] = KINDS) -> dict[str, torch.Tensor]:
    """The ``split_<kind>.npy`` streams of ``kinds`` (those of TRAIN_KINDS beyond KINDS only
    where present)."""
    return {k: torch.from_numpy(np.load(data / f"{split}_{k}.npy").astype(np.int64)).to(device)
            for k in kinds if k in KINDS or (data / f"{split}_{k}.npy").exists()}


def parse_kind_weights(spec: str) -> dict[str, float]:
    """'code=1,chat=1.5' -> KIND_WEIGHTS with those entries replaced."""
    out = dict(KIND_WEIGHTS)
    for item in filter(None, spec.split(",")):
        kind, _, w = item.partition("=")
        if kind not in out:
            raise ValueError(f"unknown kind {kind!r} in --kind-weights")
        out[kind] = float(w)
    return out


class Sampler:
    """Random (T+1)-token windows from the train streams, kinds weighted per token."""

    def __init__(self, streams: dict[str, torch.Tensor], seq: int, seed: int,
                 weights: dict[str, float] | None = None) -> None:
        weights = weights or KIND_WEIGHTS
        self.kinds = [k for k in streams if weights[k] > 0]
        self.streams, self.seq = streams, seq
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        w = torch.tensor([weights[k] * streams[k].numel() for k in self.kinds], dtype=torch.float)
        self.probs = w / w.sum()
        self.ar = {k: torch.arange(seq + 1, device=s.device) for k, s in streams.items()}

    def batch(self, bsz: int) -> torch.Tensor:
        kinds = torch.multinomial(self.probs, bsz, replacement=True, generator=self.gen)
        rows = []
        for i, k in enumerate(self.kinds):
            n = int((kinds == i).sum())
            if n == 0:
                continue
            s = self.streams[k]
            off = torch.randint(0, s.numel() - self.seq - 1, (n,), generator=self.gen)
            rows.append(s[off.to(s.device)[:, None] + self.ar[k][None]])
        return torch.cat(rows, 0)


def eval_windows(stream: torch.Tensor, seq: int, n: int) -> torch.Tensor:
    """n evenly spaced (seq+1)-token windows (deterministic)."""
    n = max(1, min(n, (stream.numel() - 1) // (seq + 1)))
    offs = torch.linspace(0, stream.numel() - seq - 2, n).long().to(stream.device)
    return stream[offs[:, None] + torch.arange(seq + 1, device=stream.device)[None]]


# --------------------------------------------------------------------------- losses


class RouterTap:
    """Collects router logits of every sparse block (main layers and MTP) via hooks."""

    def __init__(self, model: TinyModel) -> None:
        self.logits: list[torch.Tensor] = []
        self.k = model.config.num_experts_per_tok
        for name, mod in model.named_modules():
            if name.endswith("mlp.gate"):
                mod.register_forward_hook(self._hook)

    def _hook(self, mod: nn.Module, inp: tuple, out: torch.Tensor | tuple) -> None:
        self.logits.append(out[0] if isinstance(out, tuple) else out)

    def balance_loss(self) -> torch.Tensor:
        """Switch-style load balancing: E * sum_i f_i * P_i, averaged over sparse blocks."""
        losses = []
        for lg in self.logits:
            probs = lg.float().softmax(-1)
            e = probs.shape[-1]
            top = probs.topk(self.k, dim=-1).indices
            frac = F.one_hot(top, e).float().sum(1).mean(0) / self.k
            losses.append(e * (frac * probs.mean(0)).sum())
        self.logits = []
        return torch.stack(losses).mean()


def losses(model: TinyModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(main CE, MTP CE, extras) for a batch of (T+1)-token windows."""
    inp, labels = ids[:, :-1], ids[:, 1:]
    h = model.hidden(inp)
    logits = model.logits(h)
    v = logits.shape[-1]
    main = F.cross_entropy(logits.float().reshape(-1, v), labels.reshape(-1))
    m = model.mtp_hidden(h[:, :-1], inp[:, 1:])
    mlogits = model.logits(m)
    mtp = F.cross_entropy(mlogits.float().reshape(-1, v), ids[:, 2:].reshape(-1))
    return main, mtp, {"logits": logits, "mtp_logits": mlogits}


@torch.no_grad()
def evaluate(model: TinyModel, streams: dict[str, torch.Tensor], seq: int, windows: int,
             bsz: int, autocast: bool = False) -> dict:
    """Held-out CE/perplexity per kind, MTP CE, MTP agreement/accuracy on code."""
    model.eval()
    res: dict = {}
    dev = next(model.parameters()).device
    for kind, stream in streams.items():
        w = eval_windows(stream, seq, windows)
        tot = {"main": 0.0, "mtp": 0.0, "agree": 0.0, "mtp_acc": 0.0, "main_acc": 0.0, "n": 0}
        for i in range(0, w.shape[0], bsz):
            ids = w[i : i + bsz]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                main, mtp, ex = losses(model, ids)
            n = ids.shape[0]
            main_pred = ex["logits"].argmax(-1)  # main_pred[:, t] predicts token t+1
            mtp_pred = ex["mtp_logits"].argmax(-1)  # mtp_pred[:, t] predicts token t+2
            tot["main"] += float(main) * n
            tot["mtp"] += float(mtp) * n
            tot["agree"] += float((mtp_pred == main_pred[:, 1:]).float().mean()) * n
            tot["mtp_acc"] += float((mtp_pred == ids[:, 2:]).float().mean()) * n
            tot["main_acc"] += float((main_pred == ids[:, 1:]).float().mean()) * n
            tot["n"] += n
        n = tot.pop("n")
        r = {k: v / n for k, v in tot.items()}
        r["ppl"] = math.exp(r["main"])
        r["windows"] = n
        r["tokens"] = n * seq
        res[kind] = r
    model.train()
    return res


# --------------------------------------------------------------------------- training


def _chunk_gdr(query, key, value, g, beta, chunk_size=64, initial_state=None,  # noqa: ANN001
               output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers 5.24's torch chunked gated delta rule (triangular solve per chunk)."""
    dtype = query.dtype
    b, n, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    query, key, value, beta, g = [x.transpose(1, 2).to(torch.float32).contiguous()
                                  for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - n % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    nc = (n + pad) // chunk_size
    v_beta, k_beta = value * beta[..., None], key * beta[..., None]
    query, key, k_beta, v_beta = [x.reshape(b, hv, nc, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    cum = g.reshape(b, hv, nc, chunk_size).cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ key.transpose(-1, -2)) * pair
    intra = (query @ key.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False,
                                          unitriangular=True)
    state = (torch.zeros(b, hv, dk, dv, dtype=torch.float32, device=query.device)
             if initial_state is None else initial_state.to(torch.float32))
    query = query * cum.exp()[..., None]
    key = key * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(nc):
        vn = new_v[:, :, i] - k_cum[:, :, i] @ state
        outs.append(query[:, :, i] @ state + intra[:, :, i] @ vn)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ vn
    out = torch.stack(outs, 2).reshape(b, hv, -1, dv)[:, :, :n]
    return out.transpose(1, 2).contiguous().to(dtype), (state if output_final_state else None)


def fast_chunk_gated_delta_rule_installed() -> str:
    """Make sure the torch chunked GDN uses a triangular solve, not a 63-step Python loop."""
    import inspect

    try:
        src = inspect.getsource(qn.torch_chunk_gated_delta_rule)
    except (OSError, TypeError):
        src = ""
    if "solve_triangular" in src:
        return "transformers (solve_triangular)"
    qn.torch_chunk_gated_delta_rule = _chunk_gdr
    return "patched (_chunk_gdr)"


def pick_experts_impl(model: TinyModel, sampler: Sampler, bsz: int, dev: torch.device,
                      candidates: list[str]) -> str:
    best, best_t = candidates[0], float("inf")
    for impl in candidates:
        try:
            model.set_experts_impl(impl)
            for i in range(4):
                if i == 1:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    main, mtp, _ = losses(model, sampler.batch(bsz))
                (main + mtp).backward()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / 3
            model.zero_grad(set_to_none=True)
            print(f"experts_impl {impl}: {dt * 1000:.1f} ms/step", flush=True)
            if dt < best_t:
                best, best_t = impl, dt
        except Exception as exc:  # noqa: BLE001 - any failure just rules the candidate out
            print(f"experts_impl {impl} failed: {exc!r}", flush=True)
            model.zero_grad(set_to_none=True)
    model.set_experts_impl(best)
    return best



def adamw(model: nn.Module, lr: float, weight_decay: float, dev: torch.device):
    """AdamW with weight decay on matrices only (not on norms, biases or other vectors)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")

def train(args: argparse.Namespace) -> None:
    t_start = time.time()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    meta_prev: dict = {}
    if args.resume:
        model = load_model(args.resume)
        meta_prev = json.loads((args.resume / "train_state.json").read_text())
    else:
        dmeta = json.loads((args.data / "meta.json").read_text())
        model = TinyModel(make_config(dmeta["vocab_size"]))
    model.to(dev)
    print("params", count_params(model), "gdn", fast_chunk_gated_delta_rule_installed(),
          flush=True)
    weights = parse_kind_weights(args.kind_weights)
    train_streams = load_streams(args.data, "train", dev, TRAIN_KINDS)
    held_streams = load_streams(args.data, "heldout", dev)
    step0 = int(meta_prev.get("step", 0))
    tokens0 = int(meta_prev.get("tokens_seen", 0))
    sampler = Sampler(train_streams, args.seq, args.seed * 1_000_003 + step0, weights)
    print("train kinds", {k: (int(train_streams[k].numel()), weights[k]) for k in sampler.kinds},
          flush=True)
    autocast = dev.type == "cuda"
    impl = "eager"
    if dev.type == "cuda":
        cands = [args.experts_impl] if args.experts_impl else ["grouped_mm", "eager"]
        impl = pick_experts_impl(model, sampler, args.batch, dev, cands)
    opt = adamw(model, args.lr, args.weight_decay, dev)
    tap = RouterTap(model)
    budget = args.time_budget - (time.time() - t_start)
    t0 = time.time()
    step, tokens = 0, 0
    history: list[dict] = list(meta_prev.get("history", []))
    ema = None
    next_eval = t0 + args.eval_every
    speed_logged = False
    while True:
        elapsed = time.time() - t0
        # progress: the larger of the time and token fractions, so that the decay phase ends
        # with the run whichever limit comes first
        frac = elapsed / budget
        if args.max_tokens:
            frac = max(frac, tokens / args.max_tokens)
        if frac >= 1 or (args.max_steps and step >= args.max_steps):
            break
        warm = min(1.0, (step + 1) / args.warmup)
        lr_scale = warm
        if args.decay_frac > 0 and frac > 1 - args.decay_frac:
            into = (frac - (1 - args.decay_frac)) / args.decay_frac
            lr_scale *= 1 - (1 - args.min_lr_ratio) * into
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale
        ids = sampler.batch(args.batch)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            main, mtp, _ = losses(model, ids)
            aux = tap.balance_loss()
        loss = main + args.mtp_weight * mtp + args.aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens += ids.shape[0] * args.seq
        if step % args.log_every == 0 or step <= 3:
            vals = (float(main), float(mtp), float(aux), float(gnorm))
            ema = vals if ema is None else tuple(0.9 * a + 0.1 * b for a, b in zip(ema, vals,
                                                                                  strict=True))
            el = time.time() - t0
            print(f"step {step0 + step} tok {tokens0 + tokens} main {vals[0]:.3f} "
                  f"mtp {vals[1]:.3f} aux {vals[2]:.3f} gn {vals[3]:.2f} "
                  f"lr {args.lr * lr_scale:.2e} {tokens / el:.0f} tok/s t {el:.0f}s", flush=True)
            history.append({"step": step0 + step, "tokens": tokens0 + tokens, "main": vals[0],
                            "mtp": vals[1], "aux": vals[2], "t": round(el, 1)})
        if not speed_logged and step == 12:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            print(f"SPEED after 12 steps: {tokens / (time.time() - t0):.0f} tok/s "
                  f"(experts_impl {impl})", flush=True)
            speed_logged = True
        if time.time() > next_eval:
            ev = evaluate(model, {"code": held_streams["code"]}, args.seq, 32, args.batch,
                          autocast)
            tap.logits.clear()
            print(f"eval step {step0 + step} code ce {ev['code']['main']:.3f} "
                  f"mtp {ev['code']['mtp']:.3f} agree {ev['code']['agree']:.3f}", flush=True)
            next_eval = time.time() + args.eval_every
    train_time = time.time() - t0
    print(f"trained {step} steps, {tokens} tokens in {train_time:.0f}s "
          f"({tokens / max(train_time, 1e-9):.0f} tok/s)", flush=True)
    meta = {
        "step": step0 + step, "tokens_seen": tokens0 + tokens,
        "train_seconds": float(meta_prev.get("train_seconds", 0)) + train_time,
        "runs": list(meta_prev.get("runs", [])) + [{
            "steps": step, "tokens": tokens, "seconds": round(train_time, 1),
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "experts_impl": impl, "batch": args.batch, "seq": args.seq, "lr": args.lr,
            "warmup": args.warmup, "decay_frac": args.decay_frac,
            "min_lr_ratio": args.min_lr_ratio, "max_tokens": args.max_tokens,
            "resumed_from_step": step0}],
        "history": history[-400:],
        "recipe": {"mtp_weight": args.mtp_weight, "aux_weight": args.aux_weight,
                   "weight_decay": args.weight_decay, "clip": args.clip,
                   "kind_weights": {k: weights[k] for k in sampler.kinds},
                   "train_tokens": {k: int(train_streams[k].numel()) for k in sampler.kinds},
                   "optimizer": "AdamW(0.9,0.95)"},
    }
    # Evaluate the weights as shipped: bf16-rounded, run in float32.
    save_checkpoint(model, args.out, meta)
    if args.final_eval:
        shipped = load_model(args.out).to(dev)
        shipped.set_experts_impl(impl)
        ev = evaluate(shipped, held_streams, args.seq, args.eval_windows, args.batch, False)
        meta["heldout_fp32"] = ev
        print("heldout", json.dumps(ev), flush=True)
        (args.out / "train_state.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"saved {args.out} total {time.time() - t_start:.0f}s", flush=True)


# --------------------------------------------------------------------------- export, reference


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


REF_LEN = 48
REF_POSITIONS = (0, 9, 19, 29, 39, 46)  # the MTP at t needs token t+1, so t <= REF_LEN - 2


def reference(model_dir: Path, data: Path, out: Path) -> None:
    """transformers float32 logits (full rows at REF_POSITIONS) + MTP logits, CPU."""
    torch.manual_seed(0)
    lm = Qwen3NextForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lm.eval()
    model = load_model(model_dir)
    model.eval()
    code = np.load(data / "heldout_code.npy")
    prose = np.load(data / "heldout_prose.npy")
    seqs = np.stack([code[1000 : 1000 + REF_LEN], prose[500 : 500 + REF_LEN]]).astype(np.int64)
    ids = torch.from_numpy(seqs)
    pos = np.asarray(REF_POSITIONS, dtype=np.int64)
    with torch.no_grad():
        hf = lm(input_ids=ids).logits.float()
        h = model.hidden(ids)
        own = model.logits(h)
        mtp = model.logits(model.mtp_hidden(h[:, :-1], ids[:, 1:]))
    diff = float((hf - own).abs().max())
    print("transformers vs training-module logits max abs diff", diff)
    np.savez_compressed(
        out,
        input_ids=seqs.astype(np.int32),
        positions=pos.astype(np.int32),
        logits=hf[:, pos].numpy().astype(np.float32),
        mtp_logits=mtp[:, pos].numpy().astype(np.float32),
        top32_idx=hf.topk(32, -1).indices.numpy().astype(np.int32),
        top32_val=hf.topk(32, -1).values.numpy().astype(np.float32),
        mtp_top32_idx=mtp.topk(32, -1).indices.numpy().astype(np.int32),
        mtp_top32_val=mtp.topk(32, -1).values.numpy().astype(np.float32),
        hidden_final=h[:, pos].numpy().astype(np.float32),
    )
    print("wrote", out, out.stat().st_size, "bytes")


def sample(model_dir: Path, prompt: str, max_new: int) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lm = Qwen3NextForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    text = (f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\n")
    ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids])
    gen = json.loads((model_dir / "generation_config.json").read_text())
    out = lm.generate(ids, max_new_tokens=max_new, do_sample=False,
                      eos_token_id=gen["eos_token_id"], pad_token_id=gen["pad_token_id"])
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)


def select_functions(path: Path, n: int) -> list[dict]:
    """n held-out functions, round-robin over top-level packages (deterministic)."""
    groups: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        f = json.loads(line)
        groups.setdefault(f["module"].split(".")[0], []).append(f)
    for g in groups.values():
        g.sort(key=lambda f: (f["module"], f["name"], f["prompt"]))
    out: list[dict] = []
    while len(out) < n and any(groups.values()):
        for key in sorted(groups):
            if groups[key] and len(out) < n:
                out.append(groups[key].pop(0))
    return out


def body_of(completion: str) -> str:
    """The generated body: everything before the first non-blank line at column 0."""
    lines = []
    for line in completion.split("\n"):
        if line.strip() and not line[0].isspace():
            break
        lines.append(line)
    return "\n".join(lines)


def body_ended(text: str) -> bool:
    """A non-blank line starts at column 0 (a dedent to module level): the body has ended."""
    return any(line.strip() and not line[0].isspace() for line in text.split("\n"))


def compile_rate(model_dir: Path, funcs: list[dict], max_new: int) -> dict:
    """Greedy body completions (transformers, float32, CPU) and the share that compiles.

    Decoding runs until the body has ended: a non-blank column-0 line, EOS or ``max_new``
    tokens. The body is everything before the column-0 line; a completion that hits the limit
    is cut: its trailing partial line is dropped and it is counted in ``cut`` (still
    compile-checked). The same rule as ``scripts/eval_tiny_model.py`` (Tandem's NumPy engine).
    """
    from tokenizers import Tokenizer
    from transformers import StoppingCriteria, StoppingCriteriaList

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lm = Qwen3NextForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen = json.loads((model_dir / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]

    class EndOfBody(StoppingCriteria):
        def __init__(self, start: int) -> None:
            self.start = start

        def __call__(self, ids: torch.Tensor, scores: torch.Tensor, **kw: object) -> bool:
            return body_ended(tok.decode(ids[0, self.start:].tolist(), skip_special_tokens=True))

    ok, results = 0, []
    for f in funcs:
        ids = torch.tensor([tok.encode(f["prompt"], add_special_tokens=False).ids])
        with torch.no_grad():
            out = lm.generate(ids, max_new_tokens=max_new, do_sample=False,
                              eos_token_id=eos, pad_token_id=gen["pad_token_id"],
                              stopping_criteria=StoppingCriteriaList([EndOfBody(ids.shape[1])]))
        new = out[0, ids.shape[1]:].tolist()
        text = tok.decode(new, skip_special_tokens=True)
        if new and new[-1] in eos:
            stop = "eos"
        elif body_ended(text):
            stop = "dedent"
        else:
            stop = "limit"
        body = body_of(text)
        if stop == "limit":  # cut: drop the trailing partial line
            body = body[: body.rfind("\n") + 1]
        good = bool(body.strip())
        if good:
            try:
                compile(f["prompt"] + body + "\n", "<heldout>", "exec")
            except (SyntaxError, ValueError):
                good = False
        ok += good
        results.append({"module": f["module"], "name": f["name"], "compiles": good,
                        "stop": stop, "cut": stop == "limit", "tokens": len(new),
                        "body": body})
    cut = [r for r in results if r["cut"]]
    ok_cut = sum(r["compiles"] for r in cut)
    uncut = len(results) - len(cut)
    # strict (the headline): bodies that ended by themselves (column-0 line or EOS) and compile
    return {"functions": len(funcs), "strict_compiles": ok - ok_cut,
            "strict_rate": (ok - ok_cut) / max(len(funcs), 1),
            "compiles": ok, "rate": ok / max(len(funcs), 1),
            "cut": len(cut), "cut_compiles": ok_cut, "uncut": uncut,
            "uncut_compiles": ok - ok_cut, "uncut_rate": (ok - ok_cut) / max(uncut, 1),
            "max_new_tokens": max_new, "results": results}


# --------------------------------------------------------------------------- unlikelihood


def repeated_ngram_mask(tokens: list[int], n: int) -> list[bool]:
    """Sequence-level unlikelihood candidates (Welleck et al. 2019): ``mask[i]`` is True when
    token i belongs to an n-gram that already occurred earlier in ``tokens``."""
    mask = [False] * len(tokens)
    seen: set[tuple[int, ...]] = set()
    for end in range(n, len(tokens) + 1):
        gram = tuple(tokens[end - n : end])
        if gram in seen:
            mask[end - n : end] = [True] * n
        seen.add(gram)
    return mask


def first_repeated_line(body: str) -> int | None:
    """Character offset of the first non-blank line that repeats an earlier line of ``body``
    exactly (indentation included): where a greedy loop starts. None when no line repeats."""
    seen: set[str] = set()
    off = 0
    for line in body.split("\n"):
        if line.strip():
            if line in seen:
                return off
            seen.add(line)
        off += len(line) + 1
    return None


def greedy_stop(tok: object, gen: list[int], max_new: int, eos_ids: tuple[int, ...]
                ) -> tuple[list[int], str]:
    """Replay ``eval_tiny_model.greedy_completion``'s stopping rule on ``gen`` (a greedy run of
    ``max_new`` tokens, or fewer when it sampled EOS): the kept tokens (EOS excluded) and the
    stop ("dedent", "eos" or "limit"). body_ended is monotone in the prefix, so the first
    ending prefix is found by bisection."""
    end = next((i for i, t in enumerate(gen) if t in eos_ids), len(gen))
    out = gen[:end]

    def ended(k: int) -> bool:
        return body_ended(tok.decode(out[:k], skip_special_tokens=True))

    if out and ended(len(out)):
        lo, hi = 1, len(out)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ended(mid) else (mid + 1, hi)
        return out[:lo], "dedent"
    if end < len(gen):
        return out, "eos"
    return out[:max_new], "limit"


def body_target(tok: object, prompt: str, out: list[int], stop: str, eot: int
                ) -> list[int] | None:
    """The self-training target for one greedy completion: its body up to (not including) the
    first repeated line, followed by EOT, in the completion's own tokens (the last partial
    line re-encoded). None when that body is blank or does not compile."""
    text = tok.decode(out, skip_special_tokens=True)
    body = body_of(text)
    if stop == "limit":
        body = body[: body.rfind("\n") + 1]
    cut = first_repeated_line(body)
    if cut is not None:
        body = body[:cut]
    body = body.rstrip(" ")
    if body and not body.endswith("\n"):
        body += "\n"
    if not compiles(prompt, body):
        return None
    k = len(out)
    while k and not body.startswith(tok.decode(out[:k], skip_special_tokens=True)):
        k -= 1
    rest = body[len(tok.decode(out[:k], skip_special_tokens=True)):]
    return out[:k] + (tok.encode(rest, add_special_tokens=False).ids if rest else []) + [eot]


def function_prompts(tok: object, stream: np.ndarray, eot: int, max_len: int) -> list[dict]:
    """Signature + docstring prompts of the train split's ``func`` documents (documents of
    ``train_func.npy``, each ``function_prompt + body``), with their token ids."""
    out = []
    bounds = np.flatnonzero(stream == eot)
    start = 0
    for end in bounds:
        text = tok.decode(stream[start:end].tolist(), skip_special_tokens=False)
        start = end + 1
        first = text.find('"""')
        close = text.find('\n    """\n', first + 3)
        if first < 0 or close < 0:
            continue
        prompt = text[: close + len('\n    """\n')]
        ids = tok.encode(prompt, add_special_tokens=False).ids
        if len(ids) <= max_len and compiles(prompt, "    pass"):
            out.append({"prompt": prompt, "ids": ids})
    return out


@torch.no_grad()
def greedy_generate(lm: Qwen3NextForCausalLM, prompts: list[list[int]], max_new: int,
                    eos_ids: tuple[int, ...], pad: int, bsz: int) -> list[list[int]]:
    """Batched greedy continuations (left-padded prompts, KV/recurrent cache): ``max_new``
    tokens per prompt, or fewer where EOS came first (EOS kept)."""
    dev = next(lm.parameters()).device
    outs: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for s in range(0, len(order), bsz):
        rows = order[s : s + bsz]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        gen = lm.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                          max_new_tokens=max_new, do_sample=False, eos_token_id=list(eos_ids),
                          pad_token_id=pad)[:, width:].tolist()
        for r, i in enumerate(rows):
            g = gen[r]
            e = next((j for j, t in enumerate(g) if t in eos_ids), None)
            outs[i] = g if e is None else g[: e + 1]
    return outs


def shipped_copy(model: TinyModel) -> TinyModel:
    """The weights as shipped: bf16-rounded, run in float32 (a fresh copy, without hooks)."""
    twin = TinyModel(model.config)
    twin.load_state_dict({k: v.to(torch.bfloat16).float()
                          for k, v in model.state_dict().items()})
    twin.set_experts_impl(getattr(model.config, "_experts_implementation", None) or "eager")
    return twin.to(next(model.parameters()).device).eval()


def validate_compile(model: TinyModel, tok: object, funcs: list[dict], max_new: int,
                     eos_ids: tuple[int, ...], pad: int, bsz: int) -> dict:
    """Strict compile figures (the rule of ``eval_tiny_model.py``) of the shipped weights on
    ``funcs``, greedy, batched on the model's device."""
    twin = shipped_copy(model)
    prompts = [tok.encode(f["prompt"], add_special_tokens=False).ids for f in funcs]
    gens = greedy_generate(twin.lm, prompts, max_new, eos_ids, pad, bsz)
    res = {"functions": len(funcs), "strict": 0, "compiles": 0, "cut": 0, "eos": 0,
           "dedent": 0, "repeat_cut": 0, "body_lines": 0, "ended_lines": 0}
    strict_bodies: dict[str, int] = {}
    for f, g in zip(funcs, gens, strict=True):
        out, stop = greedy_stop(tok, g, max_new, eos_ids)
        text = tok.decode(out, skip_special_tokens=True)
        body = body_of(text)
        if stop == "limit":
            body = body[: body.rfind("\n") + 1]
            res["repeat_cut"] += first_repeated_line(body) is not None
        ok = compiles(f["prompt"], body)
        res["compiles"] += ok
        res["strict"] += ok and stop != "limit"
        if ok and stop != "limit":
            strict_bodies[body.strip()] = strict_bodies.get(body.strip(), 0) + 1
        res["cut" if stop == "limit" else stop] += 1
        lines = len([x for x in body.split("\n") if x.strip()])
        res["body_lines"] += lines
        res["ended_lines"] += lines if stop != "limit" else 0
    res["mean_body_lines"] = res.pop("body_lines") / max(len(funcs), 1)
    # non-blank lines per body that ended by itself: a collapse to one-line bodies shows here
    res["mean_ended_lines"] = res.pop("ended_lines") / max(len(funcs) - res["cut"], 1)
    # ... and a collapse to one body for every prompt here: distinct strict bodies, and how
    # often the commonest one came
    res["strict_distinct"] = len(strict_bodies)
    res["strict_commonest"] = max(strict_bodies.values(), default=0)
    return res


def ul_batch(tok: object, prompts: list[dict], gens: list[list[int]], max_new: int,
             eos_ids: tuple[int, ...], eot: int, ngram: int, device: torch.device) -> dict:
    """Training tensors from greedy completions: right-padded ``prompt + completion`` rows
    with the unlikelihood candidates (repeated n-grams of the completion), and
    ``prompt + body_target`` rows with their CE mask. Shapes: ids [rows, T], masks [rows, T]
    marking the *target* token at each position (predicted from position t-1)."""
    ul_rows, ul_masks, st_rows, st_masks = [], [], [], []
    stats = {"limit": 0, "eos": 0, "dedent": 0, "targets": 0, "candidates": 0, "tokens": 0}
    for p, g in zip(prompts, gens, strict=True):
        out, stop = greedy_stop(tok, g, max_new, eos_ids)
        stats[stop] += 1
        cont = g[: len(out) + (stop == "eos")]
        cand = repeated_ngram_mask(cont, ngram)
        stats["candidates"] += sum(cand)
        stats["tokens"] += len(cont)
        if any(cand):
            ul_rows.append(p["ids"] + cont)
            ul_masks.append([False] * len(p["ids"]) + cand)
        target = body_target(tok, p["prompt"], out, stop, eot)
        if target is not None:
            st_rows.append(p["ids"] + target)
            st_masks.append([False] * len(p["ids"]) + [True] * len(target))
            stats["targets"] += 1

    def pad(rows: list[list], fill: object, dtype: torch.dtype) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype,
                            device=device)

    out: dict = {"stats": stats}
    if ul_rows:
        out["ul"] = (pad(ul_rows, eot, torch.long), pad(ul_masks, False, torch.bool))
    if st_rows:
        out["st"] = (pad(st_rows, eot, torch.long), pad(st_masks, False, torch.bool))
    return out


def ul_losses(model: TinyModel, ids: torch.Tensor, mask: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(unlikelihood -log(1 - p), CE) averaged over the masked target tokens of ``ids``
    ([rows, T]; mask[:, t] marks token t, predicted at position t-1)."""
    logits = model.logits(model.hidden(ids[:, :-1])).float()  # [rows, T-1, V]
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # [rows, T-1]
    m = mask[:, 1:].float()
    n = m.sum().clamp(min=1)
    one_minus = (1 - logp.exp()).clamp(min=1e-5)
    return -(one_minus.log() * m).sum() / n, -(logp * m).sum() / n


def validation_functions(path: Path, exclude: Path) -> list[dict]:
    """Held-out functions minus the headline ones (matched by module and name): the set that
    chooses checkpoints, so that the headline figure is measured once, unselected."""
    skip = {(f["module"], f["name"]) for f in map(json.loads, exclude.read_text().splitlines())}
    funcs = [json.loads(line) for line in path.read_text().splitlines()]
    return [f for f in funcs if (f["module"], f["name"]) not in skip]


def finetune_ul(args: argparse.Namespace) -> None:
    """Sequence-level unlikelihood fine-tuning on the model's own greedy completions.

    Each round: greedy completions (``--max-new`` tokens) of ``--gen-batch`` train-split
    function prompts; then ``--steps-per-round`` AdamW steps, each on a share of those rows:
    loss = CE + mtp_weight * MTP CE + aux_weight * balance (a regular training batch, so that
    perplexity and the MTP head hold) + ul_weight * -log(1 - p) on completion tokens that
    belong to a repeated n-gram (Welleck et al. 2019) + st_weight * CE on the completion's body
    cut before its first repeated line and ended by EOT, where that body compiles. Every
    ``--val-every`` seconds: the strict compile count on the validation functions (held-out
    minus the headline 100) and held-out code CE; the best checkpoint whose code CE rose by at
    most ``--max-ce-rise`` is saved.
    """
    from tokenizers import Tokenizer

    t_start = time.time()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    tok = Tokenizer.from_file(str(args.tokenizer))
    model = load_model(args.init).to(dev)
    state_file = args.init / "train_state.json"
    meta_prev = json.loads(state_file.read_text()) if state_file.exists() else {}
    print("gdn", fast_chunk_gated_delta_rule_installed(), flush=True)
    impl = args.experts_impl or ("grouped_mm" if dev.type == "cuda" else "eager")
    model.set_experts_impl(impl)
    cfg = model.config
    eot, eos_ids = cfg.bos_token_id, (cfg.eos_token_id, cfg.bos_token_id)
    sampler = Sampler(load_streams(args.data, "train", dev, TRAIN_KINDS), args.seq,
                      args.seed * 1_000_003 + int(meta_prev.get("step", 0)),
                      parse_kind_weights(args.kind_weights))
    held = load_streams(args.data, "heldout", dev)
    prompts = function_prompts(tok, np.load(args.data / "train_func.npy"), eot, args.max_prompt)
    val = validation_functions(args.functions, args.exclude)
    if args.val_limit:
        val = val[: args.val_limit]
    print(f"train prompts {len(prompts)}, validation functions {len(val)}", flush=True)
    opt = adamw(model, args.lr, args.weight_decay, dev)
    tap = RouterTap(model)
    autocast = dev.type == "cuda"
    history: list[dict] = []
    best: dict = {}

    def check(step: int) -> None:
        t0 = time.time()
        v = validate_compile(model, tok, val, args.max_new, eos_ids, eot, args.gen_batch)
        ev = evaluate(shipped_copy(model), {"code": held["code"]}, args.seq, args.check_windows,
                      args.batch)["code"]
        tap.logits.clear()
        rec = {"step": step, "t": round(time.time() - t_start, 1), **v,
               "code_ce": round(ev["main"], 4), "mtp_agree": round(ev["agree"], 4),
               "seconds": round(time.time() - t0, 1)}
        history.append({"check": rec})
        print("check", json.dumps(rec), flush=True)
        base_ce = history[0]["check"]["code_ce"]
        if rec["code_ce"] <= base_ce + args.max_ce_rise and (
                not best or (v["strict"], -rec["code_ce"]) > (best["check"]["strict"],
                                                             -best["check"]["code_ce"])):
            best.update(check=rec, state={k: t.detach().to("cpu", copy=True)
                                          for k, t in model.state_dict().items()})

    check(0)
    step, rounds = 0, 0
    next_check = time.time() + args.val_every
    while time.time() - t_start < args.time_budget - args.reserve and (
            not args.max_rounds or rounds < args.max_rounds):
        t0 = time.time()
        pick = rng.choice(len(prompts), size=min(args.gen_batch, len(prompts)), replace=False)
        chosen = [prompts[i] for i in pick]
        model.eval()
        gens = greedy_generate(model.lm, [p["ids"] for p in chosen], args.max_new, eos_ids,
                               eot, args.gen_batch)
        tap.logits.clear()
        model.train()
        t_gen = time.time() - t0
        parts = [ul_batch(tok, chosen[i::args.steps_per_round], gens[i::args.steps_per_round],
                          args.max_new, eos_ids, eot, args.ngram, dev)
                 for i in range(args.steps_per_round)]
        for part in parts:
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                main, mtp, _ = losses(model, sampler.batch(args.batch))
                loss = main + args.mtp_weight * mtp
                ul = st = torch.zeros((), device=dev)
                if "ul" in part and args.ul_weight:
                    ul = ul_losses(model, *part["ul"])[0]
                if "st" in part and args.st_weight:
                    st = ul_losses(model, *part["st"])[1]
                aux = tap.balance_loss()
            loss = loss + args.ul_weight * ul + args.st_weight * st + args.aux_weight * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            step += 1
        rounds += 1
        stats = {k: sum(p["stats"][k] for p in parts) for k in parts[0]["stats"]}
        rec = {"round": rounds, "step": step, "main": round(float(main), 4),
               "mtp": round(float(mtp), 4), "ul": round(float(ul), 4), "st": round(float(st), 4),
               "gn": round(float(gnorm), 3), "gen_s": round(t_gen, 1),
               "round_s": round(time.time() - t0, 1), **stats}
        history.append(rec)
        print("round", json.dumps(rec), flush=True)
        if time.time() > next_check:
            check(step)
            next_check = time.time() + args.val_every
    if not history[-1].get("check") or history[-1]["check"]["step"] != step:
        check(step)
    shipped = TinyModel(model.config)
    shipped.load_state_dict(best["state"])
    shipped.set_experts_impl(impl)
    meta = dict(meta_prev)
    meta["unlikelihood"] = list(meta_prev.get("unlikelihood", [])) + [{
        "init": str(args.init), "steps": step, "rounds": rounds, "best": best["check"],
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "history": history}]
    save_checkpoint(shipped, args.out, meta)
    if args.final_eval:
        final = load_model(args.out).to(dev)
        final.set_experts_impl(impl)
        ev = evaluate(final, held, args.seq, args.eval_windows, args.batch)
        meta["unlikelihood"][-1]["heldout_fp32"] = ev
        print("heldout", json.dumps(ev), flush=True)
        (args.out / "train_state.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"saved {args.out} (best check {json.dumps(best['check'])}) "
          f"total {time.time() - t_start:.0f}s", flush=True)


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


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, default=Path("models/tandem-tiny/tokenizer.json"))
    p.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("train")
    t.add_argument("--data", type=Path, required=True, help="dir written by prepare")
    t.add_argument("--out", type=Path, required=True, help="checkpoint dir to write")
    t.add_argument("--resume", type=Path, default=None, help="checkpoint dir to resume from")
    t.add_argument("--device", default=None)
    t.add_argument("--time-budget", type=float, default=420.0, help="seconds, whole command")
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--max-tokens", type=int, default=0,
                   help="token target: the run (and its decay phase) ends at this many tokens "
                        "or at the time budget, whichever comes first")
    t.add_argument("--kind-weights", default="",
                   help="per-token sampling weights, e.g. 'chat=1.5,func=0' (default: "
                        + ",".join(f"{k}={w}" for k, w in KIND_WEIGHTS.items()) + ")")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=150)
    t.add_argument("--decay-frac", type=float, default=0.0,
                   help="linear decay over this final fraction of the run (WSD); the run's "
                        "progress is the larger of its time and --max-tokens fractions")
    t.add_argument("--min-lr-ratio", type=float, default=0.05)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--mtp-weight", type=float, default=0.3)
    t.add_argument("--aux-weight", type=float, default=0.01)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--eval-every", type=float, default=120.0)
    t.add_argument("--eval-windows", type=int, default=128)
    t.add_argument("--final-eval", action="store_true")
    t.add_argument("--experts-impl", default="", help="force grouped_mm or eager on CUDA")
    e = sub.add_parser("export")
    e.add_argument("--ckpt", type=Path, required=True)
    e.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    r = sub.add_parser("reference")
    r.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    r.add_argument("--data", type=Path, required=True)
    r.add_argument("--out", type=Path, default=Path("models/tandem-tiny/reference_logits.npz"))
    v = sub.add_parser("evaluate")
    v.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    v.add_argument("--data", type=Path, required=True)
    v.add_argument("--windows", type=int, default=8)
    v.add_argument("--seq", type=int, default=512)
    s = sub.add_parser("sample")
    s.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    s.add_argument("--prompt", default="Write a Python function that reverses a string")
    s.add_argument("--max-new", type=int, default=80)
    c = sub.add_parser("compile-rate")
    c.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    c.add_argument("--functions", type=Path, default=Path(".corpus/heldout_functions.jsonl"))
    c.add_argument("--n", type=int, default=100)
    c.add_argument("--max-new", type=int, default=160)
    c.add_argument("--write-selection", type=Path, default=None)
    c.add_argument("--out", type=Path, default=None, help="JSON with every completion")
    u = sub.add_parser("finetune-ul", help="sequence-level unlikelihood fine-tuning")
    u.add_argument("--init", type=Path, default=Path("models/tandem-tiny"),
                   help="model or checkpoint dir to start from (a finetune-ul output resumes)")
    u.add_argument("--data", type=Path, required=True, help="dir written by prepare")
    u.add_argument("--out", type=Path, required=True, help="checkpoint dir to write")
    u.add_argument("--functions", type=Path, default=Path(".corpus/heldout_functions.jsonl"))
    u.add_argument("--exclude", type=Path,
                   default=Path("models/tandem-tiny/eval/heldout_functions_100.jsonl"),
                   help="headline functions, never used for validation")
    u.add_argument("--tokenizer", type=Path, default=Path("models/tandem-tiny/tokenizer.json"))
    u.add_argument("--device", default=None)
    u.add_argument("--time-budget", type=float, default=420.0, help="seconds, whole command")
    u.add_argument("--reserve", type=float, default=60.0,
                   help="seconds kept for the last check, saving and --final-eval")
    u.add_argument("--max-rounds", type=int, default=0)
    u.add_argument("--gen-batch", type=int, default=256, help="prompts per round")
    u.add_argument("--steps-per-round", type=int, default=2)
    u.add_argument("--max-new", type=int, default=160)
    u.add_argument("--max-prompt", type=int, default=320)
    u.add_argument("--ngram", type=int, default=4)
    u.add_argument("--ul-weight", type=float, default=1.0)
    u.add_argument("--st-weight", type=float, default=1.0)
    u.add_argument("--lr", type=float, default=1e-4)
    u.add_argument("--warmup", type=int, default=10)
    u.add_argument("--batch", type=int, default=32)
    u.add_argument("--seq", type=int, default=512)
    u.add_argument("--kind-weights", default="chat=1.5,func=1")
    u.add_argument("--weight-decay", type=float, default=0.1)
    u.add_argument("--clip", type=float, default=1.0)
    u.add_argument("--mtp-weight", type=float, default=0.3)
    u.add_argument("--aux-weight", type=float, default=0.01)
    u.add_argument("--val-every", type=float, default=60.0, help="seconds between checks")
    u.add_argument("--val-limit", type=int, default=0, help="first N validation functions")
    u.add_argument("--check-windows", type=int, default=32)
    u.add_argument("--max-ce-rise", type=float, default=0.05)
    u.add_argument("--eval-windows", type=int, default=128)
    u.add_argument("--final-eval", action="store_true")
    u.add_argument("--experts-impl", default="")
    u.add_argument("--seed", type=int, default=4321)
    w = sub.add_parser("interpolate", help="(1 - w) * base + w * tuned, as a checkpoint")
    w.add_argument("--base", type=Path, default=Path("models/tandem-tiny"))
    w.add_argument("--tuned", type=Path, required=True)
    w.add_argument("--weight", type=float, required=True)
    w.add_argument("--out", type=Path, required=True)
    q = sub.add_parser("validate", help="strict compile figures on the validation functions")
    q.add_argument("--model-dir", type=Path, default=Path("models/tandem-tiny"))
    q.add_argument("--functions", type=Path, default=Path(".corpus/heldout_functions.jsonl"))
    q.add_argument("--exclude", type=Path,
                   default=Path("models/tandem-tiny/eval/heldout_functions_100.jsonl"))
    q.add_argument("--stride", type=int, default=1, help="every STRIDE-th validation function")
    q.add_argument("--max-new", type=int, default=160)
    q.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(json.dumps(prepare(args.corpus, args.tokenizer, args.out), indent=1))
    elif args.cmd == "train":
        train(args)
    elif args.cmd == "finetune-ul":
        finetune_ul(args)
    elif args.cmd == "interpolate":
        interpolate(args.base, args.tuned, args.weight, args.out)
    elif args.cmd == "validate":
        from tokenizers import Tokenizer

        model = load_model(args.model_dir)
        tok = Tokenizer.from_file(str(args.model_dir / "tokenizer.json")
                                  if (args.model_dir / "tokenizer.json").exists()
                                  else "models/tandem-tiny/tokenizer.json")
        val = validation_functions(args.functions, args.exclude)[:: args.stride]
        cfg = model.config
        print(json.dumps(validate_compile(model, tok, val, args.max_new,
                                          (cfg.eos_token_id, cfg.bos_token_id),
                                          cfg.bos_token_id, args.batch)))
    elif args.cmd == "export":
        export(args.ckpt, args.model_dir)
    elif args.cmd == "reference":
        reference(args.model_dir, args.data, args.out)
    elif args.cmd == "evaluate":
        model = load_model(args.model_dir)
        ev = evaluate(model, load_streams(args.data, "heldout", torch.device("cpu")),
                      args.seq, args.windows, 4)
        print(json.dumps(ev, indent=1))
    elif args.cmd == "compile-rate":
        funcs = select_functions(args.functions, args.n)
        if args.write_selection:
            args.write_selection.parent.mkdir(parents=True, exist_ok=True)
            args.write_selection.write_text("".join(json.dumps(f) + "\n" for f in funcs))
        res = compile_rate(args.model_dir, funcs, args.max_new)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({k: v for k, v in res.items() if k != "results"}))
    elif args.cmd == "sample":
        print(sample(args.model_dir, args.prompt, args.max_new))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
