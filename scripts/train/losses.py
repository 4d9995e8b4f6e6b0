"""Losses (main CE, MTP CE, router load balancing), held-out evaluation and the optimizer."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scripts.train.data import eval_windows
from scripts.train.model import TinyModel


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


def adamw(model: nn.Module, lr: float, weight_decay: float,
          dev: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms, biases or other vectors)."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
