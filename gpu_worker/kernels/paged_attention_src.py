"""The CUDA source of gpu_worker/kernels/paged_attention.py: its three kernels (KV write,
partitioned attention, merge) in four variants (float32 / float64 math, a cache of the model
dtype or int8), the attention kernel also per dims per lane. The order of the arithmetic is
described there and in paged_attention_ref.py (its NumPy twin)."""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels.paged_attention_ref import CHUNK, exp_constants

# the kernels reduce a chunk's scores transposed: 16 keys over a warp's 32 lanes
assert CHUNK == 16, CHUNK
DIM_SLOTS = (1, 2, 4, 8)  # dims per lane of the compiled variants (the smallest that holds hd)
KEY_GROUP = 4  # keys whose K (then V) loads a lane issues together
MAX_WARPS = 8  # q heads (one per warp) of a block; a larger group takes several blocks
FULL_MIN_SLOTS = 4  # dims per lane from which an unclamped (hd = 32 x slots) variant exists
# (dims per lane, unclamped) of the compiled attention kernels
_ATTN_SHAPES = tuple((m, full) for m in DIM_SLOTS for full in (False, True)
                     if not full or m >= FULL_MIN_SLOTS)


def attn_kernel(variant: str, hd: int, rows: int = 1) -> str:
    """The attention kernel for head dim ``hd`` (<= 32 x the largest of :data:`DIM_SLOTS`):
    the fewest dims per lane that hold it, unclamped where hd fills them exactly; ``rows``
    per warp (a module of :func:`source` with those rows)."""
    slots = next(m for m in DIM_SLOTS if 32 * m >= hd)
    full = "f" if hd == 32 * slots and slots >= FULL_MIN_SLOTS else ""
    return f"paged_attn_{variant}_m{slots}{full}" + (f"_r{rows}" if rows > 1 else "")


def _literal(v) -> str:
    if v.dtype == np.float32:
        return f"__int_as_float({int(np.asarray(v).view(np.int32))})"
    return f"__longlong_as_double({int(np.asarray(v).view(np.int64))}LL)"


def _exp_source(real: str, dtype) -> str:
    c = {k: (_literal(v) if k != "coef" else [_literal(x) for x in v])
         for k, v in exp_constants(np.dtype(dtype)).items()}
    two_n = ("__int_as_float(((int)n + 127) << 23)" if real == "float"
             else "__longlong_as_double((long long)((int)n + 1023) << 52)")
    horner = "".join(f"    p = p * r + {k};\n" for k in reversed(c["coef"][:-1]))
    return (f"__device__ __forceinline__ {real} exp_neg({real} x) {{\n"
            f"    if (!(x >= {c['cut']})) return 0;\n"
            f"    {real} n = rint_t(x * {c['log2e']});\n"
            f"    {real} r = (x - n * {c['ln2_hi']}) - n * {c['ln2_lo']};\n"
            f"    {real} p = {c['coef'][-1]};\n{horner}"
            f"    return p * {two_n};\n}}\n")


