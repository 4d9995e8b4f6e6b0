"""Token sampling and draft matching on the GPU, bit-identical to gpu_worker/sampling.py.

One CTA of 1024 threads per logits row, all rows in one launch; every quantity is an integer
or a correctly rounded float64 op (gpu_worker/kernels/exact_math.py), so a row's token does
not depend on the other rows of the launch. Passes over a row [V]:

1. max logit (NaN ignored) and ``np.argmax`` (first NaN, else lowest id of the max): greedy
   rows (temperature 0) and rows whose logits are all -inf/NaN stop here;
2. masses q [V] into a scratch buffer, their sum and the count of positive ones;
3. top-k / top-p thresholds by radix selection on a 64-bit key ordered as (q desc, id asc):
   ``key = bits(double(q)) without exponent bias and the 12 zero low bits << 18 | (2**18 - 1
   - id)``, six passes of 11-bit digits, integer histograms (atomics on integers, so the
   result is order-independent); no sort;
4. kept masses summed over contiguous chunks, an exclusive scan, ``u = umulhi(draw64, Q)``,
   and the thread whose chunk holds u walks it to the token.

``match_drafts`` then compares each slot's drafts with its sampled rows, so only the token ids
and accepted counts come back to the host. Vocabularies up to 2**18 tokens (the id's bits in
the key); larger ones must use the host reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.exact_math import CUDA_SOURCE
from gpu_worker.sampling import sample
from protocol.messages import SamplingParams

THREADS = 1024
ID_BITS = 18
MAX_VOCAB = 1 << ID_BITS

_SOURCE = CUDA_SOURCE + r"""
#define THREADS 1024
#define BUCKETS 2048
#define FULL 0xffffffffu
#define NEG_INF __longlong_as_double(0xfff0000000000000LL)

struct Smem {
    unsigned long long hist[BUCKETS];  // one digit's histogram (counts or masses)
    unsigned long long red[33];        // per-warp partials; [32]: the block's total
    double rv[32];
    int ri[32];
    double rm[32];
    int pick;
    unsigned long long pick_above;
};

__device__ __forceinline__ unsigned long long key_of(long long q, int id) {
    unsigned long long b = (unsigned long long)__double_as_longlong((double)q);
    return (((b - (1023ULL << 52)) >> 12) << 18) | (unsigned long long)((1 << 18) - 1 - id);
}

__device__ unsigned long long block_sum(unsigned long long v, Smem& s) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) s.red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long t = 0;
        for (int i = 0; i < THREADS / 32; ++i) t += s.red[i];
        s.red[32] = t;
    }
    __syncthreads();
    return s.red[32];
}

// Exclusive prefix over threads in threadIdx order; *total: the sum over all threads.
__device__ unsigned long long block_scan(unsigned long long v, Smem& s,
                                         unsigned long long* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long x = v;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned long long y = __shfl_up_sync(FULL, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) s.red[warp] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long t = 0;
        for (int i = 0; i < THREADS / 32; ++i) {
            unsigned long long w = s.red[i];
            s.red[i] = t;
            t += w;
        }
        s.red[32] = t;
    }
    __syncthreads();
    *total = s.red[32];
    return s.red[warp] + x - v;
}

// np.argmax order: a NaN beats any number, then the larger value, then the lower id.
__device__ __forceinline__ bool better(double va, int ia, double vb, int ib) {
    bool na = isnan(va), nb = isnan(vb);
    if (na != nb) return na;
    if (!na && va != vb) return va > vb;
    return ia < ib;
}

