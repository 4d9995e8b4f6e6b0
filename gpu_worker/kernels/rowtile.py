"""Weight-stationary, batch-invariant matrix product on CuPy: ``x [R, K] @ w[N, K].T``.

Every dense projection of the model (attention, Gated DeltaNet, shared expert, router,
lm_head) goes through :func:`linear_rows` on CuPy (``Ops.linear``). One block reads a tile of
``WARPS * nw`` weight rows once, as 16-byte loads, and applies it to a tile of up to 16 rows
of ``x`` staged in shared memory; more rows launch more row tiles, each computing its rows
exactly as it would alone. Decode and verify steps (1-16 rows) are thus one pass over the
weights, bandwidth-bound, and a row's bits never depend on its batch:

**The summation order** (``gpu_worker/kernels/rowtile_ref.py`` is its NumPy formula). K is
cut into chunks of 8 elements; chunk ``c`` belongs to lane ``c % 32`` of a warp. A lane
accumulates its chunks in ascending order, elements ascending, one correctly rounded float32
fused multiply-add each (``acc = fma(w, x, acc)``, from +0; K padded with zeros to a multiple
of 256), then the 32 lane sums fold as a butterfly ``s[l] + s[l ^ o]`` for o = 16, 8, 4, 2, 1
(commutative adds: every lane ends with the same bits), then ``+ bias``. The order depends on
K alone: not on R, the tile's size, the row's position or the other rows, nor on ``nw`` or
whether a load was vectorised. bf16 weights (uint16 bits) are widened exactly in registers,
so float32 weights holding the same values give the same bits.

FMA rather than a multiply then an add: at 16 rows the kernel runs 16 float32 operations per
weight, and the H200's float32 units would cap a mul+add kernel near half the HBM rate.

**IEEE float32, subnormals kept.** CuPy appends ``-ftz=true`` to every compile, after the
caller's options (so ``--ftz=false`` cannot win), and ``__fmaf_rn`` or ``+`` then become their
flushing forms: a subnormal weight, activation or partial sum turns into 0. That changed the
last bits of some outputs next to subnormal weights (the device run of issue 14). So the FMA
and the adds are written as PTX ``fma.rn.f32`` / ``add.rn.f32``, which no compile flag alters;
on sm_90 they run at full speed with subnormals.
"""

from __future__ import annotations

import functools

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.bf16 import BITS

WARPS = 8  # warps per block
TILES = (1, 2, 4, 8, 12, 16)  # row-tile sizes compiled; R > 16 uses tiles of 16
MIN_BLOCKS = 1  # __launch_bounds__' blocks per SM (more forces spills at 8-16 rows)
DEFAULT_SHARED = 48 * 1024  # bytes of shared memory a launch gets without opting in


def smem_floats(rt: int) -> int:
    """Floats of x staged per block (``8 * RT * SC``): 32 KiB up to 4 rows, 96 KiB for 8-16
    (a 16-row tile then stages 1,536 of K per slice instead of 512: fewer slices, each a
    barrier and a round of loads; two blocks still fit an SM). Speed only: slices never
    change the order of a lane's sums."""
    return 8 * 1024 if rt <= 4 else 24 * 1024