_HEADER = r"""
__device__ __forceinline__ float rint_t(float x) { return rintf(x); }
__device__ __forceinline__ double rint_t(double x) { return rint(x); }
__device__ __forceinline__ float max_t(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_t(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
// c ? a : b as one select instruction (a chain of them is not turned into an indexed local
// array, which the compiler otherwise does for `x = lane == j ? s[j] : x` over j)
__device__ __forceinline__ float pick(bool c, float a, float b) {
    float d;
    asm volatile("slct.f32.s32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "r"(c ? 0 : -1));
    return d;
}
__device__ __forceinline__ double pick(bool c, double a, double b) {
    double d;
    asm volatile("slct.f64.s32 %0, %1, %2, %3;" : "=d"(d) : "d"(a), "d"(b), "r"(c ? 0 : -1));
    return d;
}
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// fp16 bits -> float, exactly (subnormals included)
__device__ __forceinline__ float half_to_float(unsigned short h) {
    unsigned int s = ((unsigned int)h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) { float v = (float)m * 5.9604644775390625e-08f; return s ? -v : v; }
    if (e == 31) return __uint_as_float(s | 0x7f800000u | (m << 13));
    return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}

// float d >= 0 -> fp16 bits, round to nearest even as NumPy's astype(float16) (inf above)
__device__ __forceinline__ unsigned short float_to_half(float d) {
    if (d >= 65520.0f) return 0x7c00;
    if (d < 6.103515625e-05f) return (unsigned short)rintf(d * 16777216.0f);
    int e;
    frexpf(d, &e);  // d = m 2^e, m in [0.5, 1): 11 significant bits kept
    int r = (int)rintf(ldexpf(d, 11 - e));
    return (unsigned short)(((e + 14) << 10) + (r - 1024));  // r == 2048 carries into e
}

// one warp quantizes 32 values (lane = value) as KVCache._quantize
__device__ __forceinline__ void quant32(float x, signed char* q, unsigned short* sc, int d) {
    unsigned int m = __float_as_uint(x) & 0x7fffffffu;
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    unsigned short bits = float_to_half(__fdiv_rn(__uint_as_float(m), 127.0f));
    float dd = half_to_float(bits);
    float r = rintf(__fdiv_rn(x, dd > 0.0f ? dd : 1.0f));
    q[d] = (signed char)fminf(fmaxf(r, -127.0f), 127.0f);
    if ((d & 31) == 0) sc[d >> 5] = bits;
}
"""

