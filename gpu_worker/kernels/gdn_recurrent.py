"""Gated DeltaNet on the GPU: every slot and row of a step in two launches (CuPy RawKernels).

1. ``gdn_conv``, one thread per (segment, channel), the segment's rows in order: the causal
   depthwise conv over [the slot's conv window | the segment's rows], then SiLU; the thread
   keeps the last K-1 inputs in registers and writes them back as the slot's new window (and,
   for a tracked segment, the window after every row). The first block of each segment also
   computes its rows' gates, a thread per value head: beta = sigmoid(b) and decay =
   exp(-exp(A_log) * softplus(a + dt_bias)), softplus(x) = x above 20, else
   max(x, 0) + log1p(exp(-|x|)), its log1p ``log1p01``: 2 atanh(y / (2 + y)) by a fixed odd
   series (7 terms in float32, 16 in float64; within 3 ulps of log1p on [0, 1], softplus
   within 4 ulps of log(1 + e^x)). They were a launch of their own (``gdn_gates``) with the
   same code and options, so the same bits; the recurrence, which took them first, spilled
   (nvcc 13, sm_90: 216 bytes at 254 registers, none without them).
2. ``gdn_recurrent``, one block of ``TILE`` threads per (segment, value head, Dv tile), thread
   j holding the state column S[:, j] (Dk values) in registers, rows in order: q and k of the
   row's key head l2-normalised (sum of squares by a fixed halving tree), then
   ``S <- decay S; m = k^T S; S <- S + k (beta (v - m))^T; o = q^T S``, each dot product over
   Dk as four interleaved sequential partial sums ``((a0 + a1) + (a2 + a3))``. The final state
   goes back to the slot; a tracked segment's state after every row goes to a T-row buffer
   (gpu_worker/states.py). In a partial tile (Dv not a multiple of TILE) the threads past Dv
   compute on zeros and store nothing: every thread reaches every barrier (a ``__syncwarp()``
   that some lanes skip deadlocks the block; tests/unit/test_gdn_reference.py checks the
   source for barriers under a condition).

A segment whose slot in the table is -1 has no state: its conv window and delta-rule state
start at zero and nothing of them is stored (a padded pass's padding rows,
gpu_worker/graph_buckets.py: they read and write no state memory).

Every value of a row depends only on its own segment (its slot's state and earlier rows), in an
order fixed by the shapes: a row's output and the states are the same bits alone or in any
layout of slots. The arithmetic is + - * / and sqrt only, compiled with ``--fmad=false``, so
gpu_worker/kernels/gdn_reference.py reproduces it bit for bit in NumPy; the exp of SiLU and
the gates is ``exp_neg``: Cody-Waite reduction and a Taylor polynomial (degree 7 in float32, 13 in
float64, within ~1 ulp of exp), 0 below -87 (float32) / -708 (float64); the same formula
holds for u > 0 up to 88 / 709 (exp(A_log) in the gates).

Registers (ptxas, sm_90): float32 with Dk 128 uses 188 per thread, no spill; float64 (the exact
test dtype) and Dk 256 spill to local memory, correct but slower. The segment table is uploaded
once per forward (RecurrentStates.segment_table); a CUDA graph will need it in a static buffer.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from gpu_worker.kernels import raw_module

TILE = 32  # threads (state columns) per recurrence block
CONV_THREADS = 128  # channels per conv block
MAX_KEY_DIM = 256  # S[:, j] lives in registers: Dk values per thread
L2_EPS = 1e-6  # inside the l2norm's square root, as gpu_worker/model/gdn.py


def exp_constants(dtype) -> dict:
    """exp_neg's constants for ``dtype`` (float32 or float64): the same values in the kernel
    source and in the NumPy reference."""
    t = np.dtype(dtype).type
    # ln2 = ln2_hi + ln2_lo to well beyond the dtype's precision, n * ln2_hi exact
    if t is np.float32:
        under, degree, bias, shift = -87.0, 7, 127, 23
        ln2_hi, ln2_lo = 0.693359375, math.log(2) - 0.693359375
    else:  # fdlibm's split
        under, degree, bias, shift = -708.0, 13, 1023, 52
        ln2_hi, ln2_lo = 6.93147180369123816490e-01, 1.90821492927058770002e-10
    return {"under": t(under), "log2e": t(1 / math.log(2)), "ln2_hi": t(ln2_hi),
            "ln2_lo": t(ln2_lo), "bias": bias, "shift": shift,
            "coeffs": [t(1 / math.factorial(k)) for k in range(degree + 1)]}


def log1p_constants(dtype) -> dict:
    """log1p01's constants for ``dtype``: below ``tiny`` log1p(y) rounds to y; ``coeffs``
    1/3, 1/5, ... of atanh(s) / s - 1 in s^2, enough terms that the first one left out,
    s^(2k+1) / (2k+1) <= (1/9)^k / (2k+1), is under a quarter ulp of 2s (7 / 16 terms)."""
    t = np.dtype(dtype).type
    f32 = t is np.float32
    return {"tiny": t(2.0 ** (-30 if f32 else -60)),
            "coeffs": [t(1 / (2 * k + 1)) for k in range(1, (7 if f32 else 16) + 1)]}


def _horner(coeffs: list, var: str, real: str) -> str:
    """c0 + var * (c1 + var * (...)) as C, innermost first as the NumPy twin's loop."""
    lit = [_literal(v, real) for v in coeffs]
    out = lit[-1]
    for v in reversed(lit[:-1]):
        out = f"({out}) * {var} + {v}"
    return f"({out})"


