"""The GPU's routed experts of one MoE layer in three kernel launches, with no host sync.

``experts_local`` on NumPy loops over the distinct experts of a layer. On CuPy that loop
costs a device-to-host copy (``unique``) and ~10 launches per expert, ~14 us each
(docs/architecture.md §12): a decode step of Qwen3-Next with 8-10 GPU experts per layer spent
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

A bf16 model's experts are read as bf16 bits and widened exactly in the loads (``to_real``),
so its arithmetic is the float32 kernels' own: float32 weights holding the same (bf16-rounded)
values give the same bits (``tests/gpu/test_bf16_cupy.py``).
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.bf16 import BITS
from gpu_worker.kernels.int8_stack import Int8Stack

try:
    import cupy as cp
except ImportError:  # CI and laptops: the NumPy backend never calls in here
    cp = None

WARPS = 8  # warps per block: outputs per block of the two dot-product kernels
MAX_K = 32  # experts per row the combine kernel sorts

_HEADER = r"""
// a weight element as compute type: float and double as they are; bf16 bits (unsigned short)
// widened exactly to float (a bf16 is the top half of a float32)
__device__ __forceinline__ float to_real(float v) { return v; }
__device__ __forceinline__ double to_real(double v) { return v; }
__device__ __forceinline__ float to_real(unsigned short u) {
    return __uint_as_float(((unsigned int)u) << 16);
}

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;  // lane 0 holds the sum
}

template <typename T> __device__ __forceinline__ T sigmoid_t(T v) {
    T e = exp(-fabs(v));  // split by sign: exp never overflows (as Ops.sigmoid)
    return v >= 0 ? (T)1 / ((T)1 + e) : e / ((T)1 + e);
}
"""

# REAL: the activations' (compute) type; WT: the weights' storage type; NAME: the suffix
_EXPERTS = r"""
// grid (P, ceil(I / WARPS)), block WARPS * 32
extern "C" __global__ void moe_gate_up_NAME(
        const REAL* __restrict__ x, const long long* __restrict__ ids, int k,
        const WT* __restrict__ gate, const WT* __restrict__ up, REAL* __restrict__ h,
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
    const WT* g = gate + (e * I + i) * H;
    const WT* u = up + (e * I + i) * H;
    REAL sg = 0, su = 0;
    for (long long c = lane; c < H; c += 32) {
        REAL xv = xr[c];
        sg += to_real(g[c]) * xv;
        su += to_real(u[c]) * xv;
    }
    sg = warp_sum(sg);
    su = warp_sum(su);
    if (lane == 0) h[p * I + i] = sg * sigmoid_t(sg) * su;
}

// grid (P, ceil(H / WARPS)), block WARPS * 32
extern "C" __global__ void moe_down_NAME(
        const REAL* __restrict__ h, const long long* __restrict__ ids,
        const WT* __restrict__ down, REAL* __restrict__ y, long long H, long long I) {
    long long o = (long long)blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    long long p = blockIdx.x;
    if (o >= H) return;
    long long e = ids[p];
    if (e < 0) return;  // the combine skips this pair
    const REAL* hp = h + p * I;
    const WT* d = down + (e * H + o) * I;
    REAL s = 0;
    for (long long c = lane; c < I; c += 32) s += to_real(d[c]) * hp[c];
    s = warp_sum(s);
    if (lane == 0) y[p * H + o] = s;
}
"""

_COMBINE = r"""
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

# (suffix, compute type, weight storage type): float32 and float64 models, and bf16 weights
# (uint16 bits) with float32 activations -- the same float code, the weights widened on load
_VARIANTS = (("float", "float", "float"), ("double", "double", "double"),
             ("bf16", "float", "unsigned short"))
_SOURCE = _HEADER + "".join(
    _EXPERTS.replace("NAME", name).replace("REAL", real).replace("WT", wt)
    for name, real, wt in _VARIANTS) + "".join(
    _COMBINE.replace("REAL", real) for real in ("float", "double"))