_SOURCE = r"""
// RT rows per tile, stored in shared memory as V-float vectors (V = min(RT, 4), RQ = RT / V):
// x[r][k = 8 c + e] of the current slice at xs[((e * RQ + r / V) * SC + c) * V + r % V], so a
// warp's 32 lanes (chunks c = lane + 32 j) read 32 consecutive vectors (no bank conflicts).
#define RT __RT__
#define V __V__
#define RQ (RT / V)
#define SC __SC__
#define NW __NW__
#define PF __PF__  // weight chunks per row in flight + 1
#define WARPS __WARPS__
#define VEC __VEC__  // 16-byte loads: K % 8 == 0 and x, w 16-byte aligned
#define SB 2  // x items a thread loads before storing them (staging)
typedef __VT__ VT;

// IEEE float32 whatever the compile flags: CuPy appends -ftz=true to every compile (after the
// caller's options, so --ftz=false cannot win), which turns __fmaf_rn and + into their .ftz
// forms: subnormal inputs and results become 0. Written in PTX, fma.rn.f32 and add.rn.f32 keep
// subnormals (full speed on sm_90) and are never contracted or reassociated. A host build (the
// CPU emulation in tests/unit/test_rowtile_reference.py) takes the C library's exact fmaf.
__device__ __forceinline__ float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
    float d;
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
    return d;
#else
    return fmaf(a, b, c);
#endif
}
__device__ __forceinline__ float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    float d;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
#else
    return a + b;
#endif
}

#if __BF16__
typedef unsigned short WT;
struct Chunk { uint4 u; };  // 8 bf16: element e in word e / 2, low half first
__device__ __forceinline__ float elem(const Chunk& c, int e) {
    unsigned int w = (e >> 1) == 0 ? c.u.x : (e >> 1) == 1 ? c.u.y : (e >> 1) == 2 ? c.u.z : c.u.w;
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ Chunk load_chunk(const WT* row, long long k0, long long K) {
    Chunk c;
    if (VEC) {  // K % 8 == 0, rows 16-byte aligned: a chunk is all in or all out
        c.u = k0 < K ? __ldg(reinterpret_cast<const uint4*>(row + k0)) : make_uint4(0, 0, 0, 0);
    } else {
        unsigned int h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] = k0 + i < K ? (unsigned int)row[k0 + i] : 0u;
        c.u = make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16),
                         h[6] | (h[7] << 16));
    }
    return c;
}
#else
typedef float WT;
struct Chunk { float4 a, b; };
__device__ __forceinline__ float elem(const Chunk& c, int e) {
    const float4& h = e < 4 ? c.a : c.b;
    int i = e & 3;
    return i == 0 ? h.x : i == 1 ? h.y : i == 2 ? h.z : h.w;
}
__device__ __forceinline__ Chunk load_chunk(const WT* row, long long k0, long long K) {
    Chunk c;
    if (VEC) {
        const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        c.a = k0 < K ? __ldg(reinterpret_cast<const float4*>(row + k0)) : z;
        c.b = k0 < K ? __ldg(reinterpret_cast<const float4*>(row + k0 + 4)) : z;
    } else {
        float h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] = k0 + i < K ? row[k0 + i] : 0.0f;
        c.a = make_float4(h[0], h[1], h[2], h[3]);
        c.b = make_float4(h[4], h[5], h[6], h[7]);
    }
    return c;
}
#endif

// grid (ceil(R / RT), ceil(N / (WARPS * NW))), block WARPS * 32
extern "C" __global__ void __launch_bounds__(WARPS * 32, __MINB__) __NAME__(
        const float* __restrict__ x, const WT* __restrict__ w, const float* __restrict__ bias,
        float* __restrict__ out, float* __restrict__ out1, float* __restrict__ out2,
        float* __restrict__ out3, int R, int N, int K, int has_bias, int s1, int s2, int s3) {
    // outputs n < s1 go to out [R, s1], s1 <= n < s2 to out1 [R, s2 - s1], s2 <= n < s3 to
    // out2 and n >= s3 to out3 (a plain product: s1 = s2 = s3 = N)
#ifdef __CUDACC__  // dynamic: over 48 KiB for 8-16 rows (opted in by the launch)
    extern __shared__ __align__(16) float xs[];
#else  // the CPU emulations: one block at a time, a static array
    __shared__ __align__(16) float xs[8 * RT * SC];
#endif
    const int lane = threadIdx.x & 31;
    const int r0 = blockIdx.x * RT;
    const long long n0 = ((long long)blockIdx.y * WARPS + (threadIdx.x >> 5)) * NW;
    const int JT = (K + 255) / 256;  // chunks per lane, K padded to a multiple of 256
    const int JS = SC / 32;          // chunks per lane per staged slice
    const WT* wrow[NW];
#pragma unroll
    for (int n = 0; n < NW; ++n) wrow[n] = w + (n0 + n < N ? (n0 + n) * (long long)K : 0);
    float acc[NW][RT];
#pragma unroll
    for (int n = 0; n < NW; ++n)
#pragma unroll
        for (int r = 0; r < RT; ++r) acc[n][r] = 0.0f;
    // PF chunks per weight row in a register ring: PF - 1 loads in flight while one computes
    Chunk buf[PF][NW];
#pragma unroll
    for (int p = 0; p < PF - 1; ++p)
#pragma unroll
        for (int n = 0; n < NW; ++n)
            buf[p][n] = load_chunk(wrow[n], ((long long)p * 32 + lane) * 8,
                                   p < JT && n0 + n < N ? K : 0);
    for (int j0 = 0; j0 < JT; j0 += PF) {
#pragma unroll
        for (int p = 0; p < PF; ++p) {
            const int j = j0 + p;  // this lane's chunk j: elements 8 (32 j + lane) + 0..7
            if (j >= JT) break;    // uniform over the block
            if (j % JS == 0) {  // stage chunks [32 j, 32 j + nc) of the tile's rows (0 past K, R)
                const int cs = j * 32, nc = min(SC, JT * 32 - cs);
                __syncthreads();
                // SB items per thread at a time: their loads are issued before any store
                for (int it0 = threadIdx.x; it0 < RT * nc; it0 += WARPS * 32 * SB) {
                    float v[SB][8];
#pragma unroll
                    for (int b = 0; b < SB; ++b) {
                        const int it = it0 + b * WARPS * 32;
                        const int ri = it % V, c = (it / V) % nc, q = it / (V * nc);
                        const int r = r0 + q * V + ri;
                        const long long k0 = (long long)(cs + c) * 8;
                        const bool in = it < RT * nc && r < R;
                        // NOTE: loads unconditional, at an index clamped into x (the value
                        // then replaced by 0), so a batch's loads are issued together
                        const float* xr = x + (long long)min(r, R - 1) * K;
                        if (VEC) {  // K % 8 == 0: k0 < K means the whole chunk is in
                            const long long kc = min(k0, (long long)K - 8);
                            float4 a = *reinterpret_cast<const float4*>(xr + kc);
                            float4 h = *reinterpret_cast<const float4*>(xr + kc + 4);
                            const bool on = in && k0 < K;
                            v[b][0] = on ? a.x : 0.0f; v[b][1] = on ? a.y : 0.0f;
                            v[b][2] = on ? a.z : 0.0f; v[b][3] = on ? a.w : 0.0f;
                            v[b][4] = on ? h.x : 0.0f; v[b][5] = on ? h.y : 0.0f;
                            v[b][6] = on ? h.z : 0.0f; v[b][7] = on ? h.w : 0.0f;
                        } else {
#pragma unroll
                            for (int e = 0; e < 8; ++e) {
                                const float xe = xr[min(k0 + e, (long long)K - 1)];
                                v[b][e] = in && k0 + e < K ? xe : 0.0f;
                            }
                        }
                    }
#pragma unroll
                    for (int b = 0; b < SB; ++b) {
                        const int it = it0 + b * WARPS * 32;
                        if (it >= RT * nc) break;
                        const int ri = it % V, c = (it / V) % nc, q = it / (V * nc);
#pragma unroll
                        for (int e = 0; e < 8; ++e) xs[((e * RQ + q) * SC + c) * V + ri] = v[b][e];
                    }
                }
                __syncthreads();
            }
            const int jn = j + PF - 1;  // into the slot chunk j - 1 used
#pragma unroll
            for (int n = 0; n < NW; ++n)
                buf[(p + PF - 1) % PF][n] = load_chunk(wrow[n], ((long long)jn * 32 + lane) * 8,
                                                       jn < JT && n0 + n < N ? K : 0);
            const int cl = (j % JS) * 32 + lane;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float wf[NW];
#pragma unroll
                for (int n = 0; n < NW; ++n) wf[n] = elem(buf[p][n], e);
#pragma unroll
                for (int q = 0; q < RQ; ++q) {
                    const VT xv = reinterpret_cast<const VT*>(xs)[(e * RQ + q) * SC + cl];
                    const float* xf = reinterpret_cast<const float*>(&xv);
#pragma unroll
                    for (int i = 0; i < V; ++i)
#pragma unroll
                        for (int n = 0; n < NW; ++n)
                            acc[n][q * V + i] = fma_rn(wf[n], xf[i], acc[n][q * V + i]);
                }
            }
        }
    }
    // butterfly over the lanes: s[l] + s[l ^ o]; every lane ends with the same bits
#pragma unroll
    for (int n = 0; n < NW; ++n)
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            float s = acc[n][r];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s = add_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
            acc[n][r] = s;
        }
#pragma unroll
    for (int n = 0; n < NW; ++n)
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            if (lane == (n * RT + r) % 32 && n0 + n < N && r0 + r < R) {
                float s = acc[n][r];
                if (has_bias) s = add_rn(s, bias[n0 + n]);
                const int m = (int)(n0 + n);
                float* o = m < s1 ? out : m < s2 ? out1 : m < s3 ? out2 : out3;
                const int start = m < s1 ? 0 : m < s2 ? s1 : m < s3 ? s2 : s3;
                const int len = (m < s1 ? s1 : m < s2 ? s2 : m < s3 ? s3 : N) - start;
                o[(long long)(r0 + r) * len + m - start] = s;
            }
        }
}
"""


