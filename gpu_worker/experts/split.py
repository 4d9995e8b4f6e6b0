"""Which routed experts run on the backend and which on the cpu_experts processes, and the
weight surgery that puts them there (ARCHITECTURE.md §5).

Rule: the last ``n_cpu`` expert ids of every MoE layer go to the CPU. With router counts
(``hot``, gpu_worker/expert_stats.py) each layer's experts are first renumbered hottest
first, so the backend keeps the most-picked ones.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.expert_stats import hot_order, permute_experts
from gpu_worker.model.model import Model

PLACEMENTS = ("gpu", "cpu", "split")
EXPERT_KEYS = ("gate_proj", "up_proj", "down_proj")
Stacks = tuple[np.ndarray, np.ndarray, np.ndarray]  # gate [E, I, H], up [E, I, H], down [E, H, I]


def cpu_expert_bytes(model: Model) -> float:
    """Weight bytes the CPU reads per expert: int8 plus one fp16 scale per 32, gate+up+down."""
    cfg = model.cfg
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size * (1 + 2 / 32)


def split_experts(model: Model, tensors: dict[str, np.ndarray], placement: str,
                  cpu_per_layer: int = 0, hot: dict[int, np.ndarray] | None = None
                  ) -> tuple[dict[int, np.ndarray], dict[int, Stacks], dict[int, float]]:
    """Pick the CPU's experts of every MoE layer (renumbering by ``hot`` first, in ``tensors``
    and in the model alike). Returns ``(on_cpu, layers, hot_share)``: per MoE layer the bool
    mask [E] of the CPU's expert ids, their float32 stacks (for CpuExpertPool) and, with
    ``hot``, the share of the calibration's router picks the backend keeps."""
    if placement not in PLACEMENTS[1:]:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
    cfg = model.cfg
    E = cfg.num_experts
    n_cpu = E if placement == "cpu" else cpu_per_layer
    if not 0 < n_cpu <= E:
        raise ValueError(f"experts.cpu_experts_per_layer must be in 1..{E} for 'split'")
    if hot is not None and placement != "split":
        raise ValueError("hot experts need placement 'split'")
    hot_share = {}
    for i, counts in (hot or {}).items():
        order = hot_order(counts)
        permute_experts(tensors, order, f"model.layers.{i}.mlp.")
        permute_experts(model.layers[i].mlp, model.xp.asarray(order))
        hot_share[i] = float(counts[order[:E - n_cpu]].sum() / max(1, counts.sum()))
    on_cpu, layers = {}, {}
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_sparse(i):
            continue
        mask = np.zeros(E, dtype=bool)
        mask[E - n_cpu:] = True
        on_cpu[i] = mask
        p = f"model.layers.{i}.mlp.experts."
        layers[i] = tuple(np.ascontiguousarray(tensors[p + k][E - n_cpu:], np.float32)
                          for k in EXPERT_KEYS)
    return on_cpu, layers, hot_share


def drop_cpu_experts(model: Model, on_cpu: dict[int, np.ndarray]) -> None:
    """The backend keeps only its own experts of each layer (ids below the CPU's)."""
    for i, mask in on_cpu.items():
        n_gpu = mask.size - int(mask.sum())
        mlp = model.layers[i].mlp
        for k in EXPERT_KEYS:
            mlp["experts." + k] = mlp["experts." + k][:n_gpu].copy()
