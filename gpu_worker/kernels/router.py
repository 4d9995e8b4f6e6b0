"""The MoE router after its product in one launch (CuPy float32, switch ``fused_router``):
softmax over the experts, top-k, the picked probabilities, their renormalisation.

``moe.route`` spends about nine launches there (max, subtract, exp, sum, divide, top-k,
gather, sum, divide); here one warp per row does all of it in a fixed order, so a row's
result never depends on the other rows, and :func:`router_reference` is its NumPy formula
bit for bit:

* ``m = max(logits)``; ``e_i = exp_neg(l_i - m)`` (Gated DeltaNet's exp for arguments <= 0,
  gpu_worker/kernels/gdn_recurrent.py, in IEEE float32 whatever ``-ftz`` does: the struct
  ``F`` of fused_silu.py); ``s = e_0 + e_1 + ...`` left to right; ``p_i = e_i / s``;
* the ``k`` largest ``p_i``, descending, ties to the lower expert id (their bits compared as
  unsigned integers: ``p_i >= 0``);
* weights ``p_id``; with ``norm_topk_prob`` each divided by their sum, left to right.

:func:`router_given` is the same launch where the ids are given (a synthetic model's routing
model): the same probabilities, gathered at those ids, renormalised the same way, so its
weights equal :func:`router_topk`'s at the same ids bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.fused_silu import helpers_source
from gpu_worker.kernels.gdn_reference import exp_neg
from gpu_worker.kernels.topk import PICK

MAX_EXPERTS = 2048  # a row's probabilities and flags live in shared memory

_KERNEL = r"""
// a row's probabilities into p[0..E): exp_neg(l_i - max) / (left-to-right sum); one warp
__device__ __forceinline__ void row_probs(const float* l, int E, float* p, int lane) {
    // the maximum by an order-preserving integer key: exact, no flushing
    unsigned int best = 0;
    for (int i = lane; i < E; i += 32) {
        unsigned int b = __float_as_uint(l[i]);
        unsigned int key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
        if (key > best) best = key;
    }
    for (int off = 16; off > 0; off >>= 1) {
        unsigned int o = __shfl_xor_sync(0xffffffffu, best, off);
        if (o > best) best = o;
    }
    const F m = F(__uint_as_float((best & 0x80000000u) ? (best & 0x7fffffffu) : ~best));
    for (int i = lane; i < E; i += 32) p[i] = exp_neg(F(l[i]) - m).v;
    __syncwarp();
    F s = F(0.0f);
    if (lane == 0)
        for (int i = 0; i < E; ++i) s = s + F(p[i]);  // left to right
    s = F(__shfl_sync(0xffffffffu, s.v, 0));
    for (int i = lane; i < E; i += 32) p[i] = (F(p[i]) / s).v;
    __syncwarp();
}

// lane 0: the k picked probabilities as weights, each divided by their sum if renorm
__device__ __forceinline__ void row_weights(const float* picked, int k, int renorm,
                                            float* w) {
    F t = F(1.0f);
    if (renorm) {
        t = F(0.0f);
        for (int j = 0; j < k; ++j) t = t + F(picked[j]);
    }
    for (int j = 0; j < k; ++j) w[j] = renorm ? (F(picked[j]) / t).v : picked[j];
}

// grid R, block 32 (one warp per row)
extern "C" __global__ void router_topk(const float* __restrict__ logits, int E, int k,
                                       int renorm, long long* __restrict__ ids,
                                       float* __restrict__ weights) {
    __shared__ float p[2048];
    __shared__ unsigned char taken[2048];
    __shared__ float picked[64];
    const int row = blockIdx.x, lane = threadIdx.x;
    for (int i = lane; i < E; i += 32) taken[i] = 0;
    row_probs(logits + (long long)row * E, E, p, lane);
    for (int j = 0; j < k; ++j) {  // top-k by bits (p >= 0), ties to the lower id
        int at = warp_pick(p, E, taken, lane);
        if (lane == 0) {
            ids[(long long)row * k + j] = at;
            picked[j] = p[at];
        }
    }
    if (lane == 0) row_weights(picked, k, renorm, weights + (long long)row * k);
}

