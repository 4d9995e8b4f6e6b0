"""CUDA source of the merged expert kernels (gpu_worker/kernels/moe_merged.py): the loads
(float32, float64, bf16 bits, int8 blocks of 32 with their fp16 scales), the dot products in
moe_merged_ref.py's order, SiLU, and the build, gate/up, down and combine kernels."""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels.moe_merged_ref import EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E, f32_bits

WARPS = 8  # warps per block of the dot-product kernels
NW = 4  # weight rows per warp: 2 outputs x (gate, up), or 4 outputs of down
BUILD_THREADS = 1024  # the build kernel's one block (a power of two: its scan)


def _f(v: np.float32) -> str:
    return f"__int_as_float({f32_bits(v):#010x})"


HEADER = r"""
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
DOTS = r"""
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

COMMON = r"""
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

COMBINE = r"""
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
VARIANTS = {"float": ("float", "float"), "double": ("double", "double"),
             "bf16": ("float", "unsigned short"), "int8": ("float", "signed char")}


def header() -> str:
    horner = " ".join(f"p = p * r + {_f(c)};" for c in EXP_POLY[1:])
    return HEADER % {"warps": WARPS, "nw": NW, "exp_min": _f(np.float32(EXP_MIN)),
                      "log2e": _f(LOG2E), "ln2_hi": _f(LN2_HI), "ln2_lo": _f(LN2_LO),
                      "c0": _f(EXP_POLY[0]), "horner": horner}