// The key of the token whose weight ranked strictly before it (in key order, descending,
// among positive masses with key >= floor_key) is < target <= that plus its own weight;
// weight: 1 (by_mass = 0: the target-th largest key) or its mass. Needs target <= the
// candidates' total weight.
__device__ unsigned long long select_key(const long long* q, int V, int by_mass,
                                         unsigned long long target,
                                         unsigned long long floor_key, Smem& s) {
    unsigned long long prefix = 0, above = 0;
    for (int lvl = 0; lvl < 6; ++lvl) {
        int lo = lvl < 5 ? 53 - 11 * lvl : 0, width = lvl < 5 ? 11 : 9, hi = lo + width;
        for (int b = threadIdx.x; b < BUCKETS; b += THREADS) s.hist[b] = 0ULL;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += THREADS) {
            long long qi = q[i];
            if (qi <= 0) continue;
            unsigned long long key = key_of(qi, i);
            if (key < floor_key || (hi < 64 && (key >> hi) != (prefix >> hi))) continue;
            atomicAdd(&s.hist[(key >> lo) & ((1ULL << width) - 1ULL)],
                      by_mass ? (unsigned long long)qi : 1ULL);
        }
        __syncthreads();
        int b1 = BUCKETS - 1 - 2 * (int)threadIdx.x, b2 = b1 - 1;  // descending buckets
        unsigned long long h1 = s.hist[b1], h2 = s.hist[b2], tot;
        unsigned long long before = above + block_scan(h1 + h2, s, &tot);
        if (before < target && target <= before + h1) {
            s.pick = b1; s.pick_above = before;
        } else if (before + h1 < target && target <= before + h1 + h2) {
            s.pick = b2; s.pick_above = before + h1;
        }
        __syncthreads();
        prefix |= (unsigned long long)s.pick << lo;
        above = s.pick_above;
    }
    return prefix;
}

__device__ __forceinline__ bool kept(long long qi, int i, long long qmin,
                                     unsigned long long thr) {
    return qi > 0 && qi >= qmin && key_of(qi, i) >= thr;
}

template <typename T>
__device__ void sample_row(const T* z, int V, const double* fp, const long long* ip,
                           long long* q, int* out, Smem& s) {
    double temp = fp[0], top_p = fp[1], min_p = fp[2];
    long long top_k = ip[0];
    // 1. max (NaN ignored) and argmax
    double m = NEG_INF, bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += THREADS) {
        double v = (double)z[i];
        if (v > m) m = v;
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        m = fmax(m, __shfl_xor_sync(FULL, m, o));
        double ov = __shfl_xor_sync(FULL, bv, o);
        int oi = __shfl_xor_sync(FULL, bi, o);
        if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if ((threadIdx.x & 31) == 0) {
        s.rm[threadIdx.x >> 5] = m; s.rv[threadIdx.x >> 5] = bv; s.ri[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w) {
            s.rm[0] = fmax(s.rm[0], s.rm[w]);
            if (better(s.rv[w], s.ri[w], s.rv[0], s.ri[0])) {
                s.rv[0] = s.rv[w];
                s.ri[0] = s.ri[w];
            }
        }
    }
    __syncthreads();
    m = s.rm[0];
    if (temp == 0.0 || m == NEG_INF) {  // greedy, or nothing to weigh: np.argmax
        if (threadIdx.x == 0) *out = s.ri[0];
        return;
    }
    // 2. masses
    unsigned long long sum = 0, npos = 0;
    for (int i = threadIdx.x; i < V; i += THREADS) {
        long long qi = mass_of((double)z[i], m, temp);
        q[i] = qi;
        sum += (unsigned long long)qi;
        npos += qi > 0;
    }
    unsigned long long total = block_sum(sum, s);
    npos = block_sum(npos, s);
    // 3. thresholds: top-k, then top-p among the top-k, then min-p
    unsigned long long thr = 0;
    if (top_k > 0 && (unsigned long long)top_k < npos) {
        thr = select_key(q, V, 0, (unsigned long long)top_k, 0ULL, s);
        sum = 0;
        for (int i = threadIdx.x; i < V; i += THREADS)
            if (kept(q[i], i, 0, thr)) sum += (unsigned long long)q[i];
        total = block_sum(sum, s);
    }
    if (top_p < 1.0) thr = select_key(q, V, 1, ceil_times(top_p, total), thr, s);
    long long qmin = (long long)ceil(__dmul_rn(min_p, 1099511627776.0));
    // 4. the draw: chunk sums in vocabulary order, a scan, one thread walks its chunk
    int chunk = (V + THREADS - 1) / THREADS, b = threadIdx.x * chunk, e = min(b + chunk, V);
    unsigned long long part = 0;
    for (int i = b; i < e; ++i)
        if (kept(q[i], i, qmin, thr)) part += (unsigned long long)q[i];
    unsigned long long start = block_scan(part, s, &total);
    unsigned long long u = __umul64hi(
        draw64((unsigned long long)ip[1], (unsigned long long)ip[2], 0ULL), total);
    if (start <= u && u < start + part) {
        unsigned long long acc = start;
        for (int i = b; i < e; ++i) {
            if (kept(q[i], i, qmin, thr)) acc += (unsigned long long)q[i];
            if (acc > u) { *out = i; break; }
        }
    }
}

