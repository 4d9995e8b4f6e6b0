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
from gpu_worker.kernels.moe_merged_ref import EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E, f32_bits

try:
    import cupy as cp
except ImportError:  # CI and laptops: the NumPy backend never calls in here
    cp = None

WARPS = 8  # warps per block of the dot-product kernels
NW = 4  # weight rows per warp: 2 outputs x (gate, up), or 4 outputs of down
BUILD_THREADS = 1024  # the build kernel's one block (a power of two: its scan)


def _f(v: np.float32) -> str:
    return f"__int_as_float({f32_bits(v):#010x})"


_HEADER = r"""
#define WARPS %(warps)d
#define NW %(nw)d
__device__ __forceinline__ float to_real(float v) { return v; }
__device__ __forceinline__ double to_real(double v) { return v; }
__device__ __forceinline__ float to_real(unsigned short u) {
    return __uint_as_float(((unsigned int)u) << 16);  // bf16 bits widened exactly
}
// 8 consecutive elements, one or more 16-byte loads (p 16-byte aligned)
__device__ __forceinline__ void load8(const float* p, float* o) {
    float4 a = __ldg((const float4*)p), b = __ldg((const float4*)p + 1);
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void load8(const double* p, double* o) {
    for (int t = 0; t < 4; ++t) {
        double2 a = __ldg((const double2*)p + t);
        o[2 * t] = a.x; o[2 * t + 1] = a.y;
    }
}
__device__ __forceinline__ void load8(const unsigned short* p, float* o) {
    uint4 u = __ldg((const uint4*)p);
    unsigned int w[4] = {u.x, u.y, u.z, u.w};
    for (int t = 0; t < 4; ++t) {  // element 2t is the low half (little-endian)
        o[2 * t] = __uint_as_float(w[t] << 16);
        o[2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
    }
}
// the m (<= 8) elements in range; vec: m == 8 and p aligned
template <typename S, typename T>
__device__ __forceinline__ void load_part(const S* p, int m, int vec, T* o) {
    if (vec) { load8(p, o); return; }
    for (int v = 0; v < 8; ++v) o[v] = v < m ? to_real(p[v]) : (T)0;
}
// a float16's value from its bits (finite: the int8 experts' scales), exactly
__device__ __forceinline__ float f16_value(unsigned short h) {
    unsigned int em = h & 0x7fffu;
    float v = em < 0x400u ? (float)em * 5.9604644775390625e-08f  // subnormal: em * 2^-24
                          : __uint_as_float((em << 13) + (112u << 23));
    return (h & 0x8000u) ? -v : v;
}
// a lane's 8 weights from row pointer p (+ the row's scales s, int8 only)
template <typename S, typename T>
__device__ __forceinline__ void load_w(const S* p, const unsigned short* s, int m, int vec,
                                       T* o) {
    load_part(p, m, vec, o);
}
// int8 blocks of 32: q * d, exact in float (8 consecutive weights share one block's scale)
__device__ __forceinline__ void load_w(const signed char* p, const unsigned short* s, int m,
                                       int vec, float* o) {
    float d = f16_value(__ldg(s));
    if (vec) {
        uint2 u = __ldg((const uint2*)p);
        unsigned int w[2] = {u.x, u.y};
        for (int v = 0; v < 8; ++v) o[v] = (float)(signed char)(w[v / 4] >> (8 * (v %% 4))) * d;
        return;
    }
    for (int v = 0; v < 8; ++v) o[v] = v < m ? (float)p[v] * d : 0.0f;
}
template <typename T> __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;  // lane 0 holds the sum
}
// exp(t), t <= 0, from + - * floor and a power of two: moe_merged_ref.exp_neg's steps
__device__ __forceinline__ float exp_neg(float t) {
    if (t != t) return t;
    if (t < %(exp_min)s) return 0.0f;
    float nf = floorf(t * %(log2e)s + 0.5f);
    float r = t - nf * %(ln2_hi)s;
    r = r - nf * %(ln2_lo)s;
    float p = %(c0)s;
    %(horner)s
    return p * __int_as_float(((int)nf + 127) << 23);
}
__device__ __forceinline__ double exp_neg(double t) { return exp(t); }
template <typename T> __device__ __forceinline__ T silu_mul(T g, T u) {
    T e = exp_neg(-fabs(g));
    T s = g >= (T)0 ? (T)1 / ((T)1 + e) : e / ((T)1 + e);
    return g * s * u;
}
// acc[w][r] = lane's partial of wr[w] . xr[r] over n elements, in the reference's order
template <int RC, typename WT, typename T>
__device__ __forceinline__ void tile_dots(const WT* const* wr, const unsigned short* const* sr,
                                          const T* const* xr, int nr, long long n, int vec,
                                          int lane, T acc[NW][RC]) {
    #pragma unroll
    for (int w = 0; w < NW; ++w)
        #pragma unroll
        for (int r = 0; r < RC; ++r) acc[w][r] = 0;
    #pragma unroll 2
    for (long long c = (long long)lane * 8; c < n; c += 256) {
        int m = n - c < 8 ? (int)(n - c) : 8;
        T wv[NW][8];
        #pragma unroll
        for (int w = 0; w < NW; ++w) load_w(wr[w] + c, sr[w] + (c >> 5), m, vec, wv[w]);
        // NOTE: x loads unconditional (rows past nr repeat a real row), so they are issued
        // together; a load under a condition is a branch, one load at a time
        #pragma unroll
        for (int r = 0; r < RC; ++r) {
            T xv[8];
            load_part(xr[r] + c, m, vec, xv);
            if (r < nr) {
                #pragma unroll
                for (int w = 0; w < NW; ++w)
                    #pragma unroll
                    for (int v = 0; v < 8; ++v)
                        if (v < m) acc[w][r] += wv[w][v] * xv[v];
            }
        }
    }
}
"""