def tile_rows(rows: int, n: int | None = None) -> int:
    """The row-tile size for ``rows`` rows of a product with ``n`` outputs: up to 4 rows the
    smallest of :data:`TILES` that holds them; above, tiles of 4 rows where the matrix is
    narrow (a grid of few blocks: N <= 1024, or N <= 2048 at up to 8 rows) and of 8 rows
    otherwise (each tile reads the weights again, from L2 when the tiles of a weight tile run
    together). Measured on the H200 (docs/bench/linear_graph_h200.json): 16 rows of N 512
    take 5.6 us as 4 tiles of 4 against 22 us as one of 16; of N 8192, 35 us as 2 tiles of 8
    against 44 us. ``n`` None: the smallest tile that holds the rows (16 above 16). A speed
    choice only: a row's bits do not depend on it."""
    if rows <= 4 or n is None:
        return next((t for t in TILES if t >= rows), TILES[-1])
    return 4 if n <= 1024 or (n <= 2048 and rows <= 8) else 8


def speed_knobs(rt: int, bf16: bool) -> tuple[int, int]:
    """(weight rows per warp ``nw``, register ring depth ``pf``) for row tiles of ``rt``:
    registers without spills (ptxas, sm_90) and loads in flight; bits never depend on them."""
    if not bf16:
        return 2, 4
    return (2, 4) if rt <= 4 else (4, 2)  # 8-16 rows: x reused over 4 weight rows