template <typename T>
__device__ void sample_rows(const T* logits, int V, const double* fparams,
                            const long long* iparams, long long* qbuf, int* out) {
    __shared__ Smem s;
    long long row = blockIdx.x;
    sample_row<T>(logits + row * V, V, fparams + 3 * row, iparams + 3 * row, qbuf + row * V,
                  out + row, s);
}

extern "C" {

__global__ void __launch_bounds__(THREADS, 1)
sample_rows_f32(const float* logits, int V, const double* fparams, const long long* iparams,
                long long* qbuf, int* out) {
    sample_rows<float>(logits, V, fparams, iparams, qbuf, out);
}

__global__ void __launch_bounds__(THREADS, 1)
sample_rows_f64(const double* logits, int V, const double* fparams, const long long* iparams,
                long long* qbuf, int* out) {
    sample_rows<double>(logits, V, fparams, iparams, qbuf, out);
}

// One thread per slot: drafts accepted while they equal the rows' sampled tokens.
// out [n + S]: tokens [n] (already written), then the S accepted counts.
__global__ void match_drafts(int n, int S, const int* row0, const int* ndraft,
                             const int* offset, const int* drafts, int* out) {
    int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= S) return;
    int a = 0;
    while (a < ndraft[s] && out[row0[s] + a] == drafts[offset[s] + a]) ++a;
    out[n + s] = a;
}

}
"""


def _module():
    return raw_module(_SOURCE, "GPU sampling kernels")


def pack_rows(temperature, top_k, top_p, min_p, seed, position) -> tuple[np.ndarray, np.ndarray]:
    """Per-row parameters (sequences of n) -> (float64 [n, 3]: temperature, top_p, min_p;
    int64 [n, 3]: top_k, seed, position), as the kernel reads them."""
    fp = np.stack([np.asarray(a, np.float64).reshape(-1) for a in (temperature, top_p, min_p)],
                  axis=1)
    ip = np.stack([np.asarray(a, np.int64).reshape(-1) for a in (top_k, seed, position)],
                  axis=1)
    if fp.shape != ip.shape:
        raise ValueError(f"per-row parameters of different lengths: {fp.shape} vs {ip.shape}")
    return np.ascontiguousarray(fp), np.ascontiguousarray(ip)


def params_rows(params: Sequence[SamplingParams], positions: Sequence[int]
                ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pack_rows` of one SamplingParams and absolute position per row."""
    return pack_rows([p.temperature for p in params], [p.top_k for p in params],
                     [p.top_p for p in params], [p.min_p for p in params],
                     [p.seed or 0 for p in params], positions)


