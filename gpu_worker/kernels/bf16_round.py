"""The float32 -> bfloat16 rounding loop of :func:`gpu_worker.kernels.bf16.round_into` (Numba,
GIL-free: threads run it on chunks side by side). Kept apart so that importing the model code
does not import Numba."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def round_bits(u: np.ndarray, bits: np.ndarray) -> None:
    """uint32 float bits ``u [n]`` -> nearest-even bf16 bits ``bits [n]`` (uint16), as
    ``ml_dtypes`` rounds: add 0x7FFF plus the lowest kept bit and keep the upper half (a carry
    into the exponent rounds up to inf correctly); a NaN becomes the quiet NaN of its sign."""
    for i in range(u.size):
        v = u[i]
        if (v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            bits[i] = np.uint16(((v >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))
        else:
            r = v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))
            bits[i] = np.uint16(r >> np.uint32(16))
