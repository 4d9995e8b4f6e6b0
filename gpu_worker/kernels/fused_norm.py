"""Fused, batch-invariant RMSNorm on CuPy float32: one launch per call.

``Ops.rms_norm`` on CuPy float32 (switch ``fused_norm``, gpu_worker/kernels/enabled.py) was
five elementwise launches and a reduction whose order CuPy picks; :func:`rms_norm_rows` is one
launch (:func:`add_rms_norm_rows` also adds the residual first). A row is the last axis of
``x`` ([R, H] or [R, heads, hd]: then every (r, head) is a row of ``hd``).

**The order** (:func:`rms_norm_reference` is its NumPy formula, bit for bit). The row is cut in
W segments of S elements (:func:`wide_split`, from H alone: one segment up to H = 256, then up
to 8 of at most 32 x 32 elements; one segment again past 8192), one warp each. In a segment,
lane ``l`` (0..31) starts from +0 and adds ``x[k] * x[k]`` (each product rounded to float32)
for ``k = start + l, start + l + 32, ...`` ascending; the 32 lane sums fold as a butterfly
``s[l] + s[l ^ o]`` for o = 16, 8, 4, 2, 1 (commutative adds: every lane ends with the same
bits, those of the tree ``s[l] + s[l + o]`` of the reference). The segments' sums are added in
order, ``((p_0 + p_1) + p_2) + ...``. Then ``d = sqrt(s / H + eps)`` and ``out[k] = (x[k] / d)
* w[k]`` (``* (1 + w[k])`` zero-centered, the sum rounded first), every operation one
correctly rounded float32 step. The order depends on H alone: never on the number of rows, a
row's position or its neighbours. A lane holds its elements (and w's) in registers, every load
issued before any use; past 8192 a lane takes ``BATCH`` at a time. A row of 2048 was one warp
(6 us on the H200, one lane summing 64 squares in a chain); it is now 8 warps of 256. The
one-warp row is one device function, ``norm_row_warp`` (:func:`helpers_source`), which
qk_norm_rope.py's kernel calls too: attention's q/k norms keep these bits there.

**IEEE float32, subnormals kept.** CuPy compiles with ``-ftz=true`` (docs/gpu_step.md), which
turns ``+ * / sqrtf`` into flushing forms; so every operation is PTX ``add/mul/div/sqrt.rn.f32``
without ``.ftz`` (as in rowtile.py), which no compile flag alters, and NumPy's float32
arithmetic is the reference.

**Gated** (:func:`gated_rms_norm_rows`, Gated DeltaNet's output norm per value head, rows of
up to 256): ``silu(z[k]) * out[k]``, ``out[k]`` the value above still in a register, by
fused_silu.py's code (its IEEE struct ``F``, its order, its -ftz argument): the bits of
:func:`rms_norm_rows` then ``fused_silu.silu_mul(z, .)``, in one launch instead of two.
"""

from __future__ import annotations

import functools

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.fused_silu import helpers_source as silu_source

WARPS = 4  # rows (warps) per block of 128 threads
LANES = 32
BATCH = 16  # elements a lane loads before using them (loads in flight per lane)

