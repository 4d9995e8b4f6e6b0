"""The launched path's ring: a CpuExpertPool's ring as pinned, mapped host memory (CuPy).

The ring (cpu_experts/rings.py) is registered with ``cudaHostRegister``. The device uses
the registered host pointer directly (``cudaDevAttrCanUseHostPointerForRegisteredMem``,
true on x86 Linux with UVA): GPU kernels (gpu_worker/experts/ring_kernels.py) read and
write the ring themselves. Where a device cannot, :func:`device_can_map` says so and the
placement takes the host path instead.

One layer, all enqueued on the stream, the host never waiting:

1. :meth:`PinnedRing.launch`: one kernel writes the layer's quantized activations, fp16 scale
   bits, expert ids (mapped to the pool's local ids, -1 for experts on the GPU) and weights
   into the ring; its last block then writes the header and each worker's ``SEQ_IN`` (after
   system-scope fences). The workers spin on ``SEQ_IN`` during a device session, so they
   start without a system call;
2. the GPU computes its own experts meanwhile;
3. :meth:`PinnedRing.gather`: one single-block kernel polls the workers' ``SEQ_OUT`` (and
   gives up on ``header[ABORT]``, set by the pool's watchdog when a worker dies, or after a
   timeout), then one kernel reads the ``W`` partials from the mapped ring with
   system-scope loads and sums them in worker order onto the GPU experts' output: the same
   float32 additions as the host path (``CpuExpertPool.dispatch`` then ``gpu + cpu``), so
   the same bits;
4. :meth:`PinnedRing.end_step` after the forward: synchronize, close the session, raise
   what a worker reported.

Kernels are launched through ``cuLaunchKernel`` from argument buffers made once
(:class:`ring_kernels.Launch`): CuPy's per-argument conversion cost more than the dispatch.
"""

from __future__ import annotations

import numpy as np

from cpu_experts.errors import ERR_ABORTED, ERR_TIMEOUT, status_error
from gpu_worker.experts.ring_kernels import THREADS, Launch, grid, kernels

# cudaDeviceAttr: the device may use the host pointer of registered memory
CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
TAG_LIMIT = 1 << 30  # launches counted per stamp array before it is renewed
MAX_WORKERS = 32  # one thread of the waiting kernel's single warp per worker


def device_can_map(cupy) -> bool:
    """Whether the current device may use registered host memory through its host pointer."""
    return bool(cupy.cuda.runtime.deviceGetAttribute(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                                                     cupy.cuda.Device().id))


def _as(cp, a, dtype, inner: int):
    """``a`` as ``dtype`` with a contiguous last axis (no call into CuPy when it already is:
    each costs microseconds, and this runs per layer)."""
    if a.dtype != dtype:
        a = a.astype(dtype)
    if a.strides[-1] != inner:
        a = cp.ascontiguousarray(a)
    return a


