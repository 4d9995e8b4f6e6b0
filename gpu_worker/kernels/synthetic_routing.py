"""A synthetic model's routing (gpu_worker/weights/routing.py) computed on the GPU.

The routing model replaces a synthetic model's router with a pure function of (seed, layer,
key, position, lane): counter-based splitmix64 hashes, a walk back to the lane's last
renewal, a draw from the lane's Zipf stratum and the layer's ranking. Computed on the host it
cost 3-7 ms per step for 48 layers (one vectorised NumPy call, ``choose_layers``), which the
step's host time cannot afford (issue 14: <= 1 ms); here one launch gives every layer's ids
from the rows' routing keys and positions on the device, inside the step's CUDA graph.
NOTE: the kernel's ``slots`` argument takes the rows' routing keys (a request's
SlotWork.route_key, else its slot: gpu_worker/weights/routing.py), int64 like the slot it
was named for; every key is in 0..2**63-1, so the kernel's cast to unsigned long long gives
the host's ``astype(np.uint64)`` bits, and a key equal to the slot gives the slot's ids.

Bit for bit the host's: the hashes are 64-bit integer arithmetic, the uniform draw is the top
53 bits times 2^-53 (exact in float64), the stratum search compares float64 values exactly
(``numpy.searchsorted(..., side="right")``: the number of entries <= u).
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.weights.routing import _DRAW, _RENEW, WINDOW, RoutingModel

THREADS = 128

_KERNEL = r"""
__device__ __forceinline__ unsigned long long splitmix(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// splitmix64 chained over (seed, purpose, layer, slot, position, lane), as routing._hash
__device__ __forceinline__ double uniform6(long long a, long long b, long long c, long long d,
                                           long long e, long long f) {
    unsigned long long h = 0;
    h = splitmix(h ^ (unsigned long long)a);
    h = splitmix(h ^ (unsigned long long)b);
    h = splitmix(h ^ (unsigned long long)c);
    h = splitmix(h ^ (unsigned long long)d);
    h = splitmix(h ^ (unsigned long long)e);
    h = splitmix(h ^ (unsigned long long)f);
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

// one thread per (layer l, row r, lane j): ids[l, r, j]
extern "C" __global__ void route_rows(
        long long seed, const long long* __restrict__ layers, int L,
        const long long* __restrict__ slots, const long long* __restrict__ positions, int R,
        int k, int E, int window, double q, const double* __restrict__ cdf, int W,
        const long long* __restrict__ perms, long long* __restrict__ ids) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)L * R * k) return;
    int j = (int)(t % k), r = (int)((t / k) % R), l = (int)(t / ((long long)k * R));
    long long layer = layers[l], slot = slots[r], p = positions[r];
    long long stagger = (long long)j * window / k;
    for (;;) {  // the lane's last renewal at or before p
        bool renew = p == 0 || (p + stagger) % window == 0;
        if (!renew)
            renew = q > 0.0 ? uniform6(seed, RENEW, layer, slot, p, j) >= q : true;
        if (renew) break;
        --p;
    }
    double u = uniform6(seed, DRAW, layer, slot, p, j);
    const double* c = cdf + (long long)j * W;
    int lo = 0, hi = W;  // entries <= u (the row is non-decreasing)
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (c[mid] <= u) lo = mid + 1; else hi = mid;
    }
    long long rank = j + (long long)k * lo;
    if (rank > E - 1) rank = E - 1;
    ids[t] = perms[(long long)l * E + rank];
}
"""


def kernel_source() -> str:
    return f"#define RENEW {_RENEW}\n#define DRAW {_DRAW}\n" + _KERNEL


class DeviceRoutingTables:
    """A RoutingModel's tables on the device (its strata's CDFs, the rankings of the given
    layers), made once; :meth:`choose` launches the kernel."""

    def __init__(self, model: RoutingModel, layers: list[int]) -> None:
        import cupy as cp  # noqa: PLC0415

        self.model, self.layers = model, [int(x) for x in layers]
        self.index = {layer: i for i, layer in enumerate(self.layers)}  # layer -> row of ids
        self.cdf = cp.asarray(np.ascontiguousarray(model._cdf, np.float64))
        self.perms = cp.asarray(np.stack([model.ranking(x) for x in self.layers])
                                .astype(np.int64))
        self.layer_ids = cp.asarray(np.asarray(self.layers, np.int64))

    def choose(self, keys, positions):
        """int64 [L, R, k] on the device: ``choose_layers(self.layers, keys, positions)``
        for device int64 routing ``keys`` [R] (each in 0..2**63-1) and ``positions`` [R]
        (every position >= 0)."""
        import cupy as cp  # noqa: PLC0415

        m = self.model
        L, R, k = len(self.layers), int(keys.shape[0]), m.top_k
        ids = cp.empty((L, R, k), cp.int64)
        n = L * R * k
        if n:
            raw_module(kernel_source(), "synthetic routing kernel").get_function("route_rows")(
                (-(-n // THREADS),), (THREADS,),
                (np.int64(m.seed), self.layer_ids, np.int32(L), keys, positions, np.int32(R),
                 np.int32(k), np.int32(m.num_experts), np.int32(WINDOW),
                 np.float64(m.params.locality), self.cdf, np.int32(self.cdf.shape[1]),
                 self.perms, ids))
        return ids