def kernel_source(rt: int, bf16: bool, nw: int, pf: int, vec: bool) -> tuple[str, str]:
    """(CUDA source, kernel name) of the variant for row tiles of ``rt`` rows, ``nw`` weight
    rows per warp, ``pf`` chunks per row in registers, 16-byte loads (``vec``: K % 8 == 0, x
    and w 16-byte aligned) or element loads."""
    if rt not in TILES or nw < 1 or pf < 2:
        raise ValueError(f"row tile {rt} (one of {TILES}), nw {nw}, pf {pf} (>= 2)")
    v = min(rt, 4)
    sc = _slice_chunks(rt)
    name = f"rowtile_{'bf16' if bf16 else 'f32'}_r{rt}_w{nw}_p{pf}_{'v' if vec else 's'}"
    subs = {"__RT__": rt, "__V__": v, "__SC__": sc, "__NW__": nw, "__PF__": pf,
            "__WARPS__": WARPS, "__VT__": {1: "float", 2: "float2", 4: "float4"}[v],
            "__BF16__": int(bf16), "__VEC__": int(vec), "__MINB__": MIN_BLOCKS,
            "__NAME__": name}
    src = _SOURCE
    for key, val in subs.items():
        src = src.replace(key, str(val))
    return src, name


def _slice_chunks(rt: int) -> int:
    """Chunks of 8 elements of K staged per slice (SC): a multiple of the 32 lanes."""
    return smem_floats(rt) // (8 * rt) // 32 * 32


def shared_bytes(rt: int) -> int:
    """Dynamic shared memory of a launch with row tiles of ``rt`` rows."""
    return 8 * rt * _slice_chunks(rt) * 4


