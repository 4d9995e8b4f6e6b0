"""A pass's routes, one device array per MoE layer, packed into one array in one launch.

The adaptive draft budget reads each decode slot's CPU experts after a step
(gpu_worker/experts/counters.py). The forward leaves per layer two small device arrays: the
picked ids ``[R, k]`` and whether each pick runs on the CPU ``[R, k]`` bool. Stacking them
with CuPy (``cupy.stack`` of 49 layers, twice) costs a view per layer in Python and a
pointer upload per stack, about a millisecond of host time per step read on an H100 machine.
:func:`pack_routes` instead uploads one table (the layers' two pointers and id base) and
launches one kernel that writes ``base + id`` where the pick is on the CPU and -1 where it is
not, int32 ``[L, R, k]``: one upload, one launch, one copy back.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels import raw_module

_KERNEL = r"""
template <typename T>
__device__ __forceinline__ void pack(const long long* __restrict__ table, int layers, int n,
                                     int* __restrict__ out) {
    const int l = blockIdx.y;
    const T* ids = reinterpret_cast<const T*>(table[l]);
    const unsigned char* cpu = reinterpret_cast<const unsigned char*>(table[layers + l]);
    const int base = (int)table[2 * layers + l];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[(long long)l * n + i] = cpu[i] ? base + (int)ids[i] : -1;
}

extern "C" __global__ void pack_routes_i64(const long long* __restrict__ table, int layers,
                                           int n, int* __restrict__ out) {
    pack<long long>(table, layers, n, out);
}

extern "C" __global__ void pack_routes_i32(const long long* __restrict__ table, int layers,
                                           int n, int* __restrict__ out) {
    pack<int>(table, layers, n, out);
}
"""
_THREADS = 128
_NAMES = {np.dtype(np.int64): "pack_routes_i64", np.dtype(np.int32): "pack_routes_i32"}


def pack_routes(bases: list[int], ids: list, cpu: list) -> np.ndarray:
    """Host int32 ``[L, R, k]``: ``bases[l] + ids[l]`` where ``cpu[l]`` (a layer's picks on
    the CPU), else -1. ``ids``: CuPy int32 or int64 ``[R, k]`` per layer, all one dtype and
    shape; ``cpu``: CuPy bool, the same shape. Runs on the current stream, then waits for it."""
    import cupy as cp  # noqa: PLC0415 (device arrays: cupy is imported already)

    L = len(ids)
    shape, dtype = ids[0].shape, np.dtype(ids[0].dtype)
    if dtype not in _NAMES:
        raise TypeError(f"route ids must be int32 or int64, got {dtype}")
    for a, c in zip(ids, cpu, strict=True):
        if (a.shape != shape or c.shape != shape or np.dtype(a.dtype) != dtype
                or np.dtype(c.dtype) != np.bool_ or not a.flags.c_contiguous
                or not c.flags.c_contiguous):
            raise ValueError(f"routes to pack: contiguous {dtype} ids and bool picks of shape "
                             f"{shape}, got {a.dtype} {a.shape} and {c.dtype} {c.shape}")
    n = int(np.prod(shape))
    out = cp.empty((L, *shape), cp.int32)
    if n and L:
        table = np.array([a.data.ptr for a in ids] + [c.data.ptr for c in cpu] + list(bases),
                         np.int64)
        grid = ((n + _THREADS - 1) // _THREADS, L)
        raw_module(_KERNEL, "route packing kernel").get_function(_NAMES[dtype])(
            grid, (_THREADS,), (cp.asarray(table), np.int32(L), np.int32(n), out))
    return out.get()


def pack_routes_reference(bases: list[int], ids: list[np.ndarray],
                          cpu: list[np.ndarray]) -> np.ndarray:
    """:func:`pack_routes` on host arrays (NumPy; at least one layer)."""
    base = np.asarray(bases, np.int64).reshape(-1, *([1] * ids[0].ndim))
    return np.where(np.stack(cpu), np.stack(ids).astype(np.int64) + base, -1).astype(np.int32)
