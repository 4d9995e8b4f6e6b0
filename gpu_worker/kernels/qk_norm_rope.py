"""Attention's q/k RMSNorm and rotate-half RoPE in one launch (CuPy float32).

``full_attention`` normalised every q head and every k head by its own weight (two
``rms_norm_rows`` launches) and then rotated both (two ``rope`` launches): four small kernels
per attention layer, each a few microseconds of a latency-bound decode step, with q and k
written and read back twice. :func:`qk_norm_rope` is one launch for all of it
(``Ops.qk_norm_rope``, switches ``fused_norm`` and ``fused_rope`` both on).

**The bits are those of the four launches**, by construction: a warp takes one head row (q's
``R Hq`` rows first, then k's ``R Hkv``) and normalises it with ``norm_row_warp``, the very
device function of rms_norm_rows' one-warp path (fused_norm.py: lane sums of ``x[k] * x[k]``
over k = l (mod 32) ascending from +0, the xor butterfly 16..1, ``d = sqrt(s / hd + eps)``,
``(x[k] / d) * w[k]``, ``* (1 + w[k])`` zero-centered, each step one IEEE float32 rounding),
storing the head in the warp's shared memory instead of global memory. After a
``__syncwarp`` each lane rotates its elements k < rot with ``ROPE_ONE``, the rope kernel's
expression (fused_rope.py: ``y_k cos_k + r_k sin_k``, ``r_k = -y_{k + rot/2}`` below rot/2 by
a sign-bit flip, else ``y_{k - rot/2}``, both products and the sum rounded once, no fused
multiply-add), reading the partner from shared memory; dims from rot on pass through. So
:func:`qk_norm_rope_reference`, the two NumPy formulas one after the other, gives its bits.
Heads up to :data:`MAX_DIM` (one warp a head, as the norm takes them); a longer head, or an
odd rot or one outside ``(0, hd]``, keeps the four launches (``Ops`` checks :func:`fits`).
For sm_90 (nvcc 13, ``--fmad=false -ftz=true``) the kernel takes 60 registers, no spills, and
4 KB of shared memory per block of 4 warps.

**IEEE float32, subnormals kept** whatever CuPy's ``-ftz=true``: the norm's operations are
PTX ``.rn.f32`` without ``.ftz`` and RoPE's are the struct ``F`` of fused_silu.py (the same
instructions; its negation flips the sign bit), as in the kernels it replaces.
"""

from __future__ import annotations

import functools

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.fused_norm import LANES, ONE_WARP_MAX, WARPS, row_stride
from gpu_worker.kernels.fused_norm import helpers_source as norm_source
from gpu_worker.kernels.fused_norm_ref import rms_norm_reference
from gpu_worker.kernels.fused_rope import rope_reference, rope_source

MAX_DIM = ONE_WARP_MAX  # head dims one warp normalises (rms_norm_rows' one-warp rows)

_KERNEL = r"""
#define WARPS __WARPS__
// grid ceil(R (hq + hkv) / WARPS), block WARPS * 32. Warp g takes head row g: q's (row,
// head) g < R hq at q + g q_stride, else k's g - R hq at k + (g - R hq) k_stride (hd
// contiguous values each); its weight qw or kw [hd]; its batch row r = row / heads gives
// cos, sin [R, rot]. Out: qo [R, hq, hd], ko [R, hkv, hd] contiguous.
extern "C" __global__ void qk_norm_rope(
        const float* __restrict__ q, long long q_stride, const float* __restrict__ qw,
        float* __restrict__ qo, int hq, const float* __restrict__ k, long long k_stride,
        const float* __restrict__ kw, float* __restrict__ ko, int hkv,
        const float* __restrict__ cs, const float* __restrict__ sn, long long rows, int hd,
        int rot, float eps, int zero_centered) {
    __shared__ float normed[WARPS][32 * 8];  // each warp's head after the norm
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long g = (long long)blockIdx.x * WARPS + warp, nq = rows * hq;
    if (g >= nq + rows * hkv) return;  // a whole warp: its shuffles see all 32 lanes or none
    const bool is_q = g < nq;
    const long long h = is_q ? g : g - nq;  // the (row, head) of q or of k
    const long long r = h / (is_q ? hq : hkv);
    float* y = normed[warp];
    norm_row_warp(is_q ? q + h * q_stride : k + h * k_stride, nullptr, nullptr,
                  is_q ? qw : kw, nullptr, y, hd, lane, eps, zero_centered);
    __syncwarp();  // the partners y[e +- rot/2] were written by other lanes
    float* out = (is_q ? qo : ko) + h * hd;
    const int half = rot / 2;
    // NOTE: loads unconditional at clamped indices (fused_norm.py: a load under a condition
    // is a branch, issued one at a time); a value past hd or rot is never used
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int e = lane + 32 * i, ec = min(e, hd - 1), c = min(e, rot - 1);
        const bool lower = ec < half;
        const float cv = cs[r * rot + c], sv = sn[r * rot + c];
        const float ye = y[ec], partner = y[lower ? ec + half : max(ec - half, 0)];
        const F rv = lower ? -F(partner) : F(partner);  // the rope kernel's rotated partner
        const float v = e < rot ? ROPE_ONE(ye, rv, cv, sv) : ye;
        if (e < hd) out[e] = v;
    }
}
"""