# NAME: variant; REAL: math type; KT: cache element; LOAD(i, si): cache element i as REAL
# (si: its fp16 scale's index); STORE: one value into the cache.
# Pools [layers, blocks, block_size, Hkv, hd]; a (layer, block, offset, head) vector is `vec`.
_KERNELS = r"""
#define VEC(pos) ((((long long)layer * nblocks + table[(pos) / bsize]) * bsize \
                   + (pos) % bsize) * hkv + h)

// grid (R, Hkv), block hd rounded up to 32; meta [3, n]: batch row, slot, position
extern "C" __global__ void kv_write_NAME(
        const REAL* __restrict__ k, const REAL* __restrict__ v, KT* kpool, KT* vpool,
        unsigned short* kscale, unsigned short* vscale, const int* __restrict__ tables,
        int width, const int* __restrict__ meta, int n, int layer, int nblocks, int bsize,
        int hkv, int hd) {
    int i = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    int row = meta[i], pos = meta[2 * n + i];
    const int* table = tables + (long long)meta[n + i] * width;
    long long vec = VEC(pos), src = ((long long)row * hkv + h) * hd;
    if (d >= hd) return;
    STORE
}

// grid (ceil(n / R), Hkv hb, nz), block W warps (W = min(group, MAX_WARPS), hb = ceil(group /
// W)). Warp w of block (x, h hb + b, z) computes q head g = b W + w of kv head h over
// partition z for rows i = x R .. x R + R - 1 (< n; with R > 1 rows of one slot, which share
// every key and value load): keys [z part, (z + 1) part) & [0, pos_i] -> m, l, acc [hd] at
// workspace index w = (i hkv + h) nz + z, head g. Lane L holds dims d = L + 32 m (m < M,
// M 32 >= hd): q, acc. Each row's arithmetic is that of R = 1 (a row alone), op for op.
// The warps of a block read the same keys and values (one kv head): the L1 serves all but
// the first. No shared memory, no barrier; every branch is uniform in a warp.
// NOTE: every load is unconditional (a key past the partition reads its last key, a dim past
// hd reads dim hd - 1; those values are never used), so the compiler issues a group's loads
// together; a load under a condition is a branch, and loads behind branches were issued one at
// a time (the H200: 30 us per chunk of 16 keys).
// FULL: hd == 32 M, every lane's dims in the row (no clamping: a key's loads share one base
// address with immediate offsets, which keeps hd 256 within the registers)
template <int M, bool FULL, int R>
__device__ __forceinline__ void attn_NAME(
        const REAL* __restrict__ q, const KT* __restrict__ kpool, const KT* __restrict__ vpool,
        const unsigned short* __restrict__ kscale, const unsigned short* __restrict__ vscale,
        const int* __restrict__ tables, int width, const int* __restrict__ meta, int n,
        REAL* __restrict__ pm, REAL* __restrict__ pl, REAL* __restrict__ pacc, int layer,
        int nblocks, int bsize, int hkv, int hd, int group, int part, int nz, REAL scale) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int hb = (group + warps - 1) / warps;
    const int i0 = blockIdx.x * R, h = blockIdx.y / hb;
    int g = (blockIdx.y % hb) * warps + (threadIdx.x >> 5);
    int pos[R];  // the rows' positions (-1: past n)
    int top = -1;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        pos[r] = i0 + r < n ? meta[2 * n + i0 + r] : -1;
        top = max(top, pos[r]);
    }
    if (blockIdx.z * part > top || g >= group) return;  // past the rows' keys, or the group
    const int* table = tables + (long long)meta[n + i0] * width;
    int dc[M];    // the lane's dims, clamped into the row (loads stay in bounds)
    bool on[M];   // dims < hd
    REAL qr[R][M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        on[m] = FULL || lane + 32 * m < hd;
        dc[m] = FULL ? lane + 32 * m : min(lane + 32 * m, hd - 1);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        long long qoff = (((long long)meta[min(i0 + r, n - 1)] * hkv + h) * group + g) * hd;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            qr[r][m] = q[qoff + dc[m]];
            if (!on[m]) qr[r][m] = 0;
        }
    }
    // partitions z = blockIdx.z, + gridDim.z, ...: the grid's z stays small whatever the
    // context limit a graph sizes nz for; each partition is computed and stored on its own
    for (int z = blockIdx.z; z < nz && z * part <= top; z += gridDim.z) {
    const int first = z * part, last = min(top, first + part - 1);
    REAL acc[R][M], mo[R], l[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0;
        mo[r] = NEG_INF;
        l[r] = 0;
    }
#define AT(P, S, j, m) LOAD(P, S, (long long)vec[j] * hd + dc[m], \
                           (long long)vec[j] * (hd / 32) + dc[m] / 32)
    for (int c0 = first; c0 <= last; c0 += CHUNK) {
        const int valid = min(CHUNK, last + 1 - c0);  // the chunk's keys some row takes
        int vec[CHUNK];  // < 2^31 vectors of hd (paged_attention checks the pool)
        REAL s[R][CHUNK];
        if (bsize % CHUNK == 0) {  // the chunk lies in one block (c0 % CHUNK == 0): one lookup
            const int v0 = (int)VEC(c0);
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) vec[j] = v0 + min(j, valid - 1) * hkv;
        } else {
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) vec[j] = (int)VEC(c0 + min(j, valid - 1));
        }
#pragma unroll
        for (int j0 = 0; j0 < CHUNK; j0 += GK) {  // the lane's partial dot of each key
            REAL kv[GK][M];
#pragma unroll
            for (int jj = 0; jj < GK; ++jj)
#pragma unroll
                for (int m = 0; m < M; ++m) kv[jj][m] = AT(kpool, kscale, j0 + jj, m);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int jj = 0; jj < GK; ++jj) {
                    REAL p = 0;
#pragma unroll
                    for (int m = 0; m < M; ++m)
                        if (on[m]) p = p + qr[r][m] * kv[jj][m];
                    s[r][j0 + jj] = p;  // keys past the row's valid: never used
                }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int vr = min(valid, pos[r] + 1 - c0);  // the row's keys here (uniform)
            if (vr <= 0) continue;
            // the warp's sums of the chunk's keys, transposed as they are reduced: at the
            // xor step over lane bit b a lane keeps half its keys (its bit b's half) and adds
            // its partner's partial of each; after bits 4, 3, 2, 1 lane L holds key
            // (L >> 1) & 15, and bit 0 adds L ^ 1's. Each sum is the xor butterfly's (the
            // same additions, operands only swapped), in 16 shuffles for the chunk, not 80
            REAL t8[8], t4[4], t2[2];
            const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4, b1 = lane & 2;
#pragma unroll
            for (int t = 0; t < 8; ++t)
                t8[t] = pick(b4, s[r][t + 8], s[r][t])
                        + __shfl_xor_sync(0xffffffffu, pick(b4, s[r][t], s[r][t + 8]), 16);
#pragma unroll
            for (int t = 0; t < 4; ++t)
                t4[t] = pick(b3, t8[t + 4], t8[t])
                        + __shfl_xor_sync(0xffffffffu, pick(b3, t8[t], t8[t + 4]), 8);
#pragma unroll
            for (int t = 0; t < 2; ++t)
                t2[t] = pick(b2, t4[t + 2], t4[t])
                        + __shfl_xor_sync(0xffffffffu, pick(b2, t4[t], t4[t + 2]), 4);
            REAL mine = pick(b1, t2[1], t2[0])
                        + __shfl_xor_sync(0xffffffffu, pick(b1, t2[0], t2[1]), 2);
            mine = (mine + __shfl_xor_sync(0xffffffffu, mine, 1)) * scale;
            // the chunk's max over the row's keys (exact in any order)
            REAL mc = ((lane >> 1) & 15) < vr ? mine : NEG_INF;
#pragma unroll
            for (int o = 2; o < 32; o <<= 1) mc = max_t(mc, __shfl_xor_sync(0xffffffffu, mc, o));
            REAL mn = max_t(mo[r], mc), alpha = exp_neg(mo[r] - mn);
            l[r] = l[r] * alpha;
            const REAL e = exp_neg(mine - mn);  // key (lane >> 1) & 15's, read from lane 2j
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) {
                if (j < vr) {
                    s[r][j] = __shfl_sync(0xffffffffu, e, 2 * j);
                    l[r] = l[r] + s[r][j];
                }
            }
#pragma unroll
            for (int m = 0; m < M; ++m) acc[r][m] = acc[r][m] * alpha;
            mo[r] = mn;
        }
#pragma unroll
        for (int j0 = 0; j0 < CHUNK; j0 += GK) {  // acc_d + p_j v_jd, j ascending
            REAL vv[GK][M];
#pragma unroll
            for (int jj = 0; jj < GK; ++jj)
#pragma unroll
                for (int m = 0; m < M; ++m) vv[jj][m] = AT(vpool, vscale, j0 + jj, m);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int vr = min(valid, pos[r] + 1 - c0);
#pragma unroll
                for (int jj = 0; jj < GK; ++jj)
                    if (j0 + jj < vr)
#pragma unroll
                        for (int m = 0; m < M; ++m)
                            acc[r][m] = acc[r][m] + s[r][j0 + jj] * vv[jj][m];
            }
        }
    }
#undef AT
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (first > pos[r]) continue;  // the row has no key here (nor a later partition)
        long long w = ((long long)(i0 + r) * hkv + h) * nz + z;
#pragma unroll
        for (int m = 0; m < M; ++m)
            if (on[m]) pacc[(w * group + g) * hd + lane + 32 * m] = acc[r][m];
        if (lane == 0) {
            pm[w * group + g] = mo[r];
            pl[w * group + g] = l[r];
        }
    }
    }  // partitions
}

ATTN_ENTRIES

// grid (n, Hq), block hd rounded up to 32: one q head's partitions 0..pos / part, ascending
extern "C" __global__ void paged_merge_NAME(
        const REAL* __restrict__ pm, const REAL* __restrict__ pl, const REAL* __restrict__ pacc,
        const int* __restrict__ meta, int n, REAL* __restrict__ out, int hkv, int hd,
        int group, int part, int nz) {
    const int G = group * hd, d = threadIdx.x;
    int i = blockIdx.x, h = blockIdx.y / group, g = blockIdx.y % group;
    if (d >= hd) return;
    int row = meta[i], parts = meta[2 * n + i] / part + 1;
    long long w0 = ((long long)i * hkv + h) * nz;
    long long qoff = ((long long)row * hkv * group + (long long)h * group + g) * hd;
    const REAL* m = pm + w0 * group + g;  // partition z's max: m[z * group]
    const REAL* l = pl + w0 * group + g;
    const REAL* a = pacc + w0 * G + g * hd + d;  // partition z's acc: a[z * G]
    REAL mx = m[0];
    for (int z = 1; z < parts; ++z) mx = max_t(mx, m[(long long)z * group]);
    REAL r = exp_neg(m[0] - mx);  // 1 exactly for a single partition
    REAL sl = l[0] * r, sa = a[0] * r;
    for (int z = 1; z < parts; ++z) {
        r = exp_neg(m[(long long)z * group] - mx);
        sl = sl + l[(long long)z * group] * r;
        sa = sa + a[(long long)z * G] * r;
    }
    out[qoff + d] = div_rn(sa, sl);
}
#undef VEC
"""