@functools.cache
def _function(*variant):
    """The kernel of ``variant`` (:func:`kernel_source`'s arguments), opted in to its shared
    memory where that is over the default 48 KiB."""
    src, name = kernel_source(*variant)
    fn = raw_module(src, "row-tile matrix kernels").get_function(name)
    if shared_bytes(variant[0]) > DEFAULT_SHARED:
        fn.max_dynamic_shared_size_bytes = shared_bytes(variant[0])
    return fn


def linear_rows(x, w, bias=None, *, nw: int | None = None, pf: int | None = None,
                rt: int | None = None):
    """``x [R, K] @ w[N, K].T (+ bias [N])`` -> a new float32 CuPy array ``[R, N]``, in the
    order of the module docstring: ``x`` float32, ``w`` float32 or bf16 bits (uint16),
    ``bias`` float32 or None; ``nw``, ``pf``, ``rt`` (rows per tile, one of :data:`TILES`):
    speed knobs (None: :func:`speed_knobs`, :func:`tile_rows`; the bits do not depend on
    them). One launch (none when R or N is 0); never waits."""
    return _linear(x, w, bias, None, nw, pf, rt)[0]


def linear_rows_split(x, w, sizes: tuple[int, ...], *, nw: int | None = None,
                      pf: int | None = None, rt: int | None = None) -> tuple:
    """:func:`linear_rows` of a stack of up to :data:`MAX_SPLITS` matrices ``w [sum(sizes),
    K]`` (e.g. a layer's router and shared-expert projections, which read the same ``x``) in
    one launch, each part's outputs in its own contiguous ``[R, size]`` array: the bits of
    one :func:`linear_rows` per part (an output's order depends on K alone)."""
    return _linear(x, w, None, tuple(sizes), nw, pf, rt)


MAX_SPLITS = 4


def _linear(x, w, bias, sizes, nw, pf, rt) -> tuple:
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_rows: x {x.shape} and w {w.shape} do not fit")
    if x.dtype != np.float32 or w.dtype not in (BITS, np.dtype(np.float32)):
        raise TypeError(f"linear_rows: float32 x and float32 or bf16-bit w, not {x.dtype}, "
                        f"{w.dtype}")
    R, K = x.shape
    N = w.shape[0]
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"linear_rows: bias {bias.shape} for {N} outputs")
    sizes = (N,) if sizes is None else sizes
    if not 1 <= len(sizes) <= MAX_SPLITS or sum(sizes) != N or min(sizes) < 1:
        raise ValueError(f"linear_rows: parts {sizes} of {N} outputs (1-{MAX_SPLITS}, each >= 1)")
    outs = tuple(cp.empty((R, n), np.float32) for n in sizes)
    if R == 0 or N == 0:
        return outs
    if K == 0:
        for o in outs:
            o[...] = 0
        if bias is not None:
            outs[0][...] = bias
        return outs
    if rt is not None and rt not in TILES:
        raise ValueError(f"linear_rows: row tile {rt} is not one of {TILES}")
    rt = rt or tile_rows(R, N)
    bf16 = w.dtype == BITS
    nw0, pf0 = speed_knobs(rt, bf16)
    nw, pf = nw or nw0, pf or pf0
    blocks_n = -(-N // (WARPS * nw))
    if blocks_n > 65535 or K >= 2 ** 31 // 8:
        raise ValueError(f"linear_rows: N {N} / K {K} too large for one grid")
    x = cp.ascontiguousarray(x)
    w = cp.ascontiguousarray(w)
    vec = K % 8 == 0 and x.data.ptr % 16 == 0 and w.data.ptr % 16 == 0
    b = outs[0] if bias is None else cp.ascontiguousarray(bias, dtype=np.float32)
    starts = [int(v) for v in np.cumsum(sizes)[:-1]] + [N] * (MAX_SPLITS - len(sizes))
    ptrs = outs + (outs[-1],) * (MAX_SPLITS - len(sizes))
    _function(rt, bf16, nw, pf, vec)(
        (-(-R // rt), blocks_n), (WARPS * 32,),
        (x, w, b, *ptrs, np.int32(R), np.int32(N), np.int32(K), np.int32(bias is not None),
         *(np.int32(v) for v in starts)),
        shared_mem=shared_bytes(rt))
    return outs
