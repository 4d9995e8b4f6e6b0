"""The GPU's routed experts of one MoE layer, merged: every expert's weights read once per
step (per 16 of its rows), whatever number of rows it serves; four launches, no host sync.

``experts_grouped`` (moe_experts.py) computes each (row, slot) pair alone and so reads an
expert once per pair routed to it. Here:

1. ``merged_build`` (one block): from ``ids [R, k]`` (-1 or >= E: computed elsewhere) a bit
   mask of rows per expert (integer atomics: the same result in any order), the counts, their
   exclusive scan, the active experts in ascending id, and the (expert, row) list ordered by
   (expert, row): a row's position in it is the popcount of its expert's mask below the row.
   Deterministic, no sort. A row that names an expert twice gets one list entry.
2. ``merged_gate_up``: block (s, tile) takes the s-th active expert's gate and up rows of its
   tile of ``I`` (2 per warp), streams them once, and applies every 16-byte load to up to RC
   of the expert's rows (RC = 1..16 from host facts: rows, top-k, E); it writes
   ``act[q, i] = silu(g) * u`` per list entry ``q``.
3. ``merged_down``: likewise over ``H`` (4 outputs per warp): ``y[q, o] = D[e, o] . act[q]``.
4. ``merged_combine``: ``out[r] = sum_j w[r, j] * y[q(r, j)]`` in slot order ``j = 0..k-1``.

The grids cannot depend on the routing without a host sync: they span ``S = min(E, R * k)``
expert slots (an upper bound on the active experts) and blocks past the device's count exit
at once (at top-10 of 512 that is no more than 10 * R slots: a few hundred empty blocks, ~1 us).
Every dot product sums in the order of moe_merged_ref.py (lanes take 8 consecutive elements,
then a shuffle tree), fixed by its length alone, so a row's bits do not depend on which rows
share the step or how many rows its expert has; float32 and bf16 weights holding the same
values give the same bits. NumPy reference: :mod:`gpu_worker.kernels.moe_merged_ref`.
"""

from __future__ import annotations

import functools

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.int8_stack import Int8Stack
from gpu_worker.kernels.moe_experts import check_expert_args
from gpu_worker.kernels.moe_merged_src import (
    BUILD_THREADS,
    COMBINE,
    COMMON,
    DOTS,
    NW,
    VARIANTS,
    WARPS,
    header,
)

try:
    import cupy as cp
except ImportError:  # CI and laptops: the NumPy backend never calls in here
    cp = None


@functools.cache
def _dots_module(name: str, rc: int):
    """gate/up and down kernels of one variant and rows-per-pass (compiled once each)."""
    real, wt = VARIANTS[name]
    code = (header() + DOTS.replace("REAL", real).replace("WT", wt)
            .replace("RC", str(rc)))
    # NOTE: no FMA contraction (raw_module's default): the reference's products and sums
    return raw_module(code, "merged expert kernels")


@functools.cache
def _common_module():
    code = (f"#define BUILD_THREADS {BUILD_THREADS}\n" + COMMON
            + "".join(COMBINE.replace("REAL", r) for r in ("float", "double")))
    return raw_module(code, "merged expert kernels")


@functools.cache
def _no_scales(device: int):
    """The scale argument of the variants without scales (never read): one array per
    device, not an allocation per call."""
    return cp.zeros(1, cp.uint16)


