"""Rotate-half RoPE of q or k in one launch (CuPy float32, switch ``fused_rope``).

``Ops.apply_rope`` is about six launches per call (a negation, two concatenations, two
products, a sum); :func:`rope` does the same two products and sum per element, each rounded
once in IEEE float32 (the struct ``F`` of fused_silu.py: no fused multiply-add, subnormals
kept), so :func:`rope_reference`, that order on NumPy, gives its bits. One element's
arithmetic is written once, ``ROPE_ONE`` (:func:`rope_source`), which qk_norm_rope.py's kernel
uses too (attention's q/k norms and RoPE in one launch, where both switches are on).
"""

from __future__ import annotations

import functools

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.fused_silu import THREADS, helpers_source

# one element's arithmetic, shared with qk_norm_rope.py's kernel (needs fused_silu's F)
_ROPE_ONE = r"""
// rotate-half RoPE of one element: x cos + p sin, p (an F) its rotated partner: -x_{d + rot/2}
// below rot/2 (F's negation flips the sign bit, exact), else x_{d - rot/2}; both products and
// the sum rounded once (F: IEEE .rn, no fused multiply-add). A macro: the rope kernel's loads
// stay inside the expression, so its PTX is the one verified on the H200 (tree a016067)
#define ROPE_ONE(x, p, c, s) ((F(x) * F(c) + (p) * F(s)).v)
"""

_KERNEL = r"""
// grid ceil(n / THREADS), block THREADS: rotate-half RoPE of x [R, H, D] over its first rot
// dims (cos, sin [R, rot]): x_d cos_d + r_d sin_d with r_d = -x_{d+rot/2} below rot/2, else
// x_{d-rot/2}; dims from rot on pass through (switch fused_rope; Ops.apply_rope's order)
extern "C" __global__ void rope(const float* __restrict__ x, const float* __restrict__ cs,
                                const float* __restrict__ sn, float* __restrict__ out,
                                long long n, int H, int D, int rot) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int d = (int)(i % D);
    if (d >= rot) { out[i] = x[i]; return; }
    const long long r = i / ((long long)H * D);
    const int half = rot / 2;
    const F rv = d < half ? -F(x[i + half]) : F(x[i - half]);
    out[i] = ROPE_ONE(x[i], rv, cs[r * rot + d], sn[r * rot + d]);
}
"""


def rope_source(with_helpers: bool = True) -> str:
    """fused_silu's :func:`helpers_source` (the struct ``F``; ``with_helpers`` False: a
    module that has them already, as fused_norm.helpers_source's) and ``ROPE_ONE``, one
    element's arithmetic of :func:`rope`: a kernel that uses it gets the rope kernel's
    bits."""
    return (helpers_source() if with_helpers else "") + _ROPE_ONE


@functools.cache
def _function():
    return raw_module(rope_source() + _KERNEL, "RoPE kernel").get_function("rope")


def rope(x, cos, sin):
    """Rotate-half RoPE of ``x`` [R, H, D] over its first ``cos.shape[-1]`` dims (``cos``,
    ``sin`` [R, rot]), all float32 CuPy, one launch: ``Ops.apply_rope``'s products and sum,
    each rounded once (IEEE, no fused multiply-add). Switch ``fused_rope``."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    R, H, D = x.shape
    rot = cos.shape[-1]
    if x.dtype != np.float32 or cos.dtype != np.float32 or sin.dtype != np.float32:
        raise TypeError("rope: float32 x, cos and sin")
    if cos.shape != (R, rot) or sin.shape != (R, rot) or rot % 2 or rot > D:
        raise ValueError(f"rope: x {x.shape}, cos {cos.shape}, sin {sin.shape}")
    out = cp.empty(x.shape, np.float32)
    n = out.size
    if n:
        x, cos, sin = (cp.ascontiguousarray(a) for a in (x, cos, sin))
        _function()((-(-n // THREADS),), (THREADS,),
                    (x, cos, sin, out, np.int64(n), np.int32(H), np.int32(D), np.int32(rot)))
    return out


def rope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NumPy formula of :func:`rope` (Ops.apply_rope on NumPy float32), bit for bit."""
    x, cos, sin = (np.asarray(a, np.float32) for a in (x, cos, sin))
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    xr = x[..., :rot]
    rotated = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return np.concatenate([out, x[..., rot:]], axis=-1).astype(np.float32, copy=False)