# the float32 operations, a warp's segment (load, sum of squares; write) and a warp's row:
# rms_norm_rows and qk_norm_rope.py's kernel share them, so a row's norm has one source
_HELPERS = r"""
// IEEE float32 whatever CuPy's -ftz=true: PTX .rn without .ftz keeps subnormals
__device__ __forceinline__ float add_rn(float a, float b) {
    float d; asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float mul_rn(float a, float b) {
    float d; asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float div_rn(float a, float b) {
    float d; asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b)); return d; }
__device__ __forceinline__ float sqrt_rn(float a) {
    float d; asm("sqrt.rn.f32 %0, %1;" : "=f"(d) : "f"(a)); return d; }

// NOTE: every load is unconditional (an element past H reads element H - 1, then counts as
// +0), so the compiler issues a batch's loads together; a load under a condition is a branch,
// and loads behind branches were issued one at a time (the H200: 5.7 us for a row of 2048).

// A warp's segment [k0, k1) of a row of H in registers, REGS per lane (lane l holds
// k = k0 + l + 32 i): x loaded (plus r where rr is given: the sum stored in sr), every load
// issued before any use; values past k1 become +0 (s + 0 * 0 is s, s >= +0 or NaN). Returns
// the warp's sum of squares: the lane sums ascending from +0, then the butterfly.
template <int REGS>
__device__ __forceinline__ float load_segment(
        const float* __restrict__ xr, const float* __restrict__ rr, float* __restrict__ sr,
        int H, int k0, int k1, int lane, float (&a)[REGS]) {
#pragma unroll
    for (int i = 0; i < REGS; ++i) a[i] = xr[min(k0 + lane + 32 * i, H - 1)];
    if (rr != nullptr) {  // x + r first (IEEE float32), stored, then normalised
        float q[REGS];
#pragma unroll
        for (int i = 0; i < REGS; ++i) q[i] = rr[min(k0 + lane + 32 * i, H - 1)];
#pragma unroll
        for (int i = 0; i < REGS; ++i) a[i] = add_rn(a[i], q[i]);
#pragma unroll
        for (int i = 0; i < REGS; ++i)
            if (k0 + lane + 32 * i < k1) sr[k0 + lane + 32 * i] = a[i];
    }
#pragma unroll
    for (int i = 0; i < REGS; ++i)
        if (k0 + lane + 32 * i >= k1) a[i] = 0.0f;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < REGS; ++i) s = add_rn(s, mul_rn(a[i], a[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = add_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    return s;
}

// The segment's outputs (x / d) * w (w + 1 zero-centered), w's loads issued together; with
// a gate row zr (else nullptr) silu(z) * that, in F arithmetic (fused_silu.py's silu_mul)
template <int REGS>
__device__ __forceinline__ void write_segment(
        const float (&a)[REGS], const float* __restrict__ w, const float* __restrict__ zr,
        float* __restrict__ orow, int H, int k0, int k1, int lane, float d, int zero_centered) {
    float q[REGS], g[REGS];
#pragma unroll
    for (int i = 0; i < REGS; ++i) q[i] = w[min(k0 + lane + 32 * i, H - 1)];
#pragma unroll
    for (int i = 0; i < REGS; ++i)
        g[i] = zr != nullptr ? zr[min(k0 + lane + 32 * i, H - 1)] : 0.0f;
#pragma unroll
    for (int i = 0; i < REGS; ++i) {
        const int k = k0 + lane + 32 * i;
        const float wk = zero_centered ? add_rn(1.0f, q[i]) : q[i];
        const float y = mul_rn(div_rn(a[i], d), wk);
        if (k < k1) orow[k] = zr != nullptr ? (silu(F(g[i])) * F(y)).v : y;
    }
}

// A row of H <= 256 by one warp, in registers (x + r first where rr is given, stored in sr):
// d = sqrt(s / H + eps) from the warp's sum of squares, then the outputs into orow (times
// silu(z) with a gate row zr, else nullptr)
__device__ __forceinline__ void norm_row_warp(
        const float* __restrict__ xr, const float* __restrict__ rr, float* __restrict__ sr,
        const float* __restrict__ w, const float* __restrict__ zr, float* __restrict__ orow,
        int H, int lane, float eps, int zero_centered) {
    float a[8];
    const float s = load_segment<8>(xr, rr, sr, H, 0, H, lane, a);
    const float d = sqrt_rn(add_rn(div_rn(s, (float)H), eps));
    write_segment<8>(a, w, zr, orow, H, 0, H, lane, d, zero_centered);
}
"""