def _literal(v, real: str) -> str:
    return repr(float(v)) + ("f" if real == "float" else "")


_HELPERS = r"""
__device__ __forceinline__ T exp_neg(T u) {  // exp(u) for u <= 0 from + - * only
    if (!(u >= UNDER)) return (T)0;
    T n = RINT(u * LOG2E);
    T r = u - n * LN2_HI;
    r = r - n * LN2_LO;
    T p = HORNER;
    return p * POW2((int)n);
}

__device__ __forceinline__ T sigmoid(T x) {  // as Ops.sigmoid: split by sign
    T e = exp_neg(-fabs(x));
    return x >= (T)0 ? (T)1 / ((T)1 + e) : e / ((T)1 + e);
}

__device__ __forceinline__ T silu(T x) { return x * sigmoid(x); }  // as Ops.silu

"""

_GATE_HELPERS = r"""
__device__ __forceinline__ T log1p01(T y) {  // log1p(y) for 0 <= y <= 1 from + - * / only
    if (y < LOG1P_TINY) return y;  // y - y^2/2 rounds to y; s, s * s below stay normal
    T s = y / ((T)2 + y);  // log1p(y) = 2 atanh(s), 0 <= s <= 1/3
    T s2 = s * s;
    T p = LOG1P_HORNER;
    return (T)2 * (s + s * (s2 * p));
}

__device__ __forceinline__ T softplus(T x) {  // Ops.softplus as max(x, 0) + log1p(exp(-|x|))
    if (x > (T)20) return x;
    T m = x > (T)0 ? x : (T)0;
    return m + log1p01(exp_neg(-fabs(x)));
}

// beta and decay of one (row, value head); bar: the row's b of the head (its a is r values on)
// NOTE: -ftz=true cannot change a bit here. exp_neg's results are normal or 0 (its cutoff),
// so are sigmoid's and log1p01's (a tiny y is returned as is); the one product that can be
// subnormal, A * softplus, only feeds exp_neg, which gives exactly 1 for |u| < 2^-25 either
// way. A subnormal input is absorbed the same way: sigmoid's and exp_neg's argument, or an
// addend of a + dt_bias far below the other's ulp (or softplus(~0) = ln 2 + ~0 = ln 2).
__device__ __forceinline__ void gates(const T* bar, int r, T a_log, T dt_bias, T* beta,
                                      T* decay) {
    *beta = sigmoid(bar[0]);
    T A = exp_neg(a_log);  // exp(A_log): exp_neg's formula holds up to 88 / 709
    *decay = exp_neg(-(A * softplus(bar[r] + dt_bias)));
}
"""

