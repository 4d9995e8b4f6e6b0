"""The GPU side of a CPU-expert dispatch on CuPy: the pool's ring as pinned, mapped host memory.

The ring (cpu_experts/rings.py) is registered with ``cudaHostRegister``. Where the device
can use a registered host pointer directly (``cudaDevAttrCanUseHostPointerForRegisteredMem``,
true on x86 Linux with UVA), GPU kernels read and write the ring themselves ("zero copy"):

1. :meth:`PinnedRing.stage`: one kernel writes the layer's quantized activations, fp16 scale
   bits, expert ids (mapped to the pool's local ids, -1 for experts on the GPU) and weights
   into the ring, then the stream is synchronized: the inputs are in host memory;
2. :meth:`PinnedRing.start` rings the workers and returns; the GPU goes on with its experts;
3. :meth:`PinnedRing.collect` waits for the workers, copies the ``W`` partials to the GPU
   with one ``cudaMemcpy2DAsync`` and one kernel sums them in worker order onto the GPU
   experts' output: the same float32 additions as the host path (``CpuExpertPool.dispatch``
   then ``gpu + cpu``), so the same bits.

No host thread touches activations or partials. Each direction can go either way (a kernel
on the mapped ring, or a DMA copy); the defaults are the faster ones measured.
"""

from __future__ import annotations

import numpy as np

# cudaDeviceAttr: the device may use the host pointer of registered memory
CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
THREADS = 256

_SOURCE = r"""
extern "C" __global__ void ring_stage(
        const int* __restrict__ q, long long nq4, const unsigned short* __restrict__ d,
        long long nd, const long long* __restrict__ ids, int rows, int k, long long ids_stride,
        const float* __restrict__ w, long long w_stride, const unsigned char* __restrict__ on_cpu,
        long long n_mask, int first_cpu, int* ring_q, unsigned short* ring_d, int* ring_ids,
        float* ring_w, int* gids) {
    long long step = (long long)gridDim.x * blockDim.x;
    long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = start; i < nq4; i += step) ring_q[i] = q[i];
    for (long long i = start; i < nd; i += step) ring_d[i] = d[i];
    for (long long i = start; i < (long long)rows * k; i += step) {
        long long r = i / k, c = i % k;
        long long e = ids[r * ids_stride + c];
        gids[i] = (int)e;
        if (!on_cpu)          // pool-local ids already: the workers check them
            ring_ids[i] = (int)e;
        else if (e < 0 || e >= n_mask)  // not an expert id: -2 makes the workers refuse it
            ring_ids[i] = -2;
        else
            ring_ids[i] = on_cpu[e] ? (int)(e - first_cpu) : -1;
        ring_w[i] = w[r * w_stride + c];
    }
}

extern "C" __global__ void ring_gather(
        const float* parts, long long wstride, int W, long long n,
        const float* __restrict__ base, float* __restrict__ out) {
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        float s = parts[i];
        for (int v = 1; v < W; ++v) s += parts[v * wstride + i];
        out[i] = base ? base[i] + s : s;
    }
}
"""
_module = None


def _kernels(cp):
    global _module
    if _module is None:
        _module = cp.RawModule(code=_SOURCE, options=("--fmad=false",))
    return _module.get_function("ring_stage"), _module.get_function("ring_gather")


