"""The GPU side of a CPU-expert dispatch on CuPy: the pool's ring as pinned host memory.

The ring (cpu_experts/rings.py) is registered with ``cudaHostRegister``, so the GPU copies a
layer's quantized activations, expert ids and weights straight into it by DMA, and reads the
workers' partial outputs straight out of it: no host staging copy in either direction, and no
host thread touching the activations or the partials. One layer:

1. :meth:`PinnedRing.stage`: four device-to-host copies on the current stream into the ring's
   input views, then a stream synchronize (the inputs are in host memory, the previous layer's
   partials are on the GPU);
2. the caller rewrites the expert ids in place if it must (global -> pool-local ids), then
   :meth:`PinnedRing.start` rings the workers, and the GPU goes on with its own experts;
3. :meth:`PinnedRing.collect`: wait for the workers, one 2-D host-to-device copy of the ``W``
   partials, summed on the GPU in worker order (the same float32 additions as
   ``CpuExpertPool.dispatch``, so the same bits).
"""

from __future__ import annotations

import numpy as np


class PinnedRing:
    """A :class:`cpu_experts.pool.CpuExpertPool` driven from CuPy arrays through its pinned
    ring. ``close()`` unregisters the ring (before the pool unmaps it)."""

    def __init__(self, pool, cupy) -> None:
        self.pool, self.cp = pool, cupy
        self.addr, self.nbytes = pool.ring_region()
        cupy.cuda.runtime.hostRegister(self.addr, self.nbytes, 0)
        self._parts = None  # device buffer [W, Rmax, H] float32, allocated once
        self._stream = None  # the stream of the last collect's copy
        self._rows = 0

    def close(self) -> None:
        if self.addr:
            if self._stream is not None:
                self._stream.synchronize()
            self.cp.cuda.runtime.hostUnregister(self.addr)
            self.addr = 0

    def stage(self, q, d16, ids, weights) -> tuple[np.ndarray, np.ndarray]:
        """Copy one layer's inputs into the ring: ``q [R, H] int8``, ``d16 [R, H/32]`` fp16
        (or uint16 bits), ``ids [R, k]`` (any integer type; converted to int32 on the GPU),
        ``weights [R, k]`` (float32 on the GPU). Returns the ring's host views of the ids and
        weights (``[R, k]`` int32 / float32), which the caller may still rewrite before
        :meth:`start`."""
        cp = self.cp
        R, k = ids.shape
        ids32 = cp.ascontiguousarray(ids, dtype=cp.int32)
        w32 = cp.ascontiguousarray(weights, dtype=cp.float32)
        q = cp.ascontiguousarray(q)
        d16 = cp.ascontiguousarray(d16)
        xq, xd, ids_v, w_v = self.pool.inputs(R, k)
        stream = cp.cuda.get_current_stream()
        if self._stream is not None and self._stream != stream:
            self._stream.synchronize()  # the last partials' copy must be done with the ring
        rt = cp.cuda.runtime
        for dst, src in ((xq, q), (xd, d16), (ids_v, ids32), (w_v, w32)):
            if dst.nbytes != src.nbytes or dst.shape != src.shape:
                raise ValueError(f"staging {src.dtype} {src.shape} into {dst.dtype} {dst.shape}")
            rt.memcpyAsync(dst.ctypes.data, src.data.ptr, src.nbytes, rt.memcpyDeviceToHost,
                           stream.ptr)
        stream.synchronize()
        return ids_v, w_v

    def start(self, layer: int, rows: int, k: int) -> None:
        """Ring the workers on the staged load (returns at once)."""
        self.pool.start(layer, rows, k)
        self._rows = rows

    def collect(self):
        """Wait for the workers; return ``[R, H] float32`` on the GPU: the partials summed in
        worker order. The array is a buffer reused by the next collect: add it, don't keep it."""
        cp = self.cp
        parts = self.pool.finish()  # [W, R, H] view of the pinned ring
        W, R, H = parts.shape
        if self._parts is None or self._parts.shape[1] < R:
            self._parts = cp.empty((W, self.pool.max_rows, H), cp.float32)
        dev = self._parts[:, :R]
        stream = cp.cuda.get_current_stream()
        rt = cp.cuda.runtime
        rt.memcpy2DAsync(dev.data.ptr, dev.strides[0], parts.ctypes.data, parts.strides[0],
                         R * H * 4, W, rt.memcpyHostToDevice, stream.ptr)
        self._stream = stream
        out = dev[0]
        for w in range(1, W):
            out = out + dev[w]  # in worker order, as the host path sums
        return out