_CONV = r"""
// grid (segments, ceil(C / blockDim.x)); seg[4 s..]: slot (-1: none, a zero window that is
// not kept), row0, rows, first T-row or -1; ba [R, Hk, 2r]: a key head's r b-values, then its
// r a-values -> beta, decay [R, Hv] (Hv 0: no gates)
extern "C" __global__ void gdn_conv(const T* x, const T* w, T* win, T* win_track, T* y,
                                    const int* seg, int C, const T* ba, const T* a_log,
                                    const T* dt_bias, T* beta, T* decay, int Hv, int r) {
    int s = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    int slot = seg[4 * s], row0 = seg[4 * s + 1], n = seg[4 * s + 2], track = seg[4 * s + 3];
    if (blockIdx.y == 0) {  // the segment's gates, a thread per value head
        for (int hv = threadIdx.x; hv < Hv; hv += blockDim.x) {
            for (int t = 0; t < n; ++t) {
                long long row = row0 + t;
                gates(ba + row * 2 * Hv + (long long)(hv / r) * 2 * r + hv % r, r, a_log[hv],
                      dt_bias[hv], beta + row * Hv + hv, decay + row * Hv + hv);
            }
        }
    }
    if (c >= C) return;
    bool keep = slot >= 0;
    T wc[KW], h[KW];  // h: the window (oldest first), then the current row's input
#pragma unroll
    for (int j = 0; j < KW; ++j) wc[j] = w[(long long)c * KW + j];
    T* ws = win + (long long)(keep ? slot : 0) * (KW - 1) * C + c;
#pragma unroll
    for (int j = 0; j < KW - 1; ++j) h[j] = ws[(long long)j * C];
#pragma unroll
    for (int j = 0; j < KW - 1; ++j) h[j] = keep ? h[j] : (T)0;
    for (int t = 0; t < n; ++t) {
        long long row = row0 + t;
        h[KW - 1] = x[row * C + c];
        T acc = (T)0;
#pragma unroll
        for (int j = 0; j < KW; ++j) acc = acc + h[j] * wc[j];
        y[row * C + c] = silu(acc);
#pragma unroll
        for (int j = 0; j < KW - 1; ++j) h[j] = h[j + 1];
        if (track >= 0) {
            T* wt = win_track + (long long)(track + t) * (KW - 1) * C + c;
#pragma unroll
            for (int j = 0; j < KW - 1; ++j) wt[(long long)j * C] = h[j];
        }
    }
    if (keep) {
#pragma unroll
        for (int j = 0; j < KW - 1; ++j) ws[(long long)j * C] = h[j];
    }
}
"""

_RECURRENT = r"""
// grid (segments, Hv, ceil(Dv / blockDim.x)); y [R, C]: q (Hk*DK) | k (Hk*DK) | v (Hv*Dv)
extern "C" __global__ void gdn_recurrent(const T* y, const T* decay, const T* beta,
                                         T* state, T* state_track, T* out, const int* seg,
                                         int C, int Hk, int Hv, int Dv, T scale) {
    __shared__ T qs[DKP], ks[DKP], sq[DKP], sk[DKP];
    int s = blockIdx.x, hv = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    int j = blockIdx.z * nt + tid;
    // NOTE: the threads of a partial Dv tile past Dv (on = false) run every row's arithmetic
    // on zeros and store nothing: all threads must reach the __syncwarp below (a divergent
    // __syncwarp() waits for the lanes that went on to __syncthreads(): the block deadlocks)
    bool on = j < Dv;
    int slot = seg[4 * s], row0 = seg[4 * s + 1], n = seg[4 * s + 2], track = seg[4 * s + 3];
    bool keep = slot >= 0;  // -1: no slot, a zero state that is not kept
    int hk = hv / (Hv / Hk);
    T S[DK];
    T* st = state + ((long long)(keep ? slot : 0) * Hv + hv) * DK * Dv + (on ? j : 0);
    // NOTE: loads unconditional (st points into the state when on is false too), so the DK
    // loads are issued together; a load under a condition is a branch, one load at a time
#pragma unroll
    for (int i = 0; i < DK; ++i) S[i] = st[(long long)i * Dv];
#pragma unroll
    for (int i = 0; i < DK; ++i) S[i] = on && keep ? S[i] : (T)0;
    for (int t = 0; t < n; ++t) {
        long long row = row0 + t;
        const T* qr = y + row * C + (long long)hk * DK;
        const T* kr = qr + (long long)Hk * DK;
        for (int i = tid; i < DKP; i += nt) {
            T a = i < DK ? qr[i] : (T)0, b = i < DK ? kr[i] : (T)0;
            qs[i] = a; ks[i] = b; sq[i] = a * a; sk[i] = b * b;
        }
        __syncthreads();
        for (int half = DKP / 2; half > 0; half >>= 1) {
            for (int i = tid; i < half; i += nt) {
                sq[i] = sq[i] + sq[i + half];
                sk[i] = sk[i] + sk[i + half];
            }
            __syncthreads();
        }
        T nq = SQRT(sq[0] + EPS), nk = SQRT(sk[0] + EPS);
        for (int i = tid; i < DK; i += nt) {
            qs[i] = (qs[i] / nq) * scale;
            ks[i] = ks[i] / nk;
        }
        __syncthreads();
        T dec = decay[row * Hv + hv], b = beta[row * Hv + hv];
        T v = y[row * C + 2LL * Hk * DK + (long long)hv * Dv + (on ? j : 0)];
        v = on ? v : (T)0;
        T a[4] = {(T)0, (T)0, (T)0, (T)0};
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            S[i] = S[i] * dec;
            a[i & 3] = a[i & 3] + ks[i] * S[i];
        }
        // NOTE: makes the second loop re-read ks from shared memory instead of keeping
        // all Dk of them in registers next to S (float32, Dk 128: 188 registers, no spill)
        __syncwarp();
        T d = b * (v - ((a[0] + a[1]) + (a[2] + a[3])));
        T o[4] = {(T)0, (T)0, (T)0, (T)0};
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            S[i] = S[i] + ks[i] * d;
            o[i & 3] = o[i & 3] + qs[i] * S[i];
        }
        if (on) {
            out[(row * Hv + hv) * Dv + j] = (o[0] + o[1]) + (o[2] + o[3]);
            if (track >= 0) {
                T* tr = state_track + ((long long)(track + t) * Hv + hv) * DK * Dv + j;
#pragma unroll
                for (int i = 0; i < DK; ++i) tr[(long long)i * Dv] = S[i];
            }
        }
        __syncthreads();  // qs / ks / sq / sk are the next row's
    }
    if (on && keep) {
#pragma unroll
        for (int i = 0; i < DK; ++i) st[(long long)i * Dv] = S[i];
    }
}
"""


