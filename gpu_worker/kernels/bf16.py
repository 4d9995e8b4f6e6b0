"""bfloat16 storage: host rounding, and the GPU's bf16 -> float32 widening.

A bf16 value is the upper 16 bits of a float32 (sign, 8 exponent bits, 7 mantissa bits), so
widening is exact: ``f32_bits = bf16_bits << 16``. Rounding float32 -> bf16 happens once, on
the host (round to nearest, ties to even; relative error <= 2^-8): float32 arrays by
:func:`round_into`, ``ml_dtypes``' rule in a GIL-free Numba loop over chunks on threads
(``ml_dtypes``' own cast holds the GIL: one core, 1-2 ns a value), other dtypes by
``ml_dtypes`` itself.

On NumPy a stored matrix has dtype ``ml_dtypes.bfloat16``. On CuPy it is raw ``uint16`` bits:
CuPy's own bfloat16 (v14, through ml_dtypes) is experimental, needs NumPy >= 2.1.2, can fail
to compile on CUDA 12.1, and does not exist in CuPy 13, which this project still supports;
every GPU kernel that reads weights takes the bits and widens them itself (docs/bf16.md).
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
BITS = np.dtype(np.uint16)  # the CuPy storage of a bf16 matrix
UNIT_ROUNDOFF = 2.0 ** -8  # max |round(w) - w| / |w| of bf16 rounding (8 significant bits)
ROUND_CHUNK = 1 << 20  # values per rounding job (4 MiB of float32: stays in cache)
MAX_THREADS = 16


def default_threads() -> int:
    """Threads of a rounding or loading job: the cores this process may run on now (a GPU
    worker starts on the daemon's start-up cores: gpu_worker/server.py), at most
    :data:`MAX_THREADS`."""
    return min(MAX_THREADS, len(os.sched_getaffinity(0)))


def to_bf16(host: np.ndarray, threads: int | None = None) -> np.ndarray:
    """Host array -> ``ml_dtypes.bfloat16`` (no copy if it already is), rounded to nearest
    even from any float dtype (float32 on ``threads`` threads: :func:`round_into`)."""
    if host.dtype == np.float32:
        out = np.empty(host.shape, BF16)
        round_into(host, out, threads)
        return out
    return np.ascontiguousarray(host, dtype=BF16)


def round_into(src: np.ndarray, out: np.ndarray, threads: int | None = None) -> None:
    """float32 ``src [...]`` -> ``out`` (bfloat16 or uint16 bits, same shape, C-contiguous)
    rounded to nearest even exactly as ``ml_dtypes`` does (NaN -> quiet NaN of its sign), in
    chunks of :data:`ROUND_CHUNK` values on ``threads`` threads (None:
    :func:`default_threads`)."""
    if src.dtype != np.float32 or out.shape != src.shape or out.itemsize != 2:
        raise TypeError(f"round_into: float32 {src.shape} -> 16-bit, not {src.dtype} "
                        f"{src.shape} -> {out.dtype} {out.shape}")
    from gpu_worker.kernels.bf16_round import round_bits  # noqa: PLC0415 (Numba, when used)

    u = np.ascontiguousarray(src).reshape(-1).view(np.uint32)
    bits = out.reshape(-1).view(np.uint16)  # ValueError if out is not contiguous
    starts = range(0, u.size, ROUND_CHUNK)
    n = min(threads or default_threads(), len(starts))
    if n <= 1:
        round_bits(u, bits)
        return
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda a: round_bits(u[a:a + ROUND_CHUNK], bits[a:a + ROUND_CHUNK]),
                      starts))


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
