"""Hottest-by-frequency expert placement (docs/architecture.md §5).

``tandem expert-stats`` runs text through the model and counts, per MoE layer, how often the
router picks each expert (:func:`count_routing`); the counts go to a JSON file. With
``[experts] placement = "split"`` and ``hot_experts = "<that file>"`` the GPU keeps each
layer's most-picked experts and the CPU workers get the rest.

The experts are renumbered rather than tracked by a map: :func:`permute_experts` reorders a
layer's router rows and expert stacks by the same permutation (hottest first), which leaves
the layer's function unchanged (the router's top-k picks the same experts under new
numbers), and the placement's rule "the last ``cpu_experts_per_layer`` ids go to the CPU"
then picks the coldest. Only the order in which a row sums its experts (ascending id)
changes, so outputs move by float rounding only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FORMAT = "tandem-expert-counts-v1"
EXPERT_KEYS = ("gate_proj", "up_proj", "down_proj")


class RouterCounter:
    """A :class:`gpu_worker.routed_experts.RoutedExperts` that runs every expert on the
    backend, as ``Model.forward`` without one does, and counts the router's picks:
    ``counts[layer]`` int64 [E], every row adds its top-k experts once."""

    def __init__(self, model) -> None:
        cfg = model.cfg
        self.model = model
        self.counts = {i: np.zeros(cfg.num_experts, np.int64)
                       for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)}
        # per layer: [experts shared by consecutive rows, consecutive row pairs]
        self.overlap = {i: np.zeros(2, np.int64) for i in self.counts}

    def moe_norm(self, x, weight, eps: float, zero_centered: bool):
        return self.model.ops.rms_norm(x, weight, eps, zero_centered=zero_centered), None

    def __call__(self, layer: int, x, ids, weights, quant, during=None):
        from gpu_worker.backend import to_numpy  # noqa: PLC0415
        from gpu_worker.model.moe import expert_stacks, experts_local  # noqa: PLC0415

        if during is not None:
            during()

        host_ids = to_numpy(ids)
        self.counts[layer] += np.bincount(host_ids.reshape(-1),
                                          minlength=self.model.cfg.num_experts)
        self.overlap[layer] += consecutive_overlap(host_ids)  # rows: one sequence's tokens
        return experts_local(self.model.ops, *expert_stacks(self.model.layers[layer].mlp), x,
                             ids, weights)

    def run_step(self, forward):
        return forward()

    def take_stats(self) -> dict[str, float]:
        return {}


def consecutive_overlap(ids: np.ndarray) -> np.ndarray:
    """[shared, pairs]: over consecutive rows of ``ids`` (int [R, k], one sequence's tokens
    in order), how many experts row r shares with row r - 1, summed, and R - 1."""
    ids = np.asarray(ids)
    if len(ids) < 2:
        return np.zeros(2, np.int64)
    shared = (ids[1:, :, None] == ids[:-1, None, :]).any(axis=2).sum()
    return np.array([shared, len(ids) - 1], np.int64)


def routing_stats(model, chunks: list[np.ndarray]
                  ) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    """:func:`count_routing`'s counts plus, per MoE layer, the mean fraction of a token's
    k experts that the previous token of the same prompt also picked."""
    counter = _run(model, chunks)
    k = model.cfg.num_experts_per_tok
    overlap = {i: float(o[0]) / max(1, int(o[1]) * k) for i, o in counter.overlap.items()}
    return counter.counts, overlap


def count_routing(model, chunks: list[np.ndarray]) -> dict[int, np.ndarray]:
    """Router picks per MoE layer over ``chunks`` of token ids, each run as one prompt from
    position 0: ``{layer: int64 [E]}``; every row adds its top-k experts once."""
    return _run(model, chunks).counts


def _run(model, chunks: list[np.ndarray]) -> RouterCounter:
    from gpu_worker.model.batch import RaggedBatch  # noqa: PLC0415

    counter = RouterCounter(model)
    longest = max((len(c) for c in chunks), default=1)
    caches = model.new_caches(1, longest)
    for chunk in chunks:
        if len(chunk):
            model.forward(RaggedBatch.build([(0, 0, np.asarray(chunk, np.int64))]), caches,
                          np.asarray([len(chunk) - 1]), counter)
            caches.reset_slot(0)
    return counter


def save_counts(path: str | Path, counts: dict[int, np.ndarray], *, model: str,
                tokens: int) -> None:
    Path(path).write_text(json.dumps({
        "format": FORMAT, "model": model, "tokens": tokens,
        "layers": {str(i): c.tolist() for i, c in sorted(counts.items())}}, indent=1) + "\n")


def load_counts(path: str | Path, cfg) -> dict[int, np.ndarray]:
    """The counts of ``path`` checked against the model config: ValueError naming the
    problem (not this format, a layer that is not a MoE layer, a wrong expert count)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"experts.hot_experts: cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"experts.hot_experts: {path} is not a {FORMAT} file "
                         "(write one with `tandem expert-stats`)")
    sparse = {i for i in range(cfg.num_hidden_layers) if cfg.is_sparse(i)}
    out = {}
    for key, values in data.get("layers", {}).items():
        layer = int(key) if str(key).isdigit() else -1
        arr = np.asarray(values)
        if layer not in sparse:
            raise ValueError(f"experts.hot_experts: {path}: layer {key} is not a MoE layer "
                             "of this model")
        if arr.shape != (cfg.num_experts,) or arr.dtype.kind not in "iu" or (arr < 0).any():
            raise ValueError(f"experts.hot_experts: {path}: layer {key} needs "
                             f"{cfg.num_experts} non-negative integer counts")
        out[layer] = arr.astype(np.int64)
    if set(out) != sparse:
        raise ValueError(f"experts.hot_experts: {path} lacks MoE layers "
                         f"{sorted(sparse - set(out))}")
    return out


def hot_order(counts: np.ndarray) -> np.ndarray:
    """The expert ids by descending count, ties by ascending id: new id j = old expert
    ``order[j]``."""
    return np.argsort(-np.asarray(counts), kind="stable")


def permute_experts(arrays: dict, order, prefix: str = "") -> None:
    """Renumber one MoE layer's experts in ``arrays`` (a dict holding ``{prefix}gate.weight``
    and ``{prefix}experts.{gate,up,down}_proj``): new expert j is old expert ``order[j]``."""
    for key in ["gate.weight"] + ["experts." + k for k in EXPERT_KEYS]:
        arrays[prefix + key] = arrays[prefix + key][order]