def source(dtype, *, conv_kernel: int | None = None, key_dim: int | None = None) -> str:
    """The CUDA source of ``gdn_conv`` (the gates included) for a K-tap conv
    (``conv_kernel``) or of ``gdn_recurrent`` for Dk = ``key_dim``, in ``dtype`` (float32 or
    float64)."""
    real = "float" if np.dtype(dtype) == np.float32 else "double"
    c, lc = exp_constants(dtype), log1p_constants(dtype)
    pow2 = ("__int_as_float((k + 127) << 23)" if real == "float"
            else "__longlong_as_double((long long)(k + 1023) << 52)")
    defines = {
        "UNDER": _literal(c["under"], real), "LOG2E": _literal(c["log2e"], real),
        "LN2_HI": _literal(c["ln2_hi"], real), "LN2_LO": _literal(c["ln2_lo"], real),
        "HORNER": _horner(c["coeffs"], "r", real), "RINT": "rintf" if real == "float" else "rint",
        "EPS": _literal(np.dtype(dtype).type(L2_EPS), real),
        "SQRT": "sqrtf" if real == "float" else "sqrt"}
    if conv_kernel is not None:
        defines.update(KW=str(conv_kernel), LOG1P_TINY=_literal(lc["tiny"], real),
                       LOG1P_HORNER=_horner(lc["coeffs"], "s2", real))
    if key_dim is not None:
        defines.update(DK=str(key_dim), DKP=str(1 << (key_dim - 1).bit_length()))
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    head += f"typedef {real} T;\n__device__ __forceinline__ T POW2(int k) {{ return {pow2}; }}\n"
    body = _GATE_HELPERS + _CONV if conv_kernel is not None else _RECURRENT
    return head + _HELPERS + body


def supports(dtype, key_dim: int, conv_kernel: int) -> bool:
    """Whether the kernels take this layer: float32/float64, Dk <= MAX_KEY_DIM, K >= 2."""
    return (np.dtype(dtype) in (np.float32, np.float64) and 0 < key_dim <= MAX_KEY_DIM
            and conv_kernel >= 2)


@functools.cache
def _function(name: str, dtype, **shape: int):
    # NOTE: cached, so a step pays neither the source's formatting nor a module lookup
    return raw_module(source(dtype, **shape), "Gated DeltaNet kernels").get_function(name)