class PinnedRing:
    """A :class:`cpu_experts.pool.CpuExpertPool` driven from CuPy arrays by GPU kernels.

    :meth:`launch` and :meth:`gather` only enqueue kernels; the GPU rings the workers and
    waits for them. The first launch opens a device session of the pool (the workers spin on
    the ring); :meth:`end_step` synchronizes the stream, closes it and raises what went
    wrong. ``timeout_s``: how long a GPU wait for the workers lasts before it reports an
    error. ``close()`` unregisters the ring (before the pool unmaps it). Needs
    :func:`device_can_map`.
    """

    def __init__(self, pool, cupy, timeout_s: float = 30.0) -> None:
        if pool.num_workers > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} workers per pool (one GPU thread waits "
                             "on each)")
        if not device_can_map(cupy):
            raise RuntimeError("this device cannot use registered host memory: use the host "
                               "path (CpuExpertPool.dispatch_quantized)")
        self.pool, self.cp = pool, cupy
        self.addr, self.nbytes = pool.ring_region()
        cupy.cuda.runtime.hostRegister(self.addr, self.nbytes, 0)
        self.timeout_ns = int(timeout_s * 1e9)
        # [blocks done, any pair for the workers, this layer has one]; distinct experts
        # (GPU's, CPU's) since take_distinct; per-expert stamps
        self._state = cupy.zeros(8, cupy.int32)
        self._distinct = cupy.zeros(2, cupy.uint64)
        self._stamp = cupy.zeros(0, cupy.int32)
        self._tag = 0
        self._session = None  # the stream of the open device session
        self._pending: tuple | None = None  # (seq, layer, rows, times) to gather
        self.last_seq = 0  # the sequence number of the last launch
        self._kernel_ns0 = pool.kernel_total_ns()
        self.poll_ns = 1000  # how often a waiting kernel reads SEQ_OUT (over the bus)
        ring = pool.ring
        self._p = {name: int(getattr(ring, name).ctypes.data)
                   for name in ("xq", "xd", "ids", "w", "ctrl", "header", "out")}
        self._state_p = self._state.data.ptr
        self._has_p = self._state_p + 8  # &state[2]
        self._distinct_p = self._distinct.data.ptr
        # errors of the waits (error, layer): pinned host memory the kernels write
        self._errs_mem = cupy.cuda.alloc_pinned_memory(8)
        self._errs = np.frombuffer(self._errs_mem, np.int32, 2)
        self._errs[:] = 0
        self._errs_p = self._errs.ctypes.data
        # a CUDA graph's launches take sequence numbers and tags as offsets from these,
        # written before each replay (begin_capture / before_replay)
        self._seq_base = cupy.zeros(1, cupy.int64)
        self._tag_base = cupy.zeros(1, cupy.int32)
        self._graph: list[int] | None = None  # while capturing: [launches, tags] so far
        k = kernels()
        self._launch = Launch(cupy, k["ring_launch"], 29)
        self._wait = Launch(cupy, k["ring_wait"], 11)
        self._sum_parts = Launch(cupy, k["ring_gather"], 8)

    def close(self) -> None:
        if self.addr:
            try:
                self.end_step()
            except Exception:  # noqa: BLE001 -- closing: the pool reports dead workers itself
                pass
            self.cp.cuda.runtime.hostUnregister(self.addr)
            self.addr = 0

    def _arrays(self, q, d16, ids, weights) -> tuple:
        """The layer's arrays checked against the ring and in the kernels' layouts."""
        cp, pool = self.cp, self.pool
        R, k = ids.shape
        H = pool.hidden
        if not 0 < R <= pool.max_rows or not 0 < k <= pool.max_k:
            raise ValueError(f"rows={R}, k={k}: want 1..{pool.max_rows} rows and "
                             f"1..{pool.max_k} experts per row")
        if q.shape != (R, H) or q.dtype.itemsize != 1 or d16.shape != (R, H // 32) \
                or d16.dtype.itemsize != 2 or weights.shape != (R, k):
            raise ValueError(f"q {q.dtype} {q.shape} / scales {d16.dtype} {d16.shape} / "
                             f"weights {weights.shape} do not fit {R} rows of {H}, top-{k}")
        ids = _as(cp, ids, cp.int64, 8)
        w = _as(cp, weights, cp.float32, 4)
        if not q.flags.c_contiguous:
            q = cp.ascontiguousarray(q)
        if not d16.flags.c_contiguous:
            d16 = cp.ascontiguousarray(d16)
        return q, d16, ids, w

    # NOTE: launch and gather run once per MoE layer on the host, ahead of the stream: kernel
    # arguments are raw pointers and scalars (no CuPy array marshalling), the ring's made once.

    def launch(self, layer: int, q, d16, ids, weights, on_cpu=None, first_cpu: int = 0,
               times=None, same_layer: bool = False) -> None:
        """Enqueue one layer's load on the current stream and return: ``q [R, H] int8``,
        ``d16 [R, H/32]`` fp16 (or its uint16 bits), ``ids [R, k]`` integer expert ids,
        ``weights [R, k]``, all CuPy, ``R <= pool.max_rows``. ``on_cpu``: the layer's bool
        mask over expert ids (None: every id is the pool's); ring ids become
        ``id - first_cpu`` where ``on_cpu[id]``, else -1 (an id of -1 too: no expert, a padded
        pass's padding row; -2, which the workers refuse, for other ids outside the mask).
        The ``ring_launch`` kernel writes the inputs, then (if any pair is the workers') the
        header and every worker's ``SEQ_IN``. Then enqueue the GPU's own
        work, then :meth:`gather`. Also counts the distinct experts (:meth:`take_distinct`);
        ``same_layer``: this load continues the last one's layer (more rows than the ring
        holds), its experts count with it. ``times``: an optional uint64 CuPy array of 2,
        given the GPU clock (ns) when the workers were rung and when they were seen done."""
        cp, pool = self.cp, self.pool
        if self._pending is not None:
            raise RuntimeError("gather() the last launch() first")
        if layer not in pool.layers:
            raise KeyError(f"layer {layer} has no CPU experts (have {sorted(pool.layers)})")
        q, d16, ids, w = self._arrays(q, d16, ids, weights)
        R, k = ids.shape
        H = pool.hidden
        stream = cp.cuda.get_current_stream()
        if self._session is None:
            pool.device_begin()
            self._session = stream
        elif self._session.ptr != stream.ptr:
            raise RuntimeError("one stream per step: end_step() before changing streams")
        graph = self._graph
        if graph is None:
            seq, seq_p = pool.next_seq(), 0
        else:  # capturing: the replay's base plus this offset
            graph[0] += 1
            seq, seq_p = graph[0], self._seq_base.data.ptr
        stamp = n_mask = mask = tag_p = 0
        tag = self._tag
        if on_cpu is not None:
            # NOTE: the size check holds for a continued layer too: the kernel indexes the
            # stamps by expert id up to on_cpu.size (a smaller array: writes out of bounds)
            if graph is not None:
                if self._stamp.size < on_cpu.size:
                    raise RuntimeError("the expert stamps must exist before a capture")
                if not same_layer or not graph[1]:
                    graph[1] += 1
                tag, tag_p = graph[1], self._tag_base.data.ptr
            else:
                if self._stamp.size < on_cpu.size or (not same_layer
                                                      and self._tag >= TAG_LIMIT):
                    self._stamp = cp.zeros(on_cpu.size, cp.int32)  # stream-ordered
                    self._tag = 0
                if not same_layer or not self._tag:  # a new tag: every expert counts once more
                    self._tag += 1
                tag = self._tag
            stamp, n_mask, mask = self._stamp.data.ptr, on_cpu.size, on_cpu.data.ptr
        p = self._p
        tptr = 0 if times is None else times.data.ptr
        self._launch(grid(max(R * H // 4, R * k)), THREADS, stream, (
            q.data.ptr, R * H // 4, d16.data.ptr, R * H // 32, ids.data.ptr, R, k,
            ids.strides[0] // 8, w.data.ptr, w.strides[0] // 4, mask, n_mask, first_cpu,
            p["xq"], p["xd"], p["ids"], p["w"], stamp, tag, self._distinct_p, p["ctrl"],
            p["header"], pool.num_workers, seq, layer, self._state_p, tptr, seq_p, tag_p))
        self._pending = (seq, layer, R, tptr, seq_p)
        self.last_seq = seq

    def gather(self, base=None):
        """Enqueue the wait for the workers of the last :meth:`launch` (on the GPU: it polls
        their ``SEQ_OUT``) and ``base + (p_0 + p_1 + ...)`` (``base``: ``[R, H]``, e.g. the
        GPU experts' output, or None for the partials' sum alone): the float32 additions of
        the host path, in its order. Returns that ``[R, H] float32`` array (valid once the
        stream gets there)."""
        if self._pending is None:
            raise RuntimeError("no launch() to gather")
        seq, layer, R, tptr, seq_p = self._pending
        self._pending = None
        cp, pool = self.cp, self.pool
        H, W = pool.hidden, pool.num_workers
        stream = cp.cuda.get_current_stream()
        p = self._p
        wait = (p["ctrl"], p["header"], W, seq, layer, self._state_p, self._errs_p,
                self.timeout_ns, self.poll_ns, tptr, seq_p)
        out = cp.empty((R, H), cp.float32)
        if base is not None and (base.dtype != np.float32 or not base.flags.c_contiguous):
            base = cp.ascontiguousarray(base, dtype=cp.float32)
        bptr = 0 if base is None else base.data.ptr
        self._wait(1, 32, stream, wait)
        # the sum reads the partials from the mapped ring with system-scope loads (sys = 1)
        stride = pool.ring.out.strides[0] // 4
        self._sum_parts(grid(R * H), THREADS, stream, (
            p["out"], stride, W, R * H, bptr, out.data.ptr, self._has_p, 1))
        return out

    # -- CUDA graphs (gpu_worker/step_graph.py) --------------------------------------------

    def begin_capture(self) -> None:
        """The launches until :meth:`end_capture` are being captured in a CUDA graph: they
        take sequence numbers and tags as offsets from bases written before each replay."""
        self._graph = [0, 0]

    def end_capture(self) -> tuple[int, int]:
        """Stop :meth:`begin_capture`; the captured launches and tags, for
        :meth:`before_replay`."""
        counts, self._graph = tuple(self._graph or (0, 0)), None
        return counts

    def before_replay(self, counts: tuple[int, int], stream) -> None:
        """Open the device session a replay's launches need (as :meth:`launch` does) and
        write its bases on ``stream`` (the graph's, before its launch): ``counts`` fresh
        sequence numbers from the pool and tags from this ring's count."""
        pool = self.pool
        launches, tags = counts
        if self._session is None:
            pool.device_begin()
            self._session = stream
        elif self._session.ptr != stream.ptr:
            raise RuntimeError("one stream per step: end_step() before changing streams")
        first = pool.next_seq(launches) if launches else 0
        if self._tag + tags >= TAG_LIMIT:
            self._stamp.fill(0)  # in place: the graph holds its address
            self._tag = 0
        tag0, self._tag = self._tag, self._tag + tags
        self._seq_base.set(np.array([first - 1], np.int64), stream=stream)
        self._tag_base.set(np.array([tag0], np.int32), stream=stream)

    def end_step(self) -> None:
        """Synchronize the session's stream and close the device session; raise
        :class:`CpuWorkerDied` if a worker died (the watchdog made the GPU stop waiting) or
        :class:`CpuExpertError` for the first layer a worker refused or that timed out."""
        if self._session is None:
            return
        stream, self._session, self._pending = self._session, None, None
        try:
            stream.synchronize()
        finally:
            self.pool.device_end()
        err, layer = (int(v) for v in self._errs)
        if not err:
            return
        self._errs[:] = 0
        if err == ERR_ABORTED or self.pool.aborted:
            self.pool.check_alive()  # raises CpuWorkerDied naming the worker
        raise status_error(layer, err, {
            ERR_TIMEOUT: f"no answer within {self.timeout_ns / 1e9:g} s",
            ERR_ABORTED: "a worker died"})

    def take_distinct(self) -> tuple[int, int, float]:
        """Since the last call, over launched layers: distinct experts summed over layers, the
        GPU's and the CPU's, and the workers' kernel time (the slowest worker's sum), ms."""
        gpu, cpu = (int(v) for v in self._distinct.get())
        self._distinct[...] = 0
        total = self.pool.kernel_total_ns()
        ms = float((total - self._kernel_ns0).max()) / 1e6
        self._kernel_ns0 = total
        return gpu, cpu, ms