def _kernels():
    # NOTE: no FMA contraction (raw_module's default), so "w * y" then "+" round as the
    # NumPy formula's do
    return raw_module(_SOURCE, "grouped expert kernels")


def check_expert_args(x, ids, weights, gate, up, down, name: str) -> bool:
    """The expert kernels' contract (``experts_grouped``, ``experts_merged``): shapes fit,
    float32/float64 throughout, float32 with bf16 bits, or float32 with three int8 stacks
    (gpu_worker/kernels/int8_stack.py); returns whether the weights are bf16 bits. Raises
    ValueError (shapes) or TypeError (dtypes)."""
    dtype = x.dtype
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} computes in float32 or float64, not {dtype}")
    R, H = x.shape
    E, I, H2 = gate.shape
    k = ids.shape[1]
    if H2 != H or up.shape != gate.shape or down.shape != (E, H, I) or ids.shape[0] != R \
            or weights.shape != ids.shape or not 0 < k <= MAX_K:
        raise ValueError(f"x {x.shape}, ids {ids.shape}, weights {weights.shape}, gate "
                         f"{gate.shape}, up {up.shape}, down {down.shape} do not fit "
                         f"(k <= {MAX_K})")
    int8 = [isinstance(a, Int8Stack) for a in (gate, up, down)]
    if any(int8):
        if not all(int8) or dtype != np.float32:
            raise TypeError(f"{name}: int8 experts come as three int8 stacks with float32 "
                            "activations")
        return False
    bf16 = dtype == np.float32 and gate.dtype == BITS
    if any(a.dtype != (BITS if bf16 else dtype) for a in (gate, up, down)):
        raise TypeError("the experts' weights must have the activations' dtype (or be bf16 "
                        "bits with float32 activations)")
    return bool(bf16)


def experts_grouped(x, ids, weights, gate, up, down):
    """``sum_k w_k * expert_{ids_k}(x)`` per row on the GPU: ``x [R, H]``, ``ids [R, k]``
    (-1: skip the pair), ``weights [R, k]``, experts stacked ``gate/up [E, I, H]``,
    ``down [E, H, I]``; float32 or float64 throughout, or float32 activations with bf16
    weights (uint16 bits, gpu_worker/kernels/bf16.py). Enqueues three kernels; never waits."""
    bf16 = check_expert_args(x, ids, weights, gate, up, down, "experts_grouped")
    if isinstance(gate, Int8Stack):
        raise TypeError("experts_grouped has no int8 kernels: int8 experts take the merged "
                        "ones (gpu_worker/model/moe.py GPU_EXPERT_KERNELS)")
    dtype = x.dtype
    R, H = x.shape
    E, I, _ = gate.shape
    k = ids.shape[1]
    out = cp.empty((R, H), dtype)
    P = R * k
    if P == 0 or E == 0:
        out[...] = 0
        return out
    x = cp.ascontiguousarray(x)
    ids = cp.ascontiguousarray(ids, dtype=cp.int64)
    w = cp.ascontiguousarray(weights, dtype=dtype)
    gate, up, down = (cp.ascontiguousarray(a) for a in (gate, up, down))
    real = "float" if dtype == np.float32 else "double"
    name = "bf16" if bf16 else real
    mod = _kernels()
    h = cp.empty((P, I), dtype)
    y = cp.empty((P, H), dtype)
    threads = WARPS * 32
    mod.get_function(f"moe_gate_up_{name}")(
        (P, -(-I // WARPS)), (threads,), (x, ids, np.int32(k), gate, up, h, np.int64(H),
                                         np.int64(I)))
    mod.get_function(f"moe_down_{name}")(
        (P, -(-H // WARPS)), (threads,), (h, ids, down, y, np.int64(H), np.int64(I)))
    mod.get_function(f"moe_combine_{real}")(
        (-(-(R * H) // 256),), (256,), (y, ids, w, np.int32(k), out, np.int64(R), np.int64(H)))
    return out
