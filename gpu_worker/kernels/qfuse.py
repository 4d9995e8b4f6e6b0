"""QFUSE on the GPU: RMSNorm fused with the canonical activation quantizer (CuPy RawKernels).

One pass over each row emits the normalized float activations (for GPU experts and the
shared expert) and the int8 blocks of 32 with fp16 scales (for the CPU experts), quantized
by the rule documented in ``cpu_experts/quant.py`` -- byte-identical to its NumPy reference.
``quantize`` is the standalone form of the same quantizer (tests compare the two). The module
imports without CuPy; only calling a kernel needs it. :class:`FusedMoeNorm` is the norm the
expert placement gives the model on CuPy float32 (gpu_worker/experts/placement.py).

Exactness notes: the kernels are compiled with ``--fmad=false`` (no mul+add contraction),
divisions are ``__fdiv_rn`` (IEEE), the scale's fp16 rounding is exact double arithmetic
(frexp / ldexp / rint), and ``amax`` is the max of the |x| bit patterns, which is exact and
catches inf/nan (patterns >= 0x7f800000). RMSNorm follows ``Ops.rms_norm``:
``y = (x / sqrt(mean(x*x) + eps)) * w`` (or ``* (1 + w)``), with the sum of squares reduced
in a fixed order, so ``y`` is deterministic; with ``quantize=False`` the same kernel gives the
same ``y`` (QFUSE off = this y, quantized by the standalone quantizer: identical bytes).
"""

from __future__ import annotations

from cpu_experts.errors import NonFiniteActivation
from cpu_experts.quant import BLOCK
from gpu_worker.kernels import raw_module

try:  # NOTE: CuPy is optional; CI and laptops run without it
    import cupy as cp
except ImportError:  # pragma: no cover - depends on the machine
    cp = None

THREADS = 256

_SOURCE = r"""
extern "C" {

__device__ double f16_round(double d) {
    if (d >= 65504.0) return 65504.0;
    if (d < 6.103515625e-05) return rint(d * 16777216.0) * 5.9604644775390625e-08;
    int e;
    frexp(d, &e);
    return ldexp(rint(ldexp(d, 11 - e)), e - 11);
}

__device__ unsigned short f16_bits(double v) {
    if (v == 0.0) return 0;
    if (v < 6.103515625e-05) return (unsigned short)(v * 16777216.0);
    int e;
    double m = frexp(v, &e);
    return (unsigned short)(((e + 14) << 10) | (int)((m * 2.0 - 1.0) * 1024.0));
}

// One warp quantizes one block of 32: lane i holds value i.
__device__ void quant_warp(float v, signed char* q, unsigned short* d16, int lane, int* err) {
    unsigned int m = __float_as_uint(v) & 0x7fffffffu;
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (m >= 0x7f800000u) {
        if (lane == 0) { atomicOr(err, 1); *d16 = 0; }
        q[lane] = 0;
        return;
    }
    float d = __fdiv_rn(__uint_as_float(m), 127.0f);
    double s = f16_round((double)d);
    if (lane == 0) *d16 = f16_bits(s);
    if (s == 0.0) { q[lane] = 0; return; }
    float r = rintf(__fdiv_rn(v, (float)s));
    q[lane] = (signed char)fminf(fmaxf(r, -127.0f), 127.0f);
}

__global__ void quantize_blocks(const float* x, signed char* q, unsigned short* d16,
                                long long n_blocks, int* err) {
    int lane = threadIdx.x & 31;
    long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long b = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
         b < n_blocks; b += warps) {
        quant_warp(x[b * 32 + lane], q + b * 32, d16 + b, lane, err);
    }
}

// One CUDA block per row; blockDim.x is a multiple of 32 and at most 1024.
__global__ void rmsnorm_qfuse(const float* x, const float* w, float* y, signed char* q,
                              unsigned short* d16, int H, float eps, int zero_centered,
                              int do_quant, int* err) {
    __shared__ float partial[32];
    __shared__ float inv_total;
    const float* xr = x + (long long)blockIdx.x * H;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) ss += xr[i] * xr[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int i = 0; i < n_warps; ++i) total += partial[i];
        inv_total = sqrtf(__fdiv_rn(total, (float)H) + eps);
    }
    __syncthreads();
    float r = inv_total;
    long long row = (long long)blockIdx.x;
    for (int b = warp; b < H / 32; b += n_warps) {
        int i = b * 32 + lane;
        float g = zero_centered ? 1.0f + w[i] : w[i];
        float v = __fmul_rn(__fdiv_rn(xr[i], r), g);
        y[row * H + i] = v;
        if (do_quant) quant_warp(v, q + row * H + b * 32, d16 + row * (H / 32) + b, lane, err);
    }
}

}
"""

