"""The GPU side of a CPU-expert dispatch on CuPy: the pool's ring as pinned, mapped host memory.

The ring (cpu_experts/rings.py) is registered with ``cudaHostRegister``. Where the device
can use a registered host pointer directly (``cudaDevAttrCanUseHostPointerForRegisteredMem``,
true on x86 Linux with UVA), GPU kernels read and write the ring themselves ("zero copy").

What a serving step uses (``ExpertPlacement`` on CuPy), all enqueued on the stream, the host
never waiting per layer:

1. :meth:`PinnedRing.launch`: one kernel writes the layer's quantized activations, fp16 scale
   bits, expert ids (mapped to the pool's local ids, -1 for experts on the GPU) and weights
   into the ring; its last block then writes the header and each worker's ``SEQ_IN`` (after
   system-scope fences). The workers spin on ``SEQ_IN`` during a device session, so they
   start without a system call;
2. the GPU computes its own experts meanwhile;
3. :meth:`PinnedRing.gather`: one single-block kernel polls the workers' ``SEQ_OUT`` (and
   gives up on ``header[ABORT]``, set by the pool's watchdog when a worker dies, or after a
   timeout), then the ``W`` partials come over by one ``cudaMemcpy2DAsync`` (or are read
   from the ring by the next kernel) and one kernel sums them in worker order onto the GPU
   experts' output: the same float32 additions as the host path (``CpuExpertPool.dispatch``
   then ``gpu + cpu``), so the same bits;
4. :meth:`PinnedRing.end_step` after the forward: synchronize, close the session, raise
   what a worker reported.

Kernels are launched through ``cuLaunchKernel`` from argument buffers made once
(:class:`_Launch`): CuPy's per-argument conversion cost more than the whole dispatch.
The synchronous :meth:`stage` / :meth:`start` / :meth:`collect` (host waits) remain for
comparison and for devices without registered-pointer access.
"""

from __future__ import annotations

import numpy as np

# cudaDeviceAttr: the device may use the host pointer of registered memory
CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
THREADS = 256
ERR_TIMEOUT, ERR_ABORTED = 201, 202  # as in _SOURCE
SYSTEM_LOADS = True  # partials read from the mapped ring by system-scope (volatile) loads
TAG_LIMIT = 1 << 30  # launches counted per stamp array before it is renewed

