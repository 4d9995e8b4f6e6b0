"""Fused SwiGLU activation on CuPy float32: ``silu(gate) * up`` in one elementwise launch.

``Ops.silu_mul`` on CuPy float32 (switch ``fused_silu``, gpu_worker/kernels/enabled.py) was
``x * sigmoid(x)`` as about eight CuPy launches (abs, exp, adds, divides, where, products)
and one more for ``* up``; :func:`silu_mul` is one launch, one thread per element.

**The arithmetic** (:func:`silu_mul_reference` is its NumPy formula, bit for bit):
``e = exp_neg(-|g|)``, ``s = 1 / (1 + e)`` for ``g >= 0`` else ``e / (1 + e)`` (the sigmoid
split by sign as ``Ops.sigmoid``, so the exp never overflows), ``out = (g * s) * u``. The exp
is not written here: it is Gated DeltaNet's ``exp_neg`` (gpu_worker/kernels/gdn_recurrent.py,
its CUDA ``_HELPERS`` with ``silu``, and its NumPy twin gdn_reference.py): Cody-Waite
reduction, a degree-7 polynomial, times ``2^n``; 0 below -87.

**IEEE float32, subnormals kept.** CuPy compiles with ``-ftz=true`` (docs/gpu_step.md). The
helpers are reused with ``T`` a one-float struct whose ``+ - * /`` are PTX ``.rn.f32``
without ``.ftz`` (as fused_norm.py) and whose ``fabs`` clears the sign bit, so no compile flag
alters a result. Comparisons, ``rintf`` and the int conversion keep CuPy's flushing forms:
they can differ only for a subnormal ``g``, where ``e`` is exactly 1 either way (``n = 0``,
the polynomial ``1 + r (...)`` rounds to 1), so both branches give 0.5.
"""

from __future__ import annotations

import functools

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.gdn_recurrent import _HELPERS, source
from gpu_worker.kernels.gdn_reference import sigmoid as _sigmoid_reference
from gpu_worker.kernels.gdn_reference import silu as _silu_reference

THREADS = 256  # elements (threads) per block

# F: float32 whose arithmetic is IEEE .rn whatever -ftz=true; gdn_recurrent's helpers take it
_TYPE = r"""
struct F {
    float v;
    __device__ __forceinline__ F() {}
    __device__ __forceinline__ F(float x) : v(x) {}
    __device__ __forceinline__ explicit operator int() const { return (int)v; }
};
__device__ __forceinline__ F operator+(F a, F b) {
    float d; asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a.v), "f"(b.v)); return F(d); }
__device__ __forceinline__ F operator-(F a, F b) {
    float d; asm("sub.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a.v), "f"(b.v)); return F(d); }
__device__ __forceinline__ F operator*(F a, F b) {
    float d; asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a.v), "f"(b.v)); return F(d); }
__device__ __forceinline__ F operator/(F a, F b) {
    float d; asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a.v), "f"(b.v)); return F(d); }
__device__ __forceinline__ F operator-(F a) {  // the sign bit: exact, subnormals kept
    return F(__int_as_float(__float_as_int(a.v) ^ (int)0x80000000)); }
__device__ __forceinline__ bool operator>=(F a, F b) { return a.v >= b.v; }
__device__ __forceinline__ F fabs(F a) {
    return F(__int_as_float(__float_as_int(a.v) & 0x7fffffff)); }
__device__ __forceinline__ F rint_f(F a) { return F(rintf(a.v)); }
typedef F T;
"""

_KERNEL = r"""
// grid ceil(n / THREADS), block THREADS; gate, up, out: n contiguous float32
extern "C" __global__ void silu_mul(const float* __restrict__ gate,
                                    const float* __restrict__ up, float* __restrict__ out,
                                    long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = (silu(F(gate[i])) * F(up[i])).v;
}

// grid ceil(n / THREADS), block THREADS: out = sigmoid(gate[i / per]) * x (the gates of
// attention's output, per = 1, and of the shared expert, one per row: per = its width;
// switch fused_sigmoid)
extern "C" __global__ void sigmoid_mul(const float* __restrict__ gate,
                                       const float* __restrict__ x, float* __restrict__ out,
                                       long long n, long long per) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = (sigmoid(F(gate[i / per])) * F(x[i])).v;
}

// as sigmoid_mul, plus base: out = base + sigmoid(gate[i / per]) * x (the MoE output: the
// routed experts' sum plus the gated shared expert, one launch for the product and the add)
extern "C" __global__ void sigmoid_mul_add(const float* __restrict__ gate,
                                           const float* __restrict__ x,
                                           float* __restrict__ out, long long n, long long per,
                                           const float* __restrict__ base) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = (F(base[i]) + sigmoid(F(gate[i / per])) * F(x[i])).v;
}
"""


