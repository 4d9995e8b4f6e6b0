"""Argument checks of CpuExpertPool's dispatches (before anything is sent to a worker)."""

from __future__ import annotations

import numpy as np


def out_array(out: np.ndarray | None, rows: int, hidden: int) -> np.ndarray:
    """``out`` checked as a writeable C-contiguous float32 ``[rows, hidden]`` array, or a new
    one."""
    if out is None:
        return np.empty((rows, hidden), np.float32)
    if (out.shape != (rows, hidden) or out.dtype != np.float32
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"out must be a writeable C-contiguous float32 [{rows}, "
                         f"{hidden}] array, got {out.dtype} {out.shape}")
    return out


def check_pairs(layers: dict, max_k: int, layer: int, rows: int, expert_ids: np.ndarray,
                weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int32, weights float32)`` of a dispatch of ``rows`` rows to ``layer``: KeyError
    for a layer without CPU experts, ValueError for shapes, top-k or ids out of range."""
    ql = layers.get(layer)
    if ql is None:
        raise KeyError(f"layer {layer} has no CPU experts (have {sorted(layers)})")
    ids = np.asarray(expert_ids)
    if ids.ndim != 2 or ids.shape[0] != rows or np.asarray(weights).shape != ids.shape:
        raise ValueError(f"expert_ids {ids.shape} and weights {np.shape(weights)} must both "
                         f"be [{rows}, k]")
    if ids.shape[1] > max_k:
        raise ValueError(f"top-k {ids.shape[1]} exceeds the pool's max_k={max_k}")
    if ids.size and (ids.min() < -1 or ids.max() >= ql.num_experts):
        raise ValueError(f"expert ids must lie in [-1, {ql.num_experts}) for layer {layer}")
    return ids.astype(np.int32, copy=False), np.asarray(weights, dtype=np.float32)
