"""The CUDA side of the pinned ring (gpu_worker/experts/pinned_ring.py), one kernel per step
of a layer's dispatch: ``ring_launch`` (inputs into the ring, then ring the workers),
``ring_wait`` (poll the workers' ``SEQ_OUT``) and ``ring_gather`` (sum their partials).

The ring's layout constants and status codes are not retyped here: :data:`DEFINES` turns
``cpu_experts/rings.py``'s and ``cpu_experts/errors.py``'s into ``#define`` lines.
"""

from __future__ import annotations

import numpy as np

from cpu_experts import rings
from cpu_experts.errors import ERR_ABORTED, ERR_TIMEOUT
from gpu_worker.kernels import raw_module

THREADS = 256
KERNELS = ("ring_launch", "ring_wait", "ring_gather")

DEFINES = "".join(f"#define {name} {value}\n" for name, value in (
    ("CTRL_COLS", rings.CTRL_COLS), ("SEQ_IN", rings.SEQ_IN), ("SEQ_OUT", rings.SEQ_OUT),
    ("STATUS", rings.STATUS), ("CMD", rings.CMD), ("LAYER", rings.LAYER),
    ("ROWS", rings.ROWS), ("TOPK", rings.TOPK), ("ABORT", rings.ABORT),
    ("CMD_RUN", rings.CMD_RUN), ("ERR_TIMEOUT", ERR_TIMEOUT), ("ERR_ABORTED", ERR_ABORTED)))

_BODY = r"""
__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// One layer's inputs into the ring (see PinnedRing.launch); returns whether this thread saw
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
        else if (e == -1)     // no expert: a padded pass's padding row picks none
            rid = -1;
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
        unsigned long long* times, const long long* seq_base, const int* tag_base) {
    if (seq_base) seq += *seq_base;  // a CUDA graph: offsets from this step's bases
    if (tag_base) tag += *tag_base;
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
    h[CMD] = CMD_RUN; h[LAYER] = layer; h[ROWS] = rows; h[TOPK] = k;
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
                                     unsigned long long* times, const long long* seq_base) {
    if (!state[2]) return;
    if (seq_base) seq += *seq_base;
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
SOURCE = DEFINES + _BODY


def kernels() -> dict:
    """The compiled kernels by name (compiled once per process; needs CuPy)."""
    module = raw_module(SOURCE, "pinned-ring kernels")
    return {name: module.get_function(name) for name in KERNELS}


class Launch:
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


def grid(n: int) -> int:
    """Blocks of :data:`THREADS` for ``n`` items (at most 1024; grid-stride loops do the rest)."""
    return max(1, min(1024, -(-n // THREADS)))