def helpers_source() -> str:
    """gdn_recurrent's float32 defines and ``_HELPERS`` (``exp_neg``, ``sigmoid``, ``silu``)
    with ``T`` the struct ``F`` above: IEEE float32 arithmetic whatever ``-ftz`` says (the
    router and RoPE kernels, router.py and fused_rope.py, and fused_norm.py's gated norm
    build on it too)."""
    full = source(np.float32, conv_kernel=2)
    head = full[: full.index(_HELPERS) + len(_HELPERS)]
    if "typedef float T;\n" not in head or "#define RINT rintf\n" not in head:
        raise RuntimeError("gdn_recurrent.source changed: fused_silu cannot reuse its exp")
    return head.replace("typedef float T;\n", _TYPE).replace("#define RINT rintf\n",
                                                             "#define RINT rint_f\n")


def kernel_source() -> str:
    """:func:`helpers_source`, then the kernels."""
    return helpers_source() + _KERNEL


@functools.cache
def _function(name: str = "silu_mul"):
    return raw_module(kernel_source(), "fused SiLU kernels").get_function(name)


def silu_mul(gate, up):
    """``silu(gate) * up`` of two float32 CuPy arrays of one shape -> a new float32 array of
    that shape, in the order of the module docstring. One launch (a copy first only for a
    non-contiguous input); never waits."""
    return _launch("silu_mul", gate, up)


def sigmoid_mul(gate, x):
    """``sigmoid(gate) * x`` (the sigmoid of :func:`silu_mul`, then one product) of float32
    CuPy arrays, ``gate`` of the shape of ``x`` or of one value per row (last axis 1), one
    launch. Switch ``fused_sigmoid``."""
    return _launch("sigmoid_mul", gate, x, _per(gate, x))


def _per(gate, x) -> int:
    """Elements of ``x`` per gate value: its width for one gate per row, else 1."""
    return x.shape[-1] if gate.shape != x.shape and gate.shape == x.shape[:-1] + (1,) else 1


def sigmoid_mul_add(gate, x, base):
    """``base + sigmoid(gate) * x`` in one launch: :func:`sigmoid_mul`, then an IEEE float32
    add (``base`` of ``x``'s shape). Switch ``fused_sigmoid``."""
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    if base.dtype != np.float32 or base.shape != x.shape:
        raise ValueError(f"sigmoid_mul_add: base {base.dtype} {base.shape} for x {x.shape}")
    return _launch("sigmoid_mul_add", gate, x, _per(gate, x), cp.ascontiguousarray(base))


def _launch(name: str, gate, other, per: int | None = None, base=None):
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    if gate.dtype != np.float32 or other.dtype != np.float32:
        raise TypeError(f"{name}: float32 operands, not {gate.dtype}, {other.dtype}")
    if gate.shape != other.shape and per in (None, 1):
        raise ValueError(f"{name}: shapes {gate.shape} and {other.shape} differ")
    out = cp.empty(other.shape, np.float32)
    n = out.size
    if n == 0:
        return out
    gate, other = cp.ascontiguousarray(gate), cp.ascontiguousarray(other)
    args = ((gate, other, out, np.int64(n)) + (() if per is None else (np.int64(per),))
            + (() if base is None else (base,)))
    _function(name)((-(-n // THREADS),), (THREADS,), args)
    return out


def silu_mul_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """NumPy formula of :func:`silu_mul`, bit for bit: gdn_reference's ``silu`` (its
    ``exp_neg``, the sigmoid split by sign) times ``up``, float32 throughout (IEEE)."""
    gate = np.asarray(gate, np.float32)
    up = np.asarray(up, np.float32)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul_reference: gate {gate.shape} and up {up.shape} differ")
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return (_silu_reference(gate) * up).astype(np.float32, copy=False)


def sigmoid_mul_reference(gate: np.ndarray, x: np.ndarray) -> np.ndarray:
    """NumPy formula of :func:`sigmoid_mul`, bit for bit: gdn_reference's ``sigmoid`` times
    ``x``, float32 throughout (IEEE)."""
    gate = np.asarray(gate, np.float32)
    x = np.asarray(x, np.float32)
    if gate.shape not in (x.shape, x.shape[:-1] + (1,)):
        raise ValueError(f"sigmoid_mul_reference: gate {gate.shape} does not fit x {x.shape}")
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return (_sigmoid_reference(gate) * x).astype(np.float32, copy=False)