def conv_silu(x, weight, window, table, track=None, gates=None):
    """``silu(causal depthwise conv)`` of every segment's rows: x [R, C] raw conv inputs,
    weight [C, K], window [slots, K-1, C] (the layer's conv state: C-contiguous, updated in
    place), table [segments, 4] int32 (RecurrentStates.segment_table: slot -1 a zero window
    that is not kept), track [T, K-1, C] or None (the window after every tracked row) ->
    y [R, C]. ``gates``: ``(ba, a_log, dt_bias, key_heads)``, ba [R, Hk * 2r] (in_proj_ba's
    output: per key head its r b-values, then its r a-values), a_log and dt_bias [Hv]; then
    ``(y, beta, decay)``, beta = sigmoid(b) and decay = exp(-exp(A_log) * softplus(a +
    dt_bias)) [R, Hv] of the segments' rows, as gpu_worker/model/gdn.py's token loop but with
    this module's exp and log1p (gdn_reference.gates: the same bits). One launch, no sync."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    R, C = x.shape
    K = weight.shape[1]
    dt = x.dtype
    _check(window, (window.shape[0], K - 1, C), dt, "window")
    if track is not None:
        _check(track, (track.shape[0], K - 1, C), dt, "track")
    y = cp.empty((R, C), dt)
    Hv, r, extra = 0, 1, (y, y, y, y, y)  # no gates: Hv 0 (the pointers are never read)
    if gates is not None:
        ba, a_log, dt_bias, key_heads = gates
        Hv = a_log.shape[0]
        if ba.shape != (R, 2 * Hv) or Hv % key_heads or dt_bias.shape != (Hv,):
            raise ValueError(f"ba {ba.shape}, A_log {a_log.shape}, dt_bias {dt_bias.shape}, "
                             f"key heads {key_heads} do not fit")
        r = Hv // key_heads
        beta, decay = cp.empty((R, Hv), dt), cp.empty((R, Hv), dt)
        extra = (*(cp.ascontiguousarray(a, dtype=dt) for a in (ba, a_log, dt_bias)), beta,
                 decay)
    if R and table.shape[0]:
        x = cp.ascontiguousarray(x)
        weight = cp.ascontiguousarray(weight, dtype=dt)
        fn = _function("gdn_conv", np.dtype(dt), conv_kernel=K)
        fn((table.shape[0], -(-C // CONV_THREADS)), (CONV_THREADS,),
           (x, weight, window, window if track is None else track, y, table, np.int32(C),
            *extra, np.int32(Hv), np.int32(r)))
    return y if gates is None else (y, extra[3], extra[4])


def recurrence(y, decay, beta, state, table, *, key_heads: int, scale: float, track=None):
    """The delta rule over every segment's rows: y [R, C] (``conv_silu``'s output), decay and
    beta [R, Hv], state [slots, Hv, Dk, Dv] (the layer's delta-rule state: C-contiguous,
    updated in place), table as ``conv_silu``, track [T, Hv, Dk, Dv] or None (the state after
    every tracked row) -> out [R, Hv, Dv]. ``scale``: q's factor after the l2norm (Dk^-0.5).
    One launch, no sync."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    R, C = y.shape
    _, Hv, Dk, Dv = state.shape
    dt = y.dtype
    if C != 2 * key_heads * Dk + Hv * Dv or Hv % key_heads or decay.shape != (R, Hv) \
            or beta.shape != (R, Hv):
        raise ValueError(f"y {y.shape}, decay {decay.shape}, beta {beta.shape}, state "
                         f"{state.shape}, key heads {key_heads} do not fit")
    _check(state, state.shape, dt, "state")
    if track is not None:
        _check(track, (track.shape[0], Hv, Dk, Dv), dt, "track")
    out = cp.empty((R, Hv, Dv), dt)
    if R and table.shape[0]:
        y, decay, beta = (cp.ascontiguousarray(a, dtype=dt) for a in (y, decay, beta))
        fn = _function("gdn_recurrent", np.dtype(dt), key_dim=Dk)
        fn((table.shape[0], Hv, -(-Dv // TILE)), (TILE,),
           (y, decay, beta, state, state if track is None else track, out, table,
            np.int32(C), np.int32(key_heads), np.int32(Hv), np.int32(Dv), dt.type(scale)))
    return out


def _check(a, shape: tuple, dtype, what: str) -> None:
    # NOTE: states are updated in place, so they must be the caller's own contiguous memory
    if a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{what}: {a.shape} {a.dtype} (contiguous: {a.flags.c_contiguous}); "
                         f"expected {shape} {np.dtype(dtype)}, C-contiguous")