// grid R, block 32: the weights at given ids [R, k] (each in [0, E)), no top-k
extern "C" __global__ void router_given(const float* __restrict__ logits, int E, int k,
                                        int renorm, const long long* __restrict__ ids,
                                        float* __restrict__ weights) {
    __shared__ float p[2048];
    __shared__ float picked[64];
    const int row = blockIdx.x, lane = threadIdx.x;
    row_probs(logits + (long long)row * E, E, p, lane);
    if (lane != 0) return;
    for (int j = 0; j < k; ++j) picked[j] = p[ids[(long long)row * k + j]];
    row_weights(picked, k, renorm, weights + (long long)row * k);
}
"""


@functools.cache
def _module():
    return raw_module(helpers_source() + PICK + _KERNEL, "router kernels")


def _check(logits, k: int) -> None:
    R, E = logits.shape
    if logits.dtype != np.float32:
        raise TypeError(f"router logits must be float32, got {logits.dtype}")
    if not 0 < k <= min(E, 64) or E > MAX_EXPERTS:
        raise ValueError(f"top-{k} of {E} experts: want 0 < k <= min(E, 64), E <= "
                         f"{MAX_EXPERTS}")


def router_topk(logits, k: int, renorm: bool):
    """(ids int64 [R, k], weights float32 [R, k]) of the router's ``logits`` [R, E] (CuPy
    float32), as the module docstring says; one launch, never waits."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    _check(logits, k)
    R = logits.shape[0]
    ids = cp.empty((R, k), cp.int64)
    return ids, _launch("router_topk", logits, ids, renorm)


def router_given(logits, ids, renorm: bool):
    """weights float32 [R, k]: :func:`router_topk`'s probabilities of ``logits`` [R, E] (CuPy
    float32) at the given ``ids`` (int64 [R, k], each in [0, E): not checked, that would
    wait), renormalised the same way; one launch, never waits."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    R, E = logits.shape
    k = ids.shape[-1]
    if ids.shape != (R, k) or ids.dtype != np.int64:
        raise ValueError(f"given ids must be int64 [{R}, k], got {ids.dtype} {ids.shape}")
    _check(logits, k)
    return _launch("router_given", logits, cp.ascontiguousarray(ids), renorm)


def _launch(name: str, logits, ids, renorm: bool):
    """Run kernel ``name`` (one warp per row) on ``logits`` [R, E] with ``ids`` [R, k]
    (written by router_topk, read by router_given); the weights float32 [R, k]."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    (R, E), k = logits.shape, ids.shape[1]
    weights = cp.empty((R, k), cp.float32)
    if R:
        _module().get_function(name)(
            (R,), (32,), (cp.ascontiguousarray(logits), np.int32(E), np.int32(k),
                          np.int32(bool(renorm)), ids, weights))
    return weights


def router_reference(logits: np.ndarray, k: int, renorm: bool
                     ) -> tuple[np.ndarray, np.ndarray]:
    """NumPy formula of :func:`router_topk`, bit for bit (sums left to right by cumsum)."""
    p = _probs(logits)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k].astype(np.int64)
    return ids, _weights(p, ids, renorm)


def router_given_reference(logits: np.ndarray, ids: np.ndarray, renorm: bool) -> np.ndarray:
    """NumPy formula of :func:`router_given`, bit for bit."""
    return _weights(_probs(logits), np.asarray(ids, np.int64), renorm)


def _probs(logits: np.ndarray) -> np.ndarray:
    """[R, E] float32: exp_neg(l - max) / (the left-to-right sum)."""
    lg = np.asarray(logits, np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        e = exp_neg((lg - lg.max(axis=1, keepdims=True)).astype(np.float32))
        s = np.cumsum(e, axis=1, dtype=np.float32)[:, -1:]
        return (e / s).astype(np.float32)


def _weights(p: np.ndarray, ids: np.ndarray, renorm: bool) -> np.ndarray:
    """[R, k] float32: ``p`` at ``ids``, divided by their left-to-right sum if ``renorm``."""
    w = np.take_along_axis(p, ids, axis=1)
    if renorm:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            w = (w / np.cumsum(w, axis=1, dtype=np.float32)[:, -1:]).astype(np.float32)
    return w