def rows_per_pass(rows: int, k: int, num_experts: int) -> int:
    """RC, the rows a block applies each weight load to (1, 2 or 4: :data:`MAX_RC`): the power
    of two covering twice the mean rows per expert (``rows * k / E``), at most ``rows``. Registers
    grow with RC and occupancy falls, so it follows what experts usually get (at top-10 of
    512 and 16 rows: 1, an expert with more rows takes more passes, its weights then mostly
    from L2). Only the passes change with it, never a row's arithmetic."""
    want = min(int(rows), -(-2 * int(rows) * int(k) // max(1, int(num_experts))))
    return min(MAX_RC, 1 << max(0, want - 1).bit_length())


# rows per pass at most: at 8 a block needs 139 registers a thread (sm_90, bf16), one block
# per SM instead of two, and the 80B's layers with 64 experts on the GPU took 30 ms per
# 16-row step against 19 ms at 12 rows (RC 4) on the H200
MAX_RC = 4


def build_lists(ids, num_experts: int) -> dict:
    """The build kernel's outputs for ``ids [R, k]`` (CuPy int): ``n_active [1]``,
    ``act_expert/act_start/act_count [S]`` (the first ``n_active`` valid), ``list_row [R*k]``
    (the first ``sum(act_count)`` valid), ``pair_q [R, k]`` (-1: not here), S = min(E, R*k).
    Enqueued, never waited for."""
    R, k = ids.shape
    E, P = int(num_experts), R * k
    S, W = max(1, min(E, P)), max(1, -(-R // 32))
    ids = cp.ascontiguousarray(ids, dtype=cp.int64)
    ints = cp.empty(E * W + E + 1 + 3 * S + 2 * P, cp.int32)  # one allocation, views below
    cuts = np.cumsum([E * W, E, 1, S, S, S, P])
    mask, offset, n_active, act_expert, act_start, act_count, list_row, pair_q = (
        ints[a:b] for a, b in zip([0, *cuts], [*cuts, ints.size], strict=True))
    _common_module().get_function("merged_build")(
        (1,), (BUILD_THREADS,),
        (ids, np.int32(R), np.int32(k), np.int32(E), np.int32(W), mask.view(cp.uint32), offset,
         n_active, act_expert, act_start, act_count, list_row, pair_q))
    return {"n_active": n_active, "act_expert": act_expert, "act_start": act_start,
            "act_count": act_count, "list_row": list_row, "pair_q": pair_q.reshape(R, k)}


def experts_merged(x, ids, weights, gate, up, down, rc: int | None = None):
    """``sum_k w_k * expert_{ids_k}(x)`` per row, each GPU expert's weights streamed once
    for all its rows: the contract of ``experts_grouped`` (``x [R, H]``, ``ids [R, k]`` with
    -1 to skip, ``weights [R, k]``, ``gate/up [E, I, H]``, ``down [E, H, I]``; float32 or
    float64, or float32 with bf16 weights as uint16 bits). Ids >= E are skipped too.
    ``rc``: rows per pass (1, 2, 4, 8, 16) instead of :func:`rows_per_pass`'s (benchmarks;
    the bits do not change). Enqueues four kernels; never waits."""
    bf16 = check_expert_args(x, ids, weights, gate, up, down, "experts_merged")
    int8 = isinstance(gate, Int8Stack)
    if int8:  # weights q with the scales as extra arguments
        scales = tuple(cp.ascontiguousarray(a.d) for a in (gate, up, down))
        gate, up, down = gate.q, up.q, down.q
    dtype = x.dtype
    R, H = x.shape
    E, I, _ = gate.shape
    k = ids.shape[1]
    out = cp.empty((R, H), dtype)
    if R * k == 0 or E == 0:
        out[...] = 0
        return out
    x = cp.ascontiguousarray(x)
    w = cp.ascontiguousarray(weights, dtype=dtype)
    gate, up, down = (cp.ascontiguousarray(a) for a in (gate, up, down))
    lists = build_lists(ids, E)
    S = lists["act_expert"].size
    real = "float" if dtype == np.float32 else "double"
    variant = "int8" if int8 else "bf16" if bf16 else real
    mod = _dots_module(variant, rc or rows_per_pass(R, k, E))
    if not int8:
        scales = (_no_scales(cp.cuda.Device().id),) * 3  # never read
    act = cp.empty((R * k, I), dtype)  # [list entries <= R k, I]
    y = cp.empty((R * k, H), dtype)  # [list entries, H]
    if int8 and not all(a.data.ptr % 8 == 0 for a in (x, gate, up, down, act, y)):
        raise ValueError("int8 experts: weights and activations must be 8-byte aligned")
    vec = np.int32(H % 8 == 0 and I % 8 == 0 and all(
        a.data.ptr % 16 == 0 for a in (x, gate, up, down, act, y)))
    meta = (lists["n_active"], lists["act_expert"], lists["act_start"], lists["act_count"])
    threads = WARPS * 32
    mod.get_function("merged_gate_up")(
        (S, -(-I // (WARPS * NW // 2))), (threads,),
        (x, *meta, lists["list_row"], gate, up, scales[0], scales[1], act, np.int64(H),
         np.int64(I), vec))
    mod.get_function("merged_down")(
        (S, -(-H // (WARPS * NW))), (threads,),
        (act, *meta, down, scales[2], y, np.int64(H), np.int64(I), vec))
    _common_module().get_function(f"merged_combine_{real}")(
        (-(-(R * H) // 256),), (256,),
        (y, lists["pair_q"], w, np.int32(k), out, np.int64(R), np.int64(H)))
    return out
