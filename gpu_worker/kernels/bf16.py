"""bfloat16 storage: host rounding, and the GPU's bf16 -> float32 widening.

A bf16 value is the upper 16 bits of a float32 (sign, 8 exponent bits, 7 mantissa bits), so
widening is exact: ``f32_bits = bf16_bits << 16``. Rounding float32 -> bf16 happens once, on
the host, by ``ml_dtypes`` (round to nearest, ties to even; relative error <= 2^-8).

On NumPy a stored matrix has dtype ``ml_dtypes.bfloat16``. On CuPy it is raw ``uint16`` bits:
CuPy's own bfloat16 (v14, through ml_dtypes) is experimental, needs NumPy >= 2.1.2, can fail
to compile on CUDA 12.1, and does not exist in CuPy 13, which this project still supports;
every GPU kernel that reads weights takes the bits and widens them itself (docs/bf16.md).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
BITS = np.dtype(np.uint16)  # the CuPy storage of a bf16 matrix
UNIT_ROUNDOFF = 2.0 ** -8  # max |round(w) - w| / |w| of bf16 rounding (8 significant bits)


def to_bf16(host: np.ndarray) -> np.ndarray:
    """Host array -> ``ml_dtypes.bfloat16`` (no copy if it already is), rounded to nearest
    even from any float dtype."""
    return np.ascontiguousarray(host, dtype=BF16)


def widen_reference(bits: np.ndarray) -> np.ndarray:
    """NumPy formula of :func:`widen`: ``uint16`` bf16 bits -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@functools.cache
def _widen_kernel():
    import cupy as cp  # noqa: PLC0415 (only on the GPU backend)

    return cp.ElementwiseKernel("uint16 u", "float32 y",
                                "y = __uint_as_float(((unsigned int)u) << 16)",
                                "tandem_bf16_widen")


def widen(bits):
    """CuPy ``uint16`` bf16 bits [...] -> a new C-contiguous float32 array [...] (one
    elementwise launch; exact)."""
    if bits.dtype != BITS:
        raise TypeError(f"widen takes uint16 bf16 bits, not {bits.dtype}")
    return _widen_kernel()(bits)