_SOURCE = r"""
#define CTRL_COLS 16
#define SEQ_IN 0
#define SEQ_OUT 8
#define STATUS 9
#define ABORT 5
#define CMD_RUN 1
#define ERR_TIMEOUT 201
#define ERR_ABORTED 202

__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One layer's inputs into the ring (see PinnedRing.stage); returns whether this thread saw
// a pair for the workers. With ``stamp``: counts distinct experts, GPU's and CPU's, into
// ``distinct`` (an expert counts once per ``tag``).
__device__ int stage_body(
        const int* __restrict__ q, long long nq4, const unsigned short* __restrict__ d,
        long long nd, const long long* __restrict__ ids, int rows, int k, long long ids_stride,
        const float* __restrict__ w, long long w_stride, const unsigned char* __restrict__ on_cpu,
        long long n_mask, int first_cpu, int* ring_q, unsigned short* ring_d, int* ring_ids,
        float* ring_w, int* gids, int* stamp, int tag, unsigned long long* distinct) {
    long long step = (long long)gridDim.x * blockDim.x;
    long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int mine = 0;
    for (long long i = start; i < nq4; i += step) ring_q[i] = q[i];
    for (long long i = start; i < nd; i += step) ring_d[i] = d[i];
    for (long long i = start; i < (long long)rows * k; i += step) {
        long long r = i / k, c = i % k;
        long long e = ids[r * ids_stride + c];
        int rid;
        if (gids) gids[i] = (int)e;
        if (!on_cpu)          // pool-local ids already: the workers check them
            rid = (int)e;
        else if (e < 0 || e >= n_mask)  // not an expert id: -2 makes the workers refuse it
            rid = -2;
        else
            rid = on_cpu[e] ? (int)(e - first_cpu) : -1;
        ring_ids[i] = rid;
        ring_w[i] = w[r * w_stride + c];
        mine |= rid != -1;
        if (stamp && on_cpu && e >= 0 && e < n_mask && atomicMax(&stamp[e], tag) < tag)
            atomicAdd(&distinct[on_cpu[e] ? 1 : 0], 1ULL);
    }
    return mine;
}

extern "C" __global__ void ring_stage(
        const int* __restrict__ q, long long nq4, const unsigned short* __restrict__ d,
        long long nd, const long long* __restrict__ ids, int rows, int k, long long ids_stride,
        const float* __restrict__ w, long long w_stride, const unsigned char* __restrict__ on_cpu,
        long long n_mask, int first_cpu, int* ring_q, unsigned short* ring_d, int* ring_ids,
        float* ring_w, int* gids) {
    stage_body(q, nq4, d, nd, ids, rows, k, ids_stride, w, w_stride, on_cpu, n_mask,
               first_cpu, ring_q, ring_d, ring_ids, ring_w, gids, 0, 0, 0);
}

// stage_body, then the last block to finish rings the workers: header, then SEQ_IN of each
// worker, each after a system-scope fence (every block fenced its own inputs first). With
// no pair for the workers nothing is rung and state[2] = 0 tells the wait to skip.
extern "C" __global__ void ring_launch(
        const int* __restrict__ q, long long nq4, const unsigned short* __restrict__ d,
        long long nd, const long long* __restrict__ ids, int rows, int k, long long ids_stride,
        const float* __restrict__ w, long long w_stride, const unsigned char* __restrict__ on_cpu,
        long long n_mask, int first_cpu, int* ring_q, unsigned short* ring_d, int* ring_ids,
        float* ring_w, int* stamp, int tag, unsigned long long* distinct, long long* ctrl,
        long long* header, int W, long long seq, int layer, int* state,
        unsigned long long* times) {
    int mine = stage_body(q, nq4, d, nd, ids, rows, k, ids_stride, w, w_stride, on_cpu,
                          n_mask, first_cpu, ring_q, ring_d, ring_ids, ring_w, 0, stamp, tag,
                          distinct);
    __threadfence_system();
    int any = __syncthreads_or(mine);
    if (threadIdx.x != 0) return;
    if (any) atomicOr(&state[1], 1);
    __threadfence();
    if (atomicAdd((unsigned int*)state, 1u) != gridDim.x - 1) return;
    int has = atomicExch(&state[1], 0);  // the last block: every input is in host memory
    state[0] = 0;
    state[2] = has;
    if (times) times[0] = now_ns();
    if (!has) return;
    volatile long long* h = header;
    h[0] = CMD_RUN; h[1] = layer; h[2] = rows; h[3] = k;
    __threadfence_system();
    volatile long long* c = ctrl;
    for (int v = 0; v < W; ++v) c[(long long)v * CTRL_COLS + SEQ_IN] = seq;
    __threadfence_system();
}

// Threads 0..W-1 each wait for one worker's SEQ_OUT == seq (or ABORT, or the timeout),
// polling every poll_ns; an error (a worker's STATUS, ERR_ABORTED, ERR_TIMEOUT) goes to
// errs[0], its layer to errs[1], unless one is there already: host memory, read after the
// stream is synchronized.
__device__ void wait_workers(const long long* ctrl, const long long* header, int W,
                             long long seq, int layer, int* errs, long long timeout_ns,
                             unsigned int poll_ns) {
    int v = threadIdx.x;
    if (v >= W) return;
    volatile const long long* c = ctrl + (long long)v * CTRL_COLS;
    volatile const long long* h = header;
    unsigned long long t0 = now_ns();
    int err = 0;
    while (c[SEQ_OUT] != seq) {
        if (h[ABORT]) { err = ERR_ABORTED; break; }
        if ((long long)(now_ns() - t0) > timeout_ns) { err = ERR_TIMEOUT; break; }
        __nanosleep(poll_ns);
    }
    if (!err) {
        __threadfence_system();
        err = (int)c[STATUS];
    }
    volatile int* e = errs;
    if (err && !e[0]) {
        e[1] = layer;
        __threadfence_system();
        e[0] = err;
    }
}

// ``times`` (optional): [1] = when every worker was seen done.
extern "C" __global__ void ring_wait(const long long* ctrl, const long long* header, int W,
                                     long long seq, int layer, const int* state, int* errs,
                                     long long timeout_ns, unsigned int poll_ns,
                                     unsigned long long* times) {
    if (!state[2]) return;
    wait_workers(ctrl, header, W, seq, layer, errs, timeout_ns, poll_ns);
    __syncthreads();
    if (times && threadIdx.x == 0) times[1] = now_ns();
}

// out = base + (p_0 + p_1 + ...), in worker order; with ``has`` and *has == 0 (no pair went
// to the workers) out = base (or 0).
// ``sys``: read the partials with system-scope loads (they sit in host memory that the
// workers wrote while the stream ran: no GPU cache may answer for them).
extern "C" __global__ void ring_gather(
        const float* parts, long long wstride, int W, long long n,
        const float* __restrict__ base, float* __restrict__ out, const int* has, int sys) {
    long long step = (long long)gridDim.x * blockDim.x;
    bool none = has && !*has;
    volatile const float* vp = parts;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        if (none) { out[i] = base ? base[i] : 0.0f; continue; }
        float s = sys ? vp[i] : parts[i];
        for (int v = 1; v < W; ++v) s += sys ? vp[v * wstride + i] : parts[v * wstride + i];
        out[i] = base ? base[i] + s : s;
    }
}

"""
_module = None