_KERNELS = r"""
#define WARPS __WARPS__
#define BATCH __BATCH__
// grid ceil(rows / WARPS), block WARPS * 32; row i of x at x + i * stride (elements), its
// H elements contiguous; out is [rows, H] contiguous; w [H]. With add != 0 the row is
// x + r (r and sum [rows, H] contiguous), stored in sum, and that is normalised.
extern "C" __global__ void rms_norm_rows(
        const float* __restrict__ x, const float* __restrict__ r, float* __restrict__ sum,
        int add, const float* __restrict__ w, float* __restrict__ out, long long rows, int H,
        long long stride, float eps, int zero_centered) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;  // a whole warp: the shuffles below see all 32 lanes or none
    const float* xr = x + row * stride;
    const float* rr = add ? r + row * (long long)H : nullptr;
    float* sr = add ? sum + row * (long long)H : nullptr;
    float* orow = out + row * (long long)H;
    if (H <= 32 * 8) {  // the row in registers
        norm_row_warp(xr, rr, sr, w, nullptr, orow, H, lane, eps, zero_centered);
        return;
    }
    // a lane reads its elements k = k0 + lane + 32 i (i < BATCH) of a batch into registers
    // first, then uses them in the same ascending order as one element at a time
    float s = 0.0f;
    for (int k0 = 0; k0 < H; k0 += 32 * BATCH) {
        float v[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; ++i) v[i] = xr[min(k0 + lane + 32 * i, H - 1)];
        if (rr != nullptr) {
            float a[BATCH];
#pragma unroll
            for (int i = 0; i < BATCH; ++i) a[i] = rr[min(k0 + lane + 32 * i, H - 1)];
#pragma unroll
            for (int i = 0; i < BATCH; ++i) {
                const int k = k0 + lane + 32 * i;
                v[i] = add_rn(v[i], a[i]);
                if (k < H) sr[k] = v[i];
            }
        }
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            if (k0 + lane + 32 * i >= H) v[i] = 0.0f;
            s = add_rn(s, mul_rn(v[i], v[i]));
        }
    }
    const float* xs = rr == nullptr ? xr : sr;  // the lane reads back only what it stored
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = add_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    const float d = sqrt_rn(add_rn(div_rn(s, (float)H), eps));
    for (int k0 = 0; k0 < H; k0 += 32 * BATCH) {
        float v[BATCH], wv[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const int kc = min(k0 + lane + 32 * i, H - 1);
            v[i] = xs[kc];
            wv[i] = w[kc];
        }
#pragma unroll
        for (int i = 0; i < BATCH; ++i) {
            const int k = k0 + lane + 32 * i;
            const float wk = zero_centered ? add_rn(1.0f, wv[i]) : wv[i];
            if (k < H) orow[k] = mul_rn(div_rn(v[i], d), wk);
        }
    }
}

// A row of 256 < H <= 32 * 32 * MAX_WIDE_WARPS by one block of W warps (W, S: wide_split):
// warp v takes the segment k in [v S, min(H, (v + 1) S)), its lanes sum their squares as one
// warp does a row (lane l: k = v S + l + 32 i ascending, from +0; butterfly), then the W warp
// sums are added in order, s = ((p_0 + p_1) + p_2) + ..., by every thread from shared memory.
template <int REGS>
__device__ __forceinline__ void norm_wide(
        const float* __restrict__ x, const float* __restrict__ r, float* __restrict__ sum,
        int add, const float* __restrict__ w, float* __restrict__ out, int H, long long stride,
        float eps, int zero_centered, int W, int S) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, v = threadIdx.x >> 5;
    const long long row = blockIdx.x;
    const int k0 = v * S, k1 = min(H, k0 + S);
    float a[REGS];
    const float s = load_segment<REGS>(x + row * stride, add ? r + row * (long long)H : nullptr,
                                       add ? sum + row * (long long)H : nullptr, H, k0, k1,
                                       lane, a);
    if (lane == 0) part[v] = s;
    __syncthreads();
    float t = part[0];
    for (int u = 1; u < W; ++u) t = add_rn(t, part[u]);
    const float d = sqrt_rn(add_rn(div_rn(t, (float)H), eps));
    write_segment<REGS>(a, w, nullptr, out + row * (long long)H, H, k0, k1, lane, d,
                        zero_centered);
}

// grid ceil(rows / WARPS), block WARPS * 32, H <= 256: rms_norm_rows' one-warp path (add 0),
// then out = silu(z) * normed; z and out [rows, H] contiguous, x's rows at stride
extern "C" __global__ void gated_rms_norm_rows(
        const float* __restrict__ x, const float* __restrict__ z, const float* __restrict__ w,
        float* __restrict__ out, long long rows, int H, long long stride, float eps,
        int zero_centered) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;  // a whole warp, as rms_norm_rows
    norm_row_warp(x + row * stride, nullptr, nullptr, w, z + row * (long long)H,
                  out + row * (long long)H, H, lane, eps, zero_centered);
}

// grid rows, block W * 32: one row per block (norm_wide); REGS >= S / 32
extern "C" __global__ void rms_norm_wide8(
        const float* __restrict__ x, const float* __restrict__ r, float* __restrict__ sum,
        int add, const float* __restrict__ w, float* __restrict__ out, int H, long long stride,
        float eps, int zero_centered, int W, int S) {
    norm_wide<8>(x, r, sum, add, w, out, H, stride, eps, zero_centered, W, S);
}
extern "C" __global__ void rms_norm_wide32(
        const float* __restrict__ x, const float* __restrict__ r, float* __restrict__ sum,
        int add, const float* __restrict__ w, float* __restrict__ out, int H, long long stride,
        float eps, int zero_centered, int W, int S) {
    norm_wide<32>(x, r, sum, add, w, out, H, stride, eps, zero_centered, W, S);
}
"""


