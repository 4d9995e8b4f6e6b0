"""Argument checks of CpuExpertPool's dispatches (before anything is sent to a worker)."""

from __future__ import annotations

import numpy as np
from numba import njit


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
                weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``(ids, weights, num_experts)`` of a dispatch of ``rows`` rows to ``layer``, shapes
    checked: KeyError for a layer without CPU experts, ValueError for shapes or top-k. The ids'
    range is checked by :func:`fill_pairs` as it copies them (``ids_out_of_range`` words the
    error)."""
    ql = layers.get(layer)
    if ql is None:
        raise KeyError(f"layer {layer} has no CPU experts (have {sorted(layers)})")
    ids, w = np.asarray(expert_ids), np.asarray(weights)
    if ids.ndim != 2 or ids.shape[0] != rows or w.shape != ids.shape:
        raise ValueError(f"expert_ids {ids.shape} and weights {w.shape} must both "
                         f"be [{rows}, k]")
    if ids.shape[1] > max_k:
        raise ValueError(f"top-k {ids.shape[1]} exceeds the pool's max_k={max_k}")
    if ids.dtype.kind not in "iu" or w.dtype.kind != "f":
        raise ValueError(f"expert_ids must be integers and weights floats, got {ids.dtype} "
                         f"and {w.dtype}")
    return ids, w, ql.num_experts


def ids_out_of_range(layer: int, num_experts: int) -> ValueError:
    return ValueError(f"expert ids must lie in [-1, {num_experts}) for layer {layer}")


def check_all_ids(layer: int, ids: np.ndarray, num_experts: int, max_rows: int) -> None:
    """A dispatch of more rows than one load holds checks every id before the first load
    (one load's are checked as they are copied into the ring): a bad id changes nothing."""
    if ids.shape[0] > max_rows and ids.size and (ids.min() < -1 or ids.max() >= num_experts):
        raise ids_out_of_range(layer, num_experts)


def load_slices(rows: int, max_rows: int) -> list[slice | None]:
    """The row ranges of a dispatch's loads; ``[None]`` when one load holds every row (no
    slicing: four slices cost ~1 us)."""
    if rows <= max_rows:
        return [None]
    return [slice(r0, min(rows, r0 + max_rows)) for r0 in range(0, rows, max_rows)]


def rows(rs: slice | None, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """``arrays`` cut to one load's rows ``rs`` (a :func:`load_slices` item), as they are for
    ``None``."""
    return arrays if rs is None else tuple(a[rs] for a in arrays)


@njit(cache=True, nogil=True)
def fill_pairs(ids, w, ids_v, w_v, num_experts: int) -> int:
    """Every id of ``ids [R, K]`` checked to lie in [-1, num_experts), then ids and ``w`` copied
    into the ring's flat pair regions (``[R * K]`` int32 and float32). Returns -1, or the flat
    index of the first bad id (nothing copied then). One compiled call: the NumPy checks and
    copies it replaces cost ~10 us per dispatch."""
    R, K = ids.shape
    for r in range(R):
        for k in range(K):
            if ids[r, k] < -1 or ids[r, k] >= num_experts:
                return r * K + k
    for r in range(R):
        for k in range(K):
            ids_v[r * K + k] = np.int32(ids[r, k])
            w_v[r * K + k] = np.float32(w[r, k])
    return -1


@njit(cache=True, nogil=True)
def fill_load(q, bits, ids, w, xq, xd, ids_v, w_v, num_experts: int) -> int:
    """:func:`fill_pairs`, then (ids good) the rows of ``q``/``bits`` into the ring's ``xq``
    and ``xd``."""
    bad = fill_pairs(ids, w, ids_v, w_v, num_experts)
    if bad < 0:  # NOTE: element loops; a row slice assignment here costs ~1 us a row
        for r in range(q.shape[0]):
            for i in range(q.shape[1]):
                xq[r, np.uintp(i)] = q[r, np.uintp(i)]
            for i in range(bits.shape[1]):
                xd[r, np.uintp(i)] = bits[r, np.uintp(i)]
    return bad