def launch(logits, fp: np.ndarray, ip: np.ndarray, out=None):
    """Sample every row of ``logits [n, V]`` (CuPy float32/float64) with packed parameters
    (:func:`pack_rows`) into ``out`` (CuPy int32, first n entries; new when None)."""
    import cupy as cp  # noqa: PLC0415

    n, V = logits.shape
    if V > MAX_VOCAB:
        raise ValueError(f"GPU sampling handles vocabularies up to {MAX_VOCAB}, got {V}")
    if fp.shape != (n, 3):
        raise ValueError(f"{fp.shape[0]} rows of parameters for {n} rows of logits")
    name = {np.dtype(np.float32): "sample_rows_f32", np.dtype(np.float64): "sample_rows_f64"}
    if logits.dtype not in name:
        raise TypeError(f"logits must be float32 or float64, got {logits.dtype}")
    logits = cp.ascontiguousarray(logits)
    out = cp.empty(n, cp.int32) if out is None else out
    if n:
        qbuf = cp.empty((n, V), cp.int64)
        _module().get_function(name[logits.dtype])(
            (n,), (THREADS,), (logits, np.int32(V), cp.asarray(fp), cp.asarray(ip), qbuf, out))
    return out


def sample_rows(logits, temperature, top_k, top_p, min_p, seed, position):
    """Tokens (CuPy int32 [n]) of every row of ``logits [n, V]``; the other arguments are
    sequences of n per-row values (seed ignored where temperature is 0)."""
    return launch(logits, *pack_rows(temperature, top_k, top_p, min_p, seed, position))


def match_inputs(row0: Sequence[int], drafts: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """The draft matching's host arrays: int32 first rows [S], draft counts [S], offsets [S]
    into the flat draft ids [D + 1] (one spare entry: never empty)."""
    ndraft = np.array([len(d) for d in drafts], np.int32)
    offset = np.concatenate([[0], np.cumsum(ndraft)[:-1]]).astype(np.int32)
    flat = np.concatenate([np.asarray(d, np.int32).reshape(-1) for d in drafts]
                          + [np.zeros(1, np.int32)])
    return {"row0": np.asarray(row0, np.int32).reshape(-1), "ndraft": ndraft,
            "offset": offset[:ndraft.size], "drafts": flat}


def sample_and_match_device(logits, fp, ip, match: dict, out) -> None:
    """:func:`sample_and_match_rows` over device arrays only (a CUDA graph captures it):
    ``fp``/``ip`` the packed parameters (:func:`pack_rows`), ``match`` the arrays of
    :func:`match_inputs`, ``out`` int32 [n + S]."""
    n, S = logits.shape[0], match["row0"].size
    launch(logits, fp, ip, out)
    if S:
        _module().get_function("match_drafts")(
            (-(-S // 128),), (128,), (np.int32(n), np.int32(S), match["row0"],
                                      match["ndraft"], match["offset"], match["drafts"], out))


def sample_and_match_rows(logits, fp: np.ndarray, ip: np.ndarray, row0: Sequence[int],
                          drafts: Sequence[np.ndarray]):
    """Sample every row, then match each slot's drafts (slot s: rows ``row0[s]`` to
    ``row0[s] + len(drafts[s])``) on the device. Returns CuPy int32 [n + S]: the n sampled
    tokens, then each slot's accepted draft count."""
    import cupy as cp  # noqa: PLC0415

    n, S = logits.shape[0], len(row0)
    out = cp.empty(n + S, cp.int32)
    match = {k: cp.asarray(v) for k, v in match_inputs(row0, drafts).items()}
    sample_and_match_device(logits, cp.asarray(fp), cp.asarray(ip), match, out)
    return out


def sample_token(logits, params: SamplingParams, position: int) -> int:
    """The token of one logits row [V]: on the device for a CuPy row of a vocabulary the
    kernel takes, else by the NumPy reference (the same token either way)."""
    if isinstance(logits, np.ndarray) or logits.shape[-1] > MAX_VOCAB:
        return sample(logits if isinstance(logits, np.ndarray) else logits.get(), params,
                      position)
    fp, ip = params_rows([params], [position])
    return int(launch(logits.reshape(1, -1), fp, ip).get()[0])
