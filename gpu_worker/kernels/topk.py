"""The router's top-k on CuPy in one launch, with no host synchronisation.

``cupy.argsort`` sorts through Thrust, which waits for the device when it is done: one host
sync per MoE layer, which also makes the pass impossible to capture in a CUDA graph
(gpu_worker/step_graph.py). :func:`topk_rows` picks the same ids: for each row the ``k``
largest probabilities in descending order, ties to the lower index, as a stable ascending
sort of ``-probs`` gives (NumPy's ``kind="stable"``; CuPy's radix sort is stable too).

One warp per row, ``k`` rounds: each lane keeps the best entry not yet taken among its
strided ones, then the warp reduces by shuffles. Probabilities are compared by their bits as
unsigned integers: for floats >= 0 that is their order, exact whatever ``-ftz`` does to
subnormals (a softmax's outputs are >= 0; -0.0 counts as 0).
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels import raw_module

MAX_EXPERTS = 4096  # the taken flags live in shared memory, one byte per expert

# One warp's next pick: the largest p[e] (p >= 0, compared by bits) not yet taken, ties to
# the lower e; every lane gets it, and it is marked taken. router.py's kernel picks with it too.
PICK = r"""
__device__ __forceinline__ int warp_pick(const float* p, int E, unsigned char* taken,
                                         int lane) {
    unsigned int best = 0; int at = -1;
    for (int e = lane; e < E; e += 32) {
        if (taken[e]) continue;
        unsigned int b = __float_as_uint(p[e]) & 0x7fffffffu;  // -0.0 as 0
        if (at < 0 || b > best) { best = b; at = e; }  // ascending e: ties keep the first
    }
    for (int off = 16; off > 0; off >>= 1) {
        unsigned int ob = __shfl_down_sync(0xffffffffu, best, off);
        int oa = __shfl_down_sync(0xffffffffu, at, off);
        if (oa >= 0 && (at < 0 || ob > best || (ob == best && oa < at))) { best = ob; at = oa; }
    }
    at = __shfl_sync(0xffffffffu, at, 0);
    if (at >= 0 && (at & 31) == lane) taken[at] = 1;
    __syncwarp();
    return at;
}
"""

_KERNEL = PICK + r"""
extern "C" __global__ void topk_rows(const float* __restrict__ probs, int E, int k,
                                     long long* __restrict__ ids) {
    __shared__ unsigned char taken[4096];
    const int row = blockIdx.x, lane = threadIdx.x;
    const float* p = probs + (long long)row * E;
    for (int e = lane; e < E; e += 32) taken[e] = 0;
    __syncwarp();
    for (int j = 0; j < k; ++j) {
        int at = warp_pick(p, E, taken, lane);
        if (lane == 0) ids[(long long)row * k + j] = at;
    }
}
"""


def topk_rows(probs, k: int):
    """int64 [R, k]: per row of ``probs [R, E]`` (CuPy float32, every value >= 0) the ids
    of the k largest, descending, ties to the lower id."""
    import cupy as cp  # noqa: PLC0415

    R, E = probs.shape
    if not 0 < k <= E or E > MAX_EXPERTS:
        raise ValueError(f"top-{k} of {E} experts: want 0 < k <= E <= {MAX_EXPERTS}")
    if probs.dtype != np.float32:
        raise TypeError(f"probabilities must be float32, got {probs.dtype}")
    probs = cp.ascontiguousarray(probs)
    ids = cp.empty((R, k), cp.int64)
    if R:
        raw_module(_KERNEL, "router top-k kernel").get_function("topk_rows")(
            (R,), (32,), (probs, np.int32(E), np.int32(k), ids))
    return ids