def helpers_source() -> str:
    """The CUDA of the float32 operations (``add_rn``, ``mul_rn``, ``div_rn``, ``sqrt_rn``),
    a warp's row segment (``load_segment``, ``write_segment``) and ``norm_row_warp``, the
    one-warp path of :func:`rms_norm_rows` (rows of <= 256): a kernel that calls it gets
    that path's bits (gpu_worker/kernels/qk_norm_rope.py). After fused_silu's helpers (the
    struct ``F``, ``silu``: the gated kernel's), which it includes."""
    return silu_source() + _HELPERS


@functools.cache
def _function(name: str = "rms_norm_rows"):
    src = helpers_source() + _KERNELS.replace("__WARPS__", str(WARPS)).replace("__BATCH__",
                                                                                str(BATCH))
    return raw_module(src, "fused RMSNorm kernel").get_function(name)


MAX_WIDE_WARPS = 8  # warps of a wide row's block
ONE_WARP_MAX = 256  # rows up to this long take one warp (q/k norms: a head; GDN's norm)


def wide_split(H: int) -> tuple[int, int] | None:
    """(W warps, S elements per warp's segment) of a row of ``H``; None where one warp takes
    the row (H <= 256, or H > 8 x 32 x 32 = 8192: the batched loop). Part of the order."""
    if H <= ONE_WARP_MAX or H > MAX_WIDE_WARPS * 32 * 32:
        return None
    W = min(MAX_WIDE_WARPS, -(-H // ONE_WARP_MAX))
    return W, 32 * -(-H // (32 * W))


def row_stride(x) -> int | None:
    """The element stride between consecutive rows of ``x`` (rows: every index of the leading
    axes, in C order) when its last axis is contiguous and the leading axes collapse to one
    stride (e.g. a slice ``q[..., :hd]`` of [R, heads, 2 hd]); None otherwise."""
    item = x.itemsize
    if x.strides[-1] != item or any(s % item for s in x.strides):
        return None
    lead = [(n, s // item) for n, s in zip(x.shape[:-1], x.strides[:-1], strict=True) if n != 1]
    if not lead:
        return x.shape[-1]
    for (_, outer), (n, inner) in zip(lead, lead[1:], strict=False):
        if outer != inner * n:
            return None
    return lead[-1][1]


def rms_norm_rows(x, w, eps: float, *, zero_centered: bool):
    """RMSNorm of ``x [..., H]`` float32 (CuPy) over its last axis with ``w [H]`` float32 ->
    a new float32 array of ``x``'s shape, in the order of the module docstring. One launch
    (a copy first only when ``x``'s rows do not sit at one stride); never waits."""
    return _launch(x, None, w, eps, zero_centered)[1]


def add_rms_norm_rows(x, r, w, eps: float, *, zero_centered: bool):
    """``s = x + r`` (float32, IEEE) and the RMSNorm of ``s`` as :func:`rms_norm_rows`, in one
    launch -> ``(s, norm(s))``, new arrays of ``x``'s shape (``r``: the same shape)."""
    return _launch(x, r, w, eps, zero_centered)


def gated_rms_norm_rows(x, z, w, eps: float, *, zero_centered: bool):
    """``silu(z) * rms_norm(x)`` of float32 CuPy ``x [..., H]`` (H <= ONE_WARP_MAX) and ``z``
    of its shape, ``w [H]`` -> a new float32 array of that shape: the bits of
    :func:`rms_norm_rows`, then ``fused_silu.silu_mul(z, .)``, in one launch (a copy first
    only for a ``z`` not contiguous or an ``x`` whose rows do not sit at one stride)."""
    return _launch(x, None, w, eps, zero_centered, z)[1]


def _launch(x, r, w, eps: float, zero_centered: bool, z=None):
    """(sum or None, out) of the three entry points: ``r`` the residual (add), ``z`` the gate
    (gated_rms_norm_rows: rows of at most ONE_WARP_MAX, no residual)."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    name = "rms_norm_rows" if z is None else "gated_rms_norm_rows"
    if any(a is not None and a.dtype != np.float32 for a in (x, w, r, z)):
        raise TypeError(f"{name}: float32 x, r, z and w, not {x.dtype}, "
                        f"{None if r is None else r.dtype}, {None if z is None else z.dtype}, "
                        f"{w.dtype}")
    H = x.shape[-1] if x.ndim else 0
    if x.ndim < 1 or w.shape != (H,) or any(a is not None and a.shape != x.shape
                                             for a in (r, z)) \
            or (z is not None and H > ONE_WARP_MAX):
        raise ValueError(f"{name}: x {x.shape}, r {None if r is None else r.shape}, z "
                         f"{None if z is None else z.shape} and w {w.shape} do not fit (gated: "
                         f"rows of at most {ONE_WARP_MAX})")
    out = cp.empty(x.shape, np.float32)
    total = None if r is None else cp.empty(x.shape, np.float32)
    rows = x.size // H if H else 0
    if rows == 0:
        return total, out
    stride = row_stride(x)
    if stride is None:
        x = cp.ascontiguousarray(x)
        stride = H
    w = cp.ascontiguousarray(w)
    if z is not None:
        _function(name)((-(-rows // WARPS),), (WARPS * LANES,),
                        (x, cp.ascontiguousarray(z), w, out, np.int64(rows), np.int32(H),
                         np.int64(stride), np.float32(eps), np.int32(bool(zero_centered))))
        return total, out
    add = r is not None  # else x and out stand in for the unused r and sum
    r = cp.ascontiguousarray(r) if add else x
    split = wide_split(H)
    if split is None:
        _function()((-(-rows // WARPS),), (WARPS * LANES,),
                    (x, r, total if add else out, np.int32(add), w, out, np.int64(rows),
                     np.int32(H), np.int64(stride), np.float32(eps),
                     np.int32(bool(zero_centered))))
    else:
        W, S = split
        _function("rms_norm_wide8" if S <= 8 * 32 else "rms_norm_wide32")(
            (rows,), (W * LANES,),
            (x, r, total if add else out, np.int32(add), w, out, np.int32(H),
             np.int64(stride), np.float32(eps), np.int32(bool(zero_centered)), np.int32(W),
             np.int32(S)))
    return total, out
