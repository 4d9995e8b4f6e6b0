"""Which routed experts run on the backend and which on the cpu_experts processes, decided
before any weight is read (docs/architecture.md §5).

Rule: the last ``n_cpu`` expert ids of every MoE layer go to the CPU. With router counts
(``hot``, gpu_worker/expert_stats.py) each layer's experts are first renumbered hottest
first, so the backend keeps the most-picked ones. The renumbering happens as the weights
are read (gpu_worker/weights/stream.py reads experts ``order[j]`` as new expert j and the
router's rows in the same order), so no copy of a layer is ever permuted in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from gpu_worker.expert_stats import hot_order
from gpu_worker.model_config import ModelConfig

PLACEMENTS = ("gpu", "cpu", "split")
EXPERT_KEYS = ("gate_proj", "up_proj", "down_proj")


def cpu_expert_bytes(model, fmt: str = "int8") -> float:
    """Weight bytes the CPU reads per expert, gate+up+down: int8 plus one fp16 scale per 32,
    or int4 (half a byte) plus one fp16 scale per 32."""
    cfg = model.cfg
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size * ((1 if fmt == "int8" else 0.5)
                                                             + 2 / 32)


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """Per MoE layer: ``order[layer]`` int64 [E], new expert id j is the checkpoint's expert
    ``order[j]`` (identity without hot counts); the last ``n_cpu[layer]`` new ids live on the
    CPU workers, the others on the backend. ``hot_share[layer]``: with router counts, the
    share of the calibration's picks the backend keeps."""

    order: dict[int, np.ndarray]
    n_cpu: dict[int, int]
    hot_share: dict[int, float] = dataclasses.field(default_factory=dict)

    def gpu_ids(self, layer: int) -> np.ndarray:
        """Checkpoint expert ids the backend holds, in their new order."""
        return self.order[layer][:self.order[layer].size - self.n_cpu[layer]]

    def cpu_ids(self, layer: int) -> np.ndarray:
        """Checkpoint expert ids the CPU workers hold, in their new order."""
        return self.order[layer][self.order[layer].size - self.n_cpu[layer]:]

    def renumbered(self, layer: int) -> bool:
        return bool((self.order[layer] != np.arange(self.order[layer].size)).any())

    @property
    def on_cpu(self) -> dict[int, np.ndarray]:
        """Per MoE layer the bool mask [E] of the CPU's (new) expert ids: the last ones."""
        out = {}
        for layer, order in self.order.items():
            mask = np.zeros(order.size, dtype=bool)
            mask[order.size - self.n_cpu[layer]:] = True
            out[layer] = mask
        return out


def plan_split(cfg: ModelConfig, placement: str, cpu_per_layer: int | Mapping[int, int] = 0,
               hot: Mapping[int, np.ndarray] | None = None) -> ExpertSplit | None:
    """Today's rule, from the config alone: None for ``gpu``; ``cpu`` puts every expert on
    the CPU, ``split`` the last ``cpu_per_layer`` ids (an int, or one count per MoE layer),
    after renumbering by ``hot`` counts (hottest first)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
    if placement == "gpu":
        return None
    if hot is not None and placement != "split":
        raise ValueError("hot experts need placement 'split'")
    E = cfg.num_experts
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)]
    if not layers:
        raise ValueError(f"placement {placement!r} needs a mixture-of-experts model")
    order = {i: hot_order(hot[i]) if hot is not None else np.arange(E) for i in layers}
    return split_from_orders(order, E if placement == "cpu" else cpu_per_layer, hot)


def split_from_orders(order: Mapping[int, Sequence[int]], cpu_per_layer: int | Mapping[int, int],
                      hot: Mapping[int, np.ndarray] | None = None) -> ExpertSplit:
    """The split of a decided placement, e.g. a memory plan's (gpu_worker/memory_plan.py):
    per MoE layer the expert ids in the order the GPU takes them (``order``, hottest first)
    and how many of the last ones go to the CPU (an int for every layer, or per layer).
    ``hot``: router counts, to report the share of picks the GPU keeps."""
    orders, n_cpu, share = {}, {}, {}
    for i, ids in order.items():
        ids = np.asarray(ids, dtype=np.int64)
        E = ids.size
        n = cpu_per_layer.get(i, 0) if isinstance(cpu_per_layer, Mapping) else cpu_per_layer
        if not 0 < n <= E:
            raise ValueError(f"experts.cpu_experts_per_layer must be in 1..{E} for 'split'"
                             + (f" (layer {i}: {n})" if isinstance(cpu_per_layer, Mapping)
                                else ""))
        if sorted(ids.tolist()) != list(range(E)):
            raise ValueError(f"layer {i}: the expert order must hold each id of 0..{E - 1} once")
        orders[i], n_cpu[i] = ids, int(n)
        if hot is not None:
            counts = np.asarray(hot[i])
            share[i] = float(counts[ids[:E - n]].sum() / max(1, counts.sum()))
    return ExpertSplit(orders, n_cpu, share)