_STORE_FLOAT = "kpool[vec * hd + d] = k[src + d]; vpool[vec * hd + d] = v[src + d];"
_STORE_INT8 = ("quant32((float)k[src + d], kpool + vec * hd, kscale + vec * (hd / 32), d);\n"
               "    quant32((float)v[src + d], vpool + vec * hd, vscale + vec * (hd / 32), d);")
_LOAD_FLOAT = "(REAL)P[I]"
_LOAD_INT8 = "(REAL)P[I] * (REAL)half_to_float(S[SI])"
# name, REAL, KT, int8
_VARIANTS = (("f32", "float", "float", False), ("f64", "double", "double", False),
             ("f32_i8", "float", "signed char", True), ("f64_i8", "double", "signed char", True))


_ENTRY = """
extern "C" __global__ void BOUNDSpaged_attn_NAME_mM_FULL_SUFFIX_(
        const REAL* __restrict__ q, const KT* __restrict__ kpool, const KT* __restrict__ vpool,
        const unsigned short* __restrict__ kscale, const unsigned short* __restrict__ vscale,
        const int* __restrict__ tables, int width, const int* __restrict__ meta, int n,
        REAL* __restrict__ pm, REAL* __restrict__ pl, REAL* __restrict__ pacc, int layer,
        int nblocks, int bsize, int hkv, int hd, int group, int part, int nz, REAL scale) {
    attn_NAME<M_, FULL_, ROWSPERWARP>(q, kpool, vpool, kscale, vscale, tables, width, meta,
                                      n, pm, pl, pacc, layer, nblocks, bsize, hkv, hd, group,
                                      part, nz, scale);
}
"""