def _kernels():
    return raw_module(_SOURCE, "QFUSE GPU kernels")


def _raise_if_flagged(err) -> None:
    if int(err.get()[0]):
        raise NonFiniteActivation("non-finite value in activations bound for the CPU experts")


def quantize(x, *, check: bool = True):
    """Standalone canonical quantizer on the GPU: ``x [..., n]`` float32 (CuPy) ->
    ``(q int8 [..., n], d16 float16 [..., n/32])``. ``check`` syncs and raises
    :class:`NonFiniteActivation` on inf/nan (otherwise those blocks come back zeroed)."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"last axis must be a multiple of {BLOCK}, got shape {x.shape}")
    n_blocks = x.size // BLOCK
    q = cp.empty(x.shape, cp.int8)
    d16 = cp.empty((*x.shape[:-1], x.shape[-1] // BLOCK), cp.uint16)
    err = cp.zeros(1, cp.int32)
    if n_blocks:
        grid = min(-(-n_blocks // (THREADS // 32)), 65535)
        _kernels().get_function("quantize_blocks")(
            (grid,), (THREADS,), (x, q, d16, cp.int64(n_blocks), err))
    if check:
        _raise_if_flagged(err)
    return q, d16.view(cp.float16)


def rmsnorm_qfuse(x, weight, eps: float, *, zero_centered: bool = False, quantize: bool = True,
                  check: bool = True, err=None):
    """Fused RMSNorm + canonical quantizer over rows: ``x [R, H]`` float32, ``weight [H]``.

    Returns ``(y [R, H] float32, q [R, H] int8, d16 [R, H/32] float16)``; ``q``/``d16`` are
    None when ``quantize`` is False (the same ``y``, bit for bit). ``check`` syncs and raises
    :class:`NonFiniteActivation` on inf/nan. ``err``: instead, a CuPy ``int32 [1]`` flag the
    kernel ORs 1 into on inf/nan, for the caller to check once per step (no sync here)."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    weight = cp.ascontiguousarray(weight, dtype=cp.float32)
    if x.ndim != 2 or x.shape[1] % BLOCK or weight.shape != (x.shape[1],):
        raise ValueError(f"need x [R, H] with H % 32 == 0 and weight [H]; got {x.shape}, "
                         f"{weight.shape}")
    R, H = x.shape
    y = cp.empty_like(x)
    q = cp.empty((R, H), cp.int8) if quantize else cp.empty(1, cp.int8)
    d16 = cp.empty((R, H // BLOCK), cp.uint16) if quantize else cp.empty(1, cp.uint16)
    shared, err = err is not None, (cp.zeros(1, cp.int32) if err is None else err)
    if R:
        threads = min(THREADS, max(32, H // 32 * 32))
        _kernels().get_function("rmsnorm_qfuse")(
            (R,), (threads,), (x, weight, y, q, d16, cp.int32(H), cp.float32(eps),
                               cp.int32(zero_centered), cp.int32(quantize), err))
    if not quantize:
        return y, None, None
    if check and not shared:
        _raise_if_flagged(err)
    return y, q, d16.view(cp.float16)


class FusedMoeNorm:
    """The RMSNorm before a MoE block with the CPU experts' quantizer fused into it:
    ``(x [R, H] float32, weight [H], eps, zero_centered) -> (y [R, H], (q [R, H] int8,
    d16 [R, H/32] float16))``. Non-finite activations set a device flag instead of a host
    sync per layer; :meth:`take_flag` reads (and clears) it once per step."""

    def __init__(self) -> None:
        self.err = cp.zeros(1, cp.int32)

    def __call__(self, x, weight, eps: float, zero_centered: bool):
        y, q, d16 = rmsnorm_qfuse(x, weight, eps, zero_centered=zero_centered, err=self.err)
        return y, (q, d16)

    def take_flag(self) -> bool:
        """Whether inf/nan reached the quantizer since the last call (a host sync)."""
        flagged = bool(int(self.err.get()[0]))
        if flagged:
            self.err[...] = 0
        return flagged