@functools.cache
def _function():
    # fused_norm's helpers include fused_silu's (F), which the rope's element needs
    src = norm_source() + rope_source(False) + _KERNEL.replace("__WARPS__", str(WARPS))
    return raw_module(src, "q/k norm and RoPE kernel").get_function("qk_norm_rope")


def fits(head_dim: int, rot: int) -> bool:
    """Whether :func:`qk_norm_rope` takes heads of ``head_dim`` rotated over their first
    ``rot`` dims: one warp a head (<= :data:`MAX_DIM`) and an even ``0 < rot <= head_dim``."""
    return 0 < head_dim <= MAX_DIM and 0 < rot <= head_dim and rot % 2 == 0


def _rows(x):
    """``x`` [R, heads, hd] and the element stride of its head rows (a copy first only when
    they do not sit at one stride, as rms_norm_rows reads them)."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    stride = row_stride(x)
    if stride is None:
        return cp.ascontiguousarray(x), x.shape[-1]
    return x, stride


def qk_norm_rope(q, k, qw, kw, cos, sin, eps: float, *, zero_centered: bool):
    """RMSNorm of every head of ``q [R, Hq, hd]`` by ``qw [hd]`` and of ``k [R, Hkv, hd]`` by
    ``kw [hd]``, then rotate-half RoPE of both over their first ``rot`` dims (``cos``, ``sin``
    [R, rot]): all float32 CuPy, one launch -> new contiguous ``(q', k')``, the bits of
    ``rope(rms_norm_rows(q, qw), cos, sin)`` and the same for k (module docstring). Heads
    and rot must :func:`fits`; q and k may be strided views (a slice of heads). Never waits."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    if any(a.dtype != np.float32 for a in (q, k, qw, kw, cos, sin)):
        raise TypeError("qk_norm_rope: float32 q, k, their weights, cos and sin")
    if q.ndim != 3 or k.ndim != 3 or cos.ndim != 2:
        raise ValueError(f"qk_norm_rope: q {q.shape}, k {k.shape}, cos {cos.shape}")
    (R, hq, hd), hkv, rot = q.shape, k.shape[1], cos.shape[1]
    if (k.shape != (R, hkv, hd) or qw.shape != (hd,) or kw.shape != (hd,)
            or cos.shape != (R, rot) or sin.shape != (R, rot) or not fits(hd, rot)):
        raise ValueError(f"qk_norm_rope: q {q.shape}, k {k.shape}, weights {qw.shape} "
                         f"{kw.shape}, cos {cos.shape}, sin {sin.shape} (head dims <= "
                         f"{MAX_DIM}, an even rot <= hd)")
    qo, ko = cp.empty(q.shape, np.float32), cp.empty(k.shape, np.float32)
    heads = R * (hq + hkv)
    if heads == 0:
        return qo, ko
    (q, qs), (k, ks) = _rows(q), _rows(k)
    qw, kw, cos, sin = (cp.ascontiguousarray(a) for a in (qw, kw, cos, sin))
    _function()((-(-heads // WARPS),), (WARPS * LANES,),
                (q, np.int64(qs), qw, qo, np.int32(hq), k, np.int64(ks), kw, ko, np.int32(hkv),
                 cos, sin, np.int64(R), np.int32(hd), np.int32(rot), np.float32(eps),
                 np.int32(bool(zero_centered))))
    return qo, ko


def qk_norm_rope_reference(q: np.ndarray, k: np.ndarray, qw: np.ndarray, kw: np.ndarray,
                           cos: np.ndarray, sin: np.ndarray, eps: float, *,
                           zero_centered: bool) -> tuple[np.ndarray, np.ndarray]:
    """NumPy formula of :func:`qk_norm_rope`, bit for bit: fused_norm's and fused_rope's
    references one after the other, float32 (IEEE, subnormals kept)."""
    return tuple(rope_reference(rms_norm_reference(x, w, eps, zero_centered=zero_centered),
                                cos, sin) for x, w in ((q, qw), (k, kw)))