# NAME: variant suffix; REAL: compute type; WT: weight storage type; RC: rows per pass
_DOTS = r"""
// grid (S, ceil(I / (WARPS * NW / 2))), block WARPS * 32: warp's outputs i0, i0 + 1
extern "C" __global__ void merged_gate_up(
        const REAL* __restrict__ x, const int* __restrict__ n_active,
        const int* __restrict__ act_expert, const int* __restrict__ act_start,
        const int* __restrict__ act_count, const int* __restrict__ list_row,
        const WT* __restrict__ gate, const WT* __restrict__ up,
        const unsigned short* __restrict__ gs, const unsigned short* __restrict__ us,
        REAL* __restrict__ act, long long H, long long I, int vec) {
    int s = blockIdx.x, lane = threadIdx.x & 31;
    if (s >= n_active[0]) return;  // an expert slot this step does not use
    long long i0 = ((long long)blockIdx.y * WARPS + threadIdx.x / 32) * (NW / 2);
    if (i0 >= I) return;
    long long e = act_expert[s];
    int start = act_start[s], cnt = act_count[s];
    const WT* wr[NW];
    const unsigned short* sr[NW];  // int8: each row's scales (else never read)
    for (int o = 0; o < NW / 2; ++o) {  // rows past I repeat i0 (computed, never stored)
        long long i = i0 + o < I ? i0 + o : i0;
        wr[2 * o] = gate + (e * I + i) * H;
        wr[2 * o + 1] = up + (e * I + i) * H;
        sr[2 * o] = gs + (e * I + i) * (H >> 5);
        sr[2 * o + 1] = us + (e * I + i) * (H >> 5);
    }
    for (int c0 = 0; c0 < cnt; c0 += RC) {
        int nr = min(RC, cnt - c0);
        const REAL* xr[RC];
        #pragma unroll
        for (int r = 0; r < RC; ++r)  // rows past nr repeat the last (never used)
            xr[r] = x + (long long)list_row[start + c0 + min(r, nr - 1)] * H;
        REAL acc[NW][RC];
        tile_dots<RC>(wr, sr, xr, nr, H, vec, lane, acc);
        #pragma unroll
        for (int o = 0; o < NW / 2; ++o)
            #pragma unroll
            for (int r = 0; r < RC; ++r) {
                if (r >= nr || i0 + o >= I) continue;  // warp-uniform
                REAL g = warp_sum(acc[2 * o][r]), u = warp_sum(acc[2 * o + 1][r]);
                if (lane == 0) act[(long long)(start + c0 + r) * I + i0 + o] = silu_mul(g, u);
            }
    }
}

// grid (S, ceil(H / (WARPS * NW))), block WARPS * 32: warp's outputs o0 .. o0 + NW - 1
extern "C" __global__ void merged_down(
        const REAL* __restrict__ act, const int* __restrict__ n_active,
        const int* __restrict__ act_expert, const int* __restrict__ act_start,
        const int* __restrict__ act_count, const WT* __restrict__ down,
        const unsigned short* __restrict__ ds, REAL* __restrict__ y, long long H, long long I,
        int vec) {
    int s = blockIdx.x, lane = threadIdx.x & 31;
    if (s >= n_active[0]) return;
    long long o0 = ((long long)blockIdx.y * WARPS + threadIdx.x / 32) * NW;
    if (o0 >= H) return;
    long long e = act_expert[s];
    int start = act_start[s], cnt = act_count[s];
    const WT* wr[NW];
    const unsigned short* sr[NW];
    for (int w = 0; w < NW; ++w) {
        long long o = o0 + w < H ? o0 + w : o0;
        wr[w] = down + (e * H + o) * I;
        sr[w] = ds + (e * H + o) * (I >> 5);
    }
    for (int c0 = 0; c0 < cnt; c0 += RC) {
        int nr = min(RC, cnt - c0);
        const REAL* xr[RC];
        #pragma unroll
        for (int r = 0; r < RC; ++r) xr[r] = act + (long long)(start + c0 + min(r, nr - 1)) * I;
        REAL acc[NW][RC];
        tile_dots<RC>(wr, sr, xr, nr, I, vec, lane, acc);
        #pragma unroll
        for (int w = 0; w < NW; ++w)
            #pragma unroll
            for (int r = 0; r < RC; ++r) {
                if (r >= nr || o0 + w >= H) continue;  // warp-uniform
                REAL v = warp_sum(acc[w][r]);
                if (lane == 0) y[(long long)(start + c0 + r) * H + o0 + w] = v;
            }
    }
}
"""

