"""The GPU's routed experts of one MoE layer in three kernel launches, with no host sync.

``experts_local`` on NumPy loops over the distinct experts of a layer. On CuPy that loop
costs a device-to-host copy (``unique``) and ~10 launches per expert, ~14 us each
(../shared/BENCHMARKS.md): a decode step of Qwen3-Next with 8-10 GPU experts per layer spent
milliseconds per layer launching. Here each (row, slot) pair ``p = r * k + j`` is computed
on its own:

1. ``moe_gate_up``: ``h[p, i] = silu(G[e_p, i] . x_r) * (U[e_p, i] . x_r)``, one warp per
   output ``i`` (pairs with ``e_p = -1``, experts computed elsewhere, give zeros);
2. ``moe_down``: ``y[p, o] = D[e_p, o] . h[p]``, one warp per output ``o``;
3. ``moe_combine``: ``out[r, o] = sum_j w[r, j] * y[p, o]``, the pairs of a row taken in
   ascending expert id (as ``experts_local``: the order never depends on the batch).

Every dot product is a warp's strided partial sums then a shuffle tree, in the same order
for every pair, so a row's result does not depend on the other rows of the batch (nor on the
batch's size): batching stays bit-exact for speculation. The NumPy formula of the same math
is ``gpu_worker.model.moe.experts_local``; ``tests/gpu/test_moe_experts_cupy.py`` compares.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels import raw_module

try:
    import cupy as cp
except ImportError:  # CI and laptops: the NumPy backend never calls in here
    cp = None

WARPS = 8  # warps per block: outputs per block of the two dot-product kernels
MAX_K = 32  # experts per row the combine kernel sorts

_TEMPLATE = r"""
__device__ __forceinline__ REAL warp_sum_REAL(REAL v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;  // lane 0 holds the sum
}

__device__ __forceinline__ REAL sigmoid_REAL(REAL v) {
    REAL e = exp(-fabs(v));  // split by sign: exp never overflows (as Ops.sigmoid)
    return v >= 0 ? (REAL)1 / ((REAL)1 + e) : e / ((REAL)1 + e);
}

// grid (P, ceil(I / WARPS)), block WARPS * 32
extern "C" __global__ void moe_gate_up_REAL(
        const REAL* __restrict__ x, const long long* __restrict__ ids, int k,
        const REAL* __restrict__ gate, const REAL* __restrict__ up, REAL* __restrict__ h,
        long long H, long long I) {
    long long i = (long long)blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    long long p = blockIdx.x;
    if (i >= I) return;
    long long e = ids[p];
    if (e < 0) {
        if (lane == 0) h[p * I + i] = 0;
        return;
    }
    const REAL* xr = x + (p / k) * H;
    const REAL* g = gate + (e * I + i) * H;
    const REAL* u = up + (e * I + i) * H;
    REAL sg = 0, su = 0;
    for (long long c = lane; c < H; c += 32) {
        REAL xv = xr[c];
        sg += g[c] * xv;
        su += u[c] * xv;
    }
    sg = warp_sum_REAL(sg);
    su = warp_sum_REAL(su);
    if (lane == 0) h[p * I + i] = sg * sigmoid_REAL(sg) * su;
}

// grid (P, ceil(H / WARPS)), block WARPS * 32
extern "C" __global__ void moe_down_REAL(
        const REAL* __restrict__ h, const long long* __restrict__ ids,
        const REAL* __restrict__ down, REAL* __restrict__ y, long long H, long long I) {
    long long o = (long long)blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    long long p = blockIdx.x;
    if (o >= H) return;
    long long e = ids[p];
    if (e < 0) return;  // the combine skips this pair
    const REAL* hp = h + p * I;
    const REAL* d = down + (e * H + o) * I;
    REAL s = 0;
    for (long long c = lane; c < I; c += 32) s += d[c] * hp[c];
    s = warp_sum_REAL(s);
    if (lane == 0) y[p * H + o] = s;
}

// one thread per (row, output): the row's pairs in ascending expert id, as experts_local
extern "C" __global__ void moe_combine_REAL(
        const REAL* __restrict__ y, const long long* __restrict__ ids,
        const REAL* __restrict__ w, int k, REAL* __restrict__ out, long long R, long long H) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= R * H) return;
    long long r = t / H, o = t % H;
    const long long* ir = ids + r * k;
    REAL acc = 0;
    long long last = -1;
    for (int n = 0; n < k; ++n) {  // the next larger id each time (top-k ids are distinct)
        long long best = -1;
        int bj = -1;
        for (int j = 0; j < k; ++j) {
            long long e = ir[j];
            if (e > last && (bj < 0 || e < best)) { best = e; bj = j; }
        }
        if (bj < 0) break;
        last = best;
        REAL term = w[r * k + bj] * y[(r * k + bj) * H + o];
        acc = acc + term;
    }
    out[t] = acc;
}
"""

_SOURCE = "".join(_TEMPLATE.replace("REAL", real) for real in ("float", "double"))


def _kernels():
    # NOTE: no FMA contraction (raw_module's default), so "w * y" then "+" round as the
    # NumPy formula's do
    return raw_module(_SOURCE, "grouped expert kernels")


def experts_grouped(x, ids, weights, gate, up, down):
    """``sum_k w_k * expert_{ids_k}(x)`` per row on the GPU: ``x [R, H]``, ``ids [R, k]``
    (-1: skip the pair), ``weights [R, k]``, experts stacked ``gate/up [E, I, H]``,
    ``down [E, H, I]``; float32 or float64 throughout. Enqueues three kernels; never waits."""
    dtype = x.dtype
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"experts_grouped computes in float32 or float64, not {dtype}")
    R, H = x.shape
    E, I, H2 = gate.shape
    k = ids.shape[1]
    if H2 != H or up.shape != gate.shape or down.shape != (E, H, I) or ids.shape[0] != R \
            or weights.shape != ids.shape or not 0 < k <= MAX_K:
        raise ValueError(f"x {x.shape}, ids {ids.shape}, weights {weights.shape}, gate "
                         f"{gate.shape}, up {up.shape}, down {down.shape} do not fit "
                         f"(k <= {MAX_K})")
    if any(a.dtype != dtype for a in (gate, up, down)):
        raise TypeError("the experts' weights must have the activations' dtype")
    out = cp.empty((R, H), dtype)
    P = R * k
    if P == 0 or E == 0:
        out[...] = 0
        return out
    x = cp.ascontiguousarray(x)
    ids = cp.ascontiguousarray(ids, dtype=cp.int64)
    w = cp.ascontiguousarray(weights, dtype=dtype)
    gate, up, down = (cp.ascontiguousarray(a) for a in (gate, up, down))
    name = "float" if dtype == np.float32 else "double"
    mod = _kernels()
    h = cp.empty((P, I), dtype)
    y = cp.empty((P, H), dtype)
    threads = WARPS * 32
    mod.get_function(f"moe_gate_up_{name}")(
        (P, -(-I // WARPS)), (threads,), (x, ids, np.int32(k), gate, up, h, np.int64(H),
                                         np.int64(I)))
    mod.get_function(f"moe_down_{name}")(
        (P, -(-H // WARPS)), (threads,), (h, ids, down, y, np.int64(H), np.int64(I)))
    mod.get_function(f"moe_combine_{name}")(
        (-(-(R * H) // 256),), (256,), (y, ids, w, np.int32(k), out, np.int64(R), np.int64(H)))
    return out
