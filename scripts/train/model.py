"""tandem-tiny's shape and the torch module trained: transformers' Qwen3-Next plus an MTP head.

MTP (docs/architecture.md §11): for position t,
x = fc(concat[norm_e(embed(token[t+1])), norm_h(h[t])]) with the embedding first, one
full-attention decoder layer with the sparse MoE block at position t,
``mtp.norm``, the shared lm_head; it predicts token[t+2]. h[t] is the main model's final-normed
hidden state. Loss = CE(main) + mtp_weight * CE(mtp) + aux_weight * load-balancing loss.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as qn


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