_COMMON = r"""
// one block of BUILD_THREADS threads; mask [E * W] (W = ceil(R / 32)) and offset [E] scratch
extern "C" __global__ void merged_build(
        const long long* __restrict__ ids, int R, int k, int E, int W,
        unsigned int* mask, int* offset, int* n_active, int* act_expert, int* act_start,
        int* act_count, int* list_row, int* pair_q) {
    __shared__ int sc[BUILD_THREADS], sa[BUILD_THREADS], carry[2];
    int t = threadIdx.x, T = blockDim.x, P = R * k;
    for (int i = t; i < E * W; i += T) mask[i] = 0;
    if (t == 0) { carry[0] = 0; carry[1] = 0; }
    __syncthreads();
    for (int p = t; p < P; p += T) {
        long long e = ids[p];
        int r = p / k;
        if (e >= 0 && e < E) atomicOr(&mask[e * W + r / 32], 1u << (r % 32));
    }
    __syncthreads();
    for (int base = 0; base < E; base += T) {  // counts, their scan, the active experts
        int e = base + t, c = 0;
        if (e < E) for (int w = 0; w < W; ++w) c += __popc(mask[e * W + w]);
        sc[t] = c;
        sa[t] = c > 0;
        __syncthreads();
        for (int off = 1; off < T; off <<= 1) {  // inclusive scans
            int vc = t >= off ? sc[t - off] : 0, va = t >= off ? sa[t - off] : 0;
            __syncthreads();
            sc[t] += vc;
            sa[t] += va;
            __syncthreads();
        }
        if (e < E) {
            int st = carry[0] + sc[t] - c;
            offset[e] = st;
            if (c > 0) {
                int si = carry[1] + sa[t] - 1;
                act_expert[si] = e; act_start[si] = st; act_count[si] = c;
            }
        }
        __syncthreads();
        if (t == T - 1) { carry[0] += sc[T - 1]; carry[1] += sa[T - 1]; }
        __syncthreads();
    }
    if (t == 0) n_active[0] = carry[1];
    for (int p = t; p < P; p += T) {  // list position: the expert's rows below r, popcounted
        long long e = ids[p];
        int r = p / k;
        if (e < 0 || e >= E) { pair_q[p] = -1; continue; }
        const unsigned int* m = mask + e * W;
        int rank = __popc(m[r / 32] & ((1u << (r % 32)) - 1u));
        for (int w = 0; w < r / 32; ++w) rank += __popc(m[w]);
        int q = offset[e] + rank;
        pair_q[p] = q;
        list_row[q] = r;  // a row naming e twice writes the same entry twice
    }
}
"""

_COMBINE = r"""
// one thread per (row, output): the row's pairs in slot order j = 0..k-1
extern "C" __global__ void merged_combine_REAL(
        const REAL* __restrict__ y, const int* __restrict__ pair_q,
        const REAL* __restrict__ w, int k, REAL* __restrict__ out, long long R, long long H) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= R * H) return;
    long long r = t / H, o = t % H;
    REAL acc = 0;
    for (int j = 0; j < k; ++j) {
        int q = pair_q[r * k + j];
        if (q >= 0) acc = acc + w[r * k + j] * y[(long long)q * H + o];
    }
    out[t] = acc;
}
"""

# name -> (compute type, weight storage type)
_VARIANTS = {"float": ("float", "float"), "double": ("double", "double"),
             "bf16": ("float", "unsigned short"), "int8": ("float", "signed char")}


def _header() -> str:
    horner = " ".join(f"p = p * r + {_f(c)};" for c in EXP_POLY[1:])
    return _HEADER % {"warps": WARPS, "nw": NW, "exp_min": _f(np.float32(EXP_MIN)),
                      "log2e": _f(LOG2E), "ln2_hi": _f(LN2_HI), "ln2_lo": _f(LN2_LO),
                      "c0": _f(EXP_POLY[0]), "horner": horner}


@functools.cache
def _dots_module(name: str, rc: int):
    """gate/up and down kernels of one variant and rows-per-pass (compiled once each)."""
    real, wt = _VARIANTS[name]
    code = (_header() + _DOTS.replace("REAL", real).replace("WT", wt)
            .replace("RC", str(rc)))
    # NOTE: no FMA contraction (raw_module's default): the reference's products and sums
    return raw_module(code, "merged expert kernels")


@functools.cache
def _common_module():
    code = (f"#define BUILD_THREADS {BUILD_THREADS}\n" + _COMMON
            + "".join(_COMBINE.replace("REAL", r) for r in ("float", "double")))
    return raw_module(code, "merged expert kernels")


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
        scales = (cp.zeros(1, cp.uint16),) * 3  # never read
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