def _kernels(cp) -> dict:
    global _module
    if _module is None:
        _module = cp.RawModule(code=_SOURCE, options=("--fmad=false",))
    return {name: _module.get_function(name) for name in (
        "ring_stage", "ring_launch", "ring_wait", "ring_gather")}


class _Launch:
    """A kernel launched by ``cuLaunchKernel`` from one argument buffer made once: each
    argument is 8 bytes of ``vals`` (pointers and int64; an int32 argument reads the low 4
    bytes, little-endian), so a call is one numpy assignment and one driver call instead of
    CuPy's conversion of every argument (tens of microseconds per layer on the lent VMs)."""

    def __init__(self, cp, kernel, nargs: int) -> None:
        self.cp = cp
        self.kernel = kernel
        self.fn = getattr(kernel, "kernel", kernel).ptr
        self.vals = np.zeros(nargs, np.int64)
        self.params = np.arange(nargs, dtype=np.uint64) * 8 + np.uint64(self.vals.ctypes.data)
        self.params_ptr = int(self.params.ctypes.data)

    def __call__(self, grid: int, block: int, stream, args: tuple) -> None:
        self.vals[:] = args
        self.cp.cuda.driver.launchKernel(self.fn, grid, 1, 1, block, 1, 1, 0, stream.ptr,
                                         self.params_ptr, 0)


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
    ring. ``kernel_in``: inputs written into the ring by a kernel (posted writes over the
    bus) rather than by ``cudaMemcpyAsync``; ``kernel_out``: partials read from the ring by
    the summing kernel rather than copied by ``cudaMemcpy2DAsync`` first. Either needs a
    device that may use registered host pointers; None = wherever it can (measured faster
    on the launched path: docs/cpu_experts.md). ``timeout_s``: how long a GPU wait for the
    workers lasts before it reports an error. ``close()`` unregisters the ring (before the
    pool unmaps it).

    Two ways to run a layer:

    * synchronous: :meth:`stage` (the stream is synchronized), :meth:`start`, :meth:`collect`
      (the host waits for the workers);
    * from the stream (needs ``kernel_in``): :meth:`launch` and :meth:`gather` only enqueue
      kernels; the GPU rings the workers and waits for them, the host never waits per layer.
      The first launch opens a device session of the pool (the workers spin on the ring);
      :meth:`end_step` synchronizes the stream, closes it and raises what went wrong.
    """

    def __init__(self, pool, cupy, kernel_in: bool | None = None,
                 kernel_out: bool | None = None, timeout_s: float = 30.0) -> None:
        if pool.num_workers > 32:
            raise ValueError("at most 32 workers per pool (one GPU thread waits on each)")
        self.pool, self.cp = pool, cupy
        self.addr, self.nbytes = pool.ring_region()
        rt = cupy.cuda.runtime
        rt.hostRegister(self.addr, self.nbytes, 0)
        can = bool(rt.deviceGetAttribute(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                                          cupy.cuda.Device().id))
        self.kernel_in = can if kernel_in is None else bool(kernel_in and can)
        self.kernel_out = can if kernel_out is None else bool(kernel_out and can)
        self.timeout_ns = int(timeout_s * 1e9)
        self._k = _kernels(cupy)
        W, H = pool.num_workers, pool.hidden
        self._parts = cupy.empty((W, pool.max_rows, H), cupy.float32)  # partials, on the GPU
        self._stream = None  # the stream of the last collect
        n = pool.ring.ids.size  # global ids of the staged pairs, in pinned (mapped) memory
        self._gids_mem = cupy.cuda.alloc_pinned_memory(4 * n)
        self._gids = np.frombuffer(self._gids_mem, np.int32, n)
        # launch/gather: [blocks done, any pair for the workers, this layer has one];
        # distinct experts (GPU's, CPU's) since take_distinct; per-expert stamps
        self._state = cupy.zeros(8, cupy.int32)
        self._distinct = cupy.zeros(2, cupy.uint64)
        self._stamp = cupy.zeros(0, cupy.int32)
        self._tag = 0
        self._session = None  # the stream of the open device session
        self._pending: tuple | None = None  # (seq, layer, rows, times) to gather
        self.last_seq = 0  # the sequence number of the last launch
        self._kernel_ns0 = pool.kernel_total_ns()
        self.poll_ns = 1000  # how often a waiting kernel reads SEQ_OUT (over the bus)
        self._p = self._ptrs()
        self._state_p = self._state.data.ptr
        self._has_p = self._state_p + 8  # &state[2]
        self._distinct_p = self._distinct.data.ptr
        # errors of the waits (error, layer): pinned host memory the kernels write
        self._errs_mem = cupy.cuda.alloc_pinned_memory(8)
        self._errs = np.frombuffer(self._errs_mem, np.int32, 2)
        self._errs[:] = 0
        self._errs_p = self._errs.ctypes.data
        self._launch = _Launch(cupy, self._k["ring_launch"], 27)
        self._wait = _Launch(cupy, self._k["ring_wait"], 10)
        self._sum_parts = _Launch(cupy, self._k["ring_gather"], 8)

    def close(self) -> None:
        if self.addr:
            try:
                self.end_step()
            except Exception:  # noqa: BLE001 -- closing: the pool reports dead workers itself
                pass
            if self._stream is not None:
                self._stream.synchronize()
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

    def _inputs(self, q, d16, ids, weights):
        """:meth:`_arrays`, and the ring's views for them."""
        q, d16, ids, w = self._arrays(q, d16, ids, weights)
        R, k = ids.shape
        ring = self.pool.ring
        ids_v, w_v = ring.pairs(R, k)
        return q, d16, ids, w, (ring.xq[:R], ring.xd[:R], ids_v, w_v)

    @staticmethod
    def _stage_args(q, d16, ids, w, on_cpu, first_cpu: int, views) -> tuple:
        R, k = ids.shape
        xq, xd, ids_v, w_v = views
        return (q, np.int64(q.size // 4), d16, np.int64(d16.size), ids, np.int32(R),
                np.int32(k), np.int64(ids.strides[0] // 8), w, np.int64(w.strides[0] // 4),
                np.uint64(0) if on_cpu is None else on_cpu,
                np.int64(0 if on_cpu is None else on_cpu.size), np.int32(first_cpu),
                np.uint64(xq.ctypes.data), np.uint64(xd.ctypes.data),
                np.uint64(ids_v.ctypes.data), np.uint64(w_v.ctypes.data))

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
        self.pool.inputs(R, k)  # refuses a load in flight or a device session
        q, d16, ids, w, views = self._inputs(q, d16, ids, weights)
        xq, xd, ids_v, w_v = views
        stream = cp.cuda.get_current_stream()
        if self._stream is not None and self._stream.ptr != stream.ptr:
            self._stream.synchronize()  # the last gather must be done reading the ring
        gids = self._gids[:R * k].reshape(R, k)
        if self.kernel_in:
            self._k["ring_stage"](_grid(max(q.size // 4, R * k)), (THREADS,), (
                *self._stage_args(q, d16, ids, w, on_cpu, first_cpu, views),
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
        parts = self.pool.finish()  # [W, R, H] view of the pinned ring
        self._stream = self.cp.cuda.get_current_stream()
        return self._sum(parts.shape[1], base, 0)

    def _base(self, base):
        if base is None:
            return None
        base = _as(self.cp, base, self.cp.float32, 4)
        return base if base.flags.c_contiguous else self.cp.ascontiguousarray(base)

    def _sum(self, R: int, base, has: int):
        """Enqueue ``base + sum of the partials`` (copied by DMA first unless kernel_out)."""
        cp = self.cp
        W, H = self.pool.num_workers, self.pool.hidden
        parts = self.pool.ring.out
        stream = cp.cuda.get_current_stream()
        out = cp.empty((R, H), cp.float32)
        base = self._base(base)
        if self.kernel_out:
            src, stride = np.uint64(parts.ctypes.data), parts.strides[0] // 4
        else:
            dev = self._parts
            rt = cp.cuda.runtime
            rt.memcpy2DAsync(dev.data.ptr, dev.strides[0], parts.ctypes.data, parts.strides[0],
                             R * H * 4, W, rt.memcpyHostToDevice, stream.ptr)
            src, stride = dev, dev.strides[0] // 4
        self._k["ring_gather"](_grid(R * H), (THREADS,), (
            src, np.int64(stride), np.int32(W), np.int64(R * H),
            base if base is not None else np.uint64(0), out, np.uint64(has),
            np.int32(self.kernel_out and SYSTEM_LOADS)), stream=stream)
        return out

    # -- from the stream: launch / gather / end_step ---------------------------------------
    # NOTE: these run once per MoE layer on the host, ahead of the stream: kernel arguments
    # are raw pointers and scalars (no CuPy array marshalling), the ring's are made once.

    def _ptrs(self) -> dict:
        ring = self.pool.ring
        return {name: int(getattr(ring, name).ctypes.data)
                for name in ("xq", "xd", "ids", "w", "ctrl", "header", "out")}

    def launch(self, layer: int, q, d16, ids, weights, on_cpu=None, first_cpu: int = 0,
               times=None) -> None:
        """Enqueue one layer on the current stream and return: the ``ring_launch`` kernel
        writes the inputs as :meth:`stage` does, then (if any pair is the workers') the
        header and every worker's ``SEQ_IN``. Then enqueue the GPU's own work, then
        :meth:`gather`. Also counts the distinct experts (:meth:`take_distinct`). ``times``:
        an optional uint64 CuPy array of 2, given the GPU clock (ns) when the workers were
        rung and when they were seen done (for benchmarks)."""
        cp, pool = self.cp, self.pool
        if not self.kernel_in:
            raise RuntimeError("launch() needs a device that may use registered host memory")
        if self._pending is not None:
            raise RuntimeError("gather() the last launch() first")
        if layer not in pool.layers:
            raise KeyError(f"layer {layer} has no CPU experts (have {sorted(pool.layers)})")
        q, d16, ids, w = self._arrays(q, d16, ids, weights)
        R, k = ids.shape
        H = pool.hidden
        stream = cp.cuda.get_current_stream()
        if self._session is None:
            if self._stream is not None:
                self._stream.synchronize()  # a synchronous collect may still read the ring
            pool.device_begin()
            self._session = stream
        elif self._session.ptr != stream.ptr:
            raise RuntimeError("one stream per step: end_step() before changing streams")
        seq = pool.next_seq()
        stamp = n_mask = mask = 0
        if on_cpu is not None:
            if self._stamp.size < on_cpu.size or self._tag >= TAG_LIMIT:
                self._stamp = cp.zeros(on_cpu.size, cp.int32)  # stream-ordered after its users
                self._tag = 0
            self._tag += 1
            stamp, n_mask, mask = self._stamp.data.ptr, on_cpu.size, on_cpu.data.ptr
        p = self._p
        tptr = 0 if times is None else times.data.ptr
        self._launch(_grid(max(R * H // 4, R * k))[0], THREADS, stream, (
            q.data.ptr, R * H // 4, d16.data.ptr, R * H // 32, ids.data.ptr, R, k,
            ids.strides[0] // 8, w.data.ptr, w.strides[0] // 4, mask, n_mask, first_cpu,
            p["xq"], p["xd"], p["ids"], p["w"], stamp, self._tag, self._distinct_p, p["ctrl"],
            p["header"], pool.num_workers, seq, layer, self._state_p, tptr))
        self._pending = (seq, layer, R, tptr)
        self.last_seq = seq

    def gather(self, base=None):
        """Enqueue the wait for the workers of the last :meth:`launch` (on the GPU: it polls
        their ``SEQ_OUT``) and ``base + (p_0 + p_1 + ...)``, as :meth:`collect`; returns that
        ``[R, H] float32`` array (valid once the stream gets there)."""
        if self._pending is None:
            raise RuntimeError("no launch() to gather")
        seq, layer, R, tptr = self._pending
        self._pending = None
        cp, pool = self.cp, self.pool
        H, W = pool.hidden, pool.num_workers
        stream = cp.cuda.get_current_stream()
        p = self._p
        wait = (p["ctrl"], p["header"], W, seq, layer, self._state_p, self._errs_p,
                self.timeout_ns, self.poll_ns, tptr)
        out = cp.empty((R, H), cp.float32)
        if base is not None and (base.dtype != np.float32 or not base.flags.c_contiguous):
            base = cp.ascontiguousarray(base, dtype=cp.float32)
        bptr = 0 if base is None else base.data.ptr
        self._wait(1, 32, stream, wait)
        stride = pool.ring.out.strides[0]
        if self.kernel_out:  # the sum reads the partials from the mapped ring
            src, src_stride = p["out"], stride // 4
        else:
            dev = self._parts
            rt = cp.cuda.runtime
            rt.memcpy2DAsync(dev.data.ptr, dev.strides[0], p["out"], stride, R * H * 4, W,
                             rt.memcpyHostToDevice, stream.ptr)
            src, src_stride = dev.data.ptr, dev.strides[0] // 4
        self._sum_parts(_grid(R * H)[0], THREADS, stream, (
            src, src_stride, W, R * H, bptr, out.data.ptr, self._has_p,
            int(self.kernel_out and SYSTEM_LOADS)))
        return out

    def end_step(self) -> None:
        """Synchronize the session's stream and close the device session; raise
        :class:`CpuWorkerDied` if a worker died (the watchdog made the GPU stop waiting) or
        :class:`CpuExpertError` for the first layer a worker refused or that timed out."""
        from cpu_experts.pool import status_error  # noqa: PLC0415

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