def _neg_inf(real: str):
    return (np.float32 if real == "float" else np.float64)(-np.inf)


def source(min_blocks: int = 1, rows: int = 1, variant: str | None = None) -> str:
    """The module's CUDA source; ``min_blocks``: the attention kernels' blocks per SM that
    ptxas must fit (above 1, ``__launch_bounds__``: 2 caps a thread at 128 registers; 1 gives
    none, which ptxas compiles to 142 registers at head dim 256 against 215 with bounds of
    (256, 1)); ``rows``: rows per warp of its attention kernels (:func:`attn_kernel`'s
    names); ``variant``: that variant's kernels alone (a quicker compile). Speed only."""
    bounds = (f"__launch_bounds__({32 * MAX_WARPS}, {int(min_blocks)}) " if min_blocks > 1
              else "")
    parts = [_HEADER, _exp_source("float", np.float32),
             _exp_source("double", np.float64)]
    for name, real, kt, int8 in _VARIANTS:
        if variant not in (None, name):
            continue
        load = (_LOAD_INT8 if int8 else _LOAD_FLOAT).replace("REAL", real)
        parts.append(
            f"#define LOAD(P, S, I, SI) ({load})\n#define NEG_INF {_literal(_neg_inf(real))}\n"
            + _KERNELS.replace("ATTN_ENTRIES", "".join(
                _ENTRY.replace("BOUNDS", bounds)
                .replace("SUFFIX_", f"_r{rows}" if rows > 1 else "")
                .replace("ROWSPERWARP", str(int(rows)))
                .replace("M_FULL_", f"{m}{'f' if full else ''}")
                .replace("M_, FULL_", f"{m}, {'true' if full else 'false'}")
                for m, full in _ATTN_SHAPES))
            .replace("STORE", _STORE_INT8 if int8 else _STORE_FLOAT)
            .replace("NAME", name).replace("REAL", real).replace("KT", kt)
            .replace("CHUNK", str(CHUNK)).replace("GK", str(KEY_GROUP))
            + "#undef LOAD\n#undef NEG_INF\n")
    return "".join(parts)