def _grid(n: int) -> tuple[int]:
    return (max(1, min(1024, -(-n // THREADS))),)


def _as(cp, a, dtype, inner: int):
    """``a`` as ``dtype`` with a contiguous last axis (no call into CuPy when it already is:
    each costs microseconds, and this runs per layer)."""
    if a.dtype != dtype:
        a = a.astype(dtype)
    if a.strides[-1] != inner:
        a = cp.ascontiguousarray(a)
    return a


class PinnedRing:
    """A :class:`cpu_experts.pool.CpuExpertPool` driven from CuPy arrays through its pinned
    ring. ``kernel_in``: inputs written into the ring by the ``ring_stage`` kernel (posted
    writes over the bus) rather than by ``cudaMemcpyAsync``; ``kernel_out``: partials read from
    the ring by the ``ring_gather`` kernel rather than copied by ``cudaMemcpy2DAsync`` and
    summed in device memory. Either kernel needs a device that may use registered host
    pointers; None = use it where possible (in) / never (out: reading host memory from a
    kernel is a round trip per access; measured slower, docs/cpu_experts.md). ``close()``
    unregisters the ring (before the pool unmaps it)."""

    def __init__(self, pool, cupy, kernel_in: bool | None = None,
                 kernel_out: bool | None = False) -> None:
        self.pool, self.cp = pool, cupy
        self.addr, self.nbytes = pool.ring_region()
        rt = cupy.cuda.runtime
        rt.hostRegister(self.addr, self.nbytes, 0)
        can = bool(rt.deviceGetAttribute(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                                          cupy.cuda.Device().id))
        self.kernel_in = can if kernel_in is None else bool(kernel_in and can)
        self.kernel_out = can if kernel_out is None else bool(kernel_out and can)
        self._stage, self._gather = _kernels(cupy)
        W, H = pool.num_workers, pool.hidden
        self._parts = cupy.empty((W, pool.max_rows, H), cupy.float32)  # partials, on the GPU
        self._stream = None  # the stream of the last collect
        n = pool.ring.ids.size  # global ids of the staged pairs, in pinned (mapped) memory
        self._gids_mem = cupy.cuda.alloc_pinned_memory(4 * n)
        self._gids = np.frombuffer(self._gids_mem, np.int32, n)

    def close(self) -> None:
        if self.addr:
            if self._stream is not None:
                self._stream.synchronize()
            self.cp.cuda.runtime.hostUnregister(self.addr)
            self.addr = 0

    def stage(self, q, d16, ids, weights, on_cpu=None, first_cpu: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
        """Put one layer's inputs into the ring: ``q [R, H] int8``, ``d16 [R, H/32]`` fp16 (or
        its uint16 bits), ``ids [R, k]`` integer expert ids, ``weights [R, k]``, all CuPy.
        ``on_cpu``: the layer's bool mask over expert ids (None: every id is the pool's);
        ring ids become ``id - first_cpu`` where ``on_cpu[id]``, else -1 (and -2, which the
        workers refuse, outside the mask). Returns host views ``(global ids [R, k] int32,
        ring ids [R, k] int32)``; the stream is synchronized on return."""
        cp = self.cp
        R, k = ids.shape
        ids = _as(cp, ids, cp.int64, 8)
        w = _as(cp, weights, cp.float32, 4)
        if not q.flags.c_contiguous:
            q = cp.ascontiguousarray(q)
        if not d16.flags.c_contiguous:
            d16 = cp.ascontiguousarray(d16)
        xq, xd, ids_v, w_v = self.pool.inputs(R, k)
        if q.shape != xq.shape or q.dtype.itemsize != 1 or d16.shape != xd.shape \
                or d16.dtype.itemsize != 2:
            raise ValueError(f"q {q.dtype} {q.shape} / scales {d16.dtype} {d16.shape} do not "
                             f"fit the ring's {xq.shape} / {xd.shape}")
        stream = cp.cuda.get_current_stream()
        if self._stream is not None and self._stream.ptr != stream.ptr:
            self._stream.synchronize()  # the last gather must be done reading the ring
        gids = self._gids[:R * k].reshape(R, k)
        if self.kernel_in:
            self._stage(_grid(max(q.size // 4, R * k)), (THREADS,), (
                q, np.int64(q.size // 4), d16, np.int64(d16.size), ids, np.int32(R),
                np.int32(k), np.int64(ids.strides[0] // 8), w, np.int64(w.strides[0] // 4),
                np.uint64(0) if on_cpu is None else on_cpu,
                np.int64(0 if on_cpu is None else on_cpu.size), np.int32(first_cpu),
                np.uint64(xq.ctypes.data), np.uint64(xd.ctypes.data),
                np.uint64(ids_v.ctypes.data), np.uint64(w_v.ctypes.data),
                np.uint64(gids.ctypes.data)), stream=stream)
            stream.synchronize()
            return gids, ids_v
        rt = cp.cuda.runtime
        ids32 = cp.ascontiguousarray(ids, dtype=cp.int32)
        if on_cpu is None:
            local = ids32
        else:
            inside = (ids >= 0) & (ids < on_cpu.size)
            local = cp.where(inside, cp.where(on_cpu[cp.clip(ids, 0, on_cpu.size - 1)],
                                              ids32 - first_cpu, -1), -2).astype(cp.int32)
        for dst, src in ((xq, q), (xd, d16), (ids_v, local), (w_v, cp.ascontiguousarray(w)),
                         (gids, ids32)):
            rt.memcpyAsync(dst.ctypes.data, src.data.ptr, src.nbytes, rt.memcpyDeviceToHost,
                           stream.ptr)
        stream.synchronize()
        return gids, ids_v

    def start(self, layer: int, rows: int, k: int) -> None:
        """Ring the workers on the staged load (returns at once)."""
        self.pool.start(layer, rows, k)

    def collect(self, base=None):
        """Wait for the workers; return ``base + (p_0 + p_1 + ...)`` ``[R, H] float32`` on the
        GPU (``base``: a float32 ``[R, H]`` CuPy array, e.g. the GPU experts' output, or None
        for the partials' sum alone): the float32 additions of the host path, in its order."""
        cp = self.cp
        parts = self.pool.finish()  # [W, R, H] view of the pinned ring
        W, R, H = parts.shape
        stream = cp.cuda.get_current_stream()
        self._stream = stream
        out = cp.empty((R, H), cp.float32)
        if base is not None:
            base = _as(cp, base, cp.float32, 4)
            if not base.flags.c_contiguous:
                base = cp.ascontiguousarray(base)
        if self.kernel_out:
            src, stride = np.uint64(parts.ctypes.data), parts.strides[0] // 4
        else:
            dev = self._parts
            rt = cp.cuda.runtime
            rt.memcpy2DAsync(dev.data.ptr, dev.strides[0], parts.ctypes.data, parts.strides[0],
                             R * H * 4, W, rt.memcpyHostToDevice, stream.ptr)
            src, stride = dev, dev.strides[0] // 4
        self._gather(_grid(R * H), (THREADS,), (
            src, np.int64(stride), np.int32(W), np.int64(R * H),
            base if base is not None else np.uint64(0), out), stream=stream)
        return out
