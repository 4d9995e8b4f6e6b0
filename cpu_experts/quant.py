"""QFUSE: the one canonical activation quantizer (docs/architecture.md §5).

The rule, stated once (every implementation -- this NumPy reference, the Numba version below,
and the CuPy kernel in gpu_worker/kernels/qfuse.py -- follows it to the bit):

For each block of 32 consecutive values along the last axis, after converting the input to
float32 (round to nearest even; float64 inputs are rounded first, then quantized):

1. ``amax = max|x|`` over the block (exact in any order).
2. ``d = amax / 127`` as an IEEE float32 division.
3. The stored scale ``d16 = fp16(d)``, rounded to nearest even (subnormal halves included),
   clamped to the largest finite half, 65504 (a ``d`` that would round to inf stores 65504).
4. ``q = clamp(round_half_to_even(x / float32(d16)), -127, 127)``: true float32 division by
   the *stored* scale, never a multiply by a reciprocal.
5. A block whose stored scale is 0 -- ``amax == 0``, or ``d`` below half the smallest
   subnormal half (2**-25), which rounds to 0 -- has ``d16 = 0`` and every ``q = 0``
   (dequantizing gives 0 either way, and no 0/0 arises).
6. A non-finite input (inf, nan) is an error: :class:`NonFiniteActivation`, never quantized.

Outputs: ``q`` int8 with the input's shape, ``d16`` float16 with shape ``[..., n / 32]``.
The last axis must be a multiple of 32.  The same rule quantizes expert weights (rows along
their reduction dimension) and the intermediate activations ``h`` before down_proj.

The 4-bit expert weights (quant4.py) follow the same rule with ``QMAX = 7`` in place of 127
(steps 2 and 4): every function here takes ``qmax`` (default 127, the activations' rule).

Numba has no float16 arrays, so the Numba routines take and return scales as their uint16
bit patterns (``d16.view(np.uint16)``); :func:`quantize` converts at the boundary.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from cpu_experts.errors import NonFiniteActivation
from cpu_experts.quant_vec import amax32, quantize32

BLOCK = 32
QMAX = 127
F16_MAX = 65504.0


def _check_last_axis(x: np.ndarray) -> None:
    if x.ndim == 0 or x.shape[-1] % BLOCK != 0:
        raise ValueError(f"last axis must be a multiple of {BLOCK}, got shape {x.shape}")


def quantize_ref(x: np.ndarray, qmax: int = QMAX) -> tuple[np.ndarray, np.ndarray]:
    """NumPy reference of the rule: ``x [..., n]`` -> ``(q int8 [..., n], d16 f16 [..., n/32])``."""
    _check_last_axis(x)
    xf = np.asarray(x).astype(np.float32)
    if not np.isfinite(xf).all():
        bad = np.argwhere(~np.isfinite(xf))[0]
        raise NonFiniteActivation(f"non-finite value {xf[tuple(bad)]} at index {tuple(bad)}")
    blocks = xf.reshape(*xf.shape[:-1], -1, BLOCK)                   # [..., nb, 32]
    amax = np.abs(blocks).max(axis=-1)                                # [..., nb] float32
    d = amax / np.float32(qmax)                                       # float32 IEEE division
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16)                                    # round to nearest even
    d16 = np.where(np.isinf(d16), np.float16(F16_MAX), d16)           # clamp to 65504
    scale = d16.astype(np.float32)[..., None]                         # [..., nb, 1] exact
    nz = scale != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        qf = np.where(nz, np.rint(blocks / np.where(nz, scale, np.float32(1))), np.float32(0))
    q = np.clip(qf, -qmax, qmax).astype(np.int8).reshape(xf.shape)
    return q, d16


@njit(cache=True, nogil=True)
def f16_round(d: float) -> float:
    """Round a finite ``d >= 0`` to the nearest-even half, clamped to 65504; returns its value."""
    if d >= F16_MAX:
        return F16_MAX  # [65504, 65520) rounds to 65504; above it rounds to inf -> clamp
    if d < 2.0**-14:  # subnormal half: multiples of 2**-24
        return np.rint(d * 2.0**24) * 2.0**-24
    _, e = math.frexp(d)  # d = m * 2**e, m in [0.5, 1): 11 significant bits -> ulp 2**(e-11)
    return math.ldexp(np.rint(math.ldexp(d, 11 - e)), e - 11)


@njit(cache=True, nogil=True)
def f16_bits(v: float) -> np.uint16:
    """IEEE half bit pattern of a non-negative value exactly representable as a half."""
    if v == 0.0:
        return np.uint16(0)
    if v < 2.0**-14:
        return np.uint16(int(v * 2.0**24))
    m, e = math.frexp(v)  # v = m * 2**e; half exponent field = e - 1 + 15
    return np.uint16(((e + 14) << 10) | int((m * 2.0 - 1.0) * 1024.0))


@njit(cache=True, nogil=True)
def quantize_block(x, q, o: int) -> tuple[float, bool]:
    """Quantize ``x[o:o+32]`` (float32) into ``q[o:o+32]`` (int8); returns (scale value, ok).

    The max and the quotients are vector code (quant_vec.py); inf/nan are the |x| bit
    patterns >= 0x7f800000, so an integer max finds them.
    """
    return _quantize_block(x, x.view(np.int32), q, o, QMAX)


@njit(cache=True, nogil=True)
def quantize_block_bits(x, xbits, q, o: int) -> tuple[float, bool]:
    """:func:`quantize_block` given also ``xbits = x.view(np.int32)``, for callers in a
    parallel loop that make the view once (a view per block is an atomic on x's refcount)."""
    return _quantize_block(x, xbits, q, o, QMAX)


@njit(cache=True, nogil=True, inline="always")
def _quantize_block(x, xbits, q, o: int, qmax: int) -> tuple[float, bool]:
    amax = amax32(xbits, o)  # inf or nan when the block is not finite
    if not amax < np.float32(np.inf):
        return 0.0, False
    d = amax / np.float32(qmax)
    s = f16_round(np.float64(d))
    if s == 0.0:
        for t in range(BLOCK):
            q[np.uintp(o + t)] = 0
        return 0.0, True
    quantize32(x, o, np.float32(s), q, o, np.int8(0), qmax)
    return s, True


@njit(cache=True, nogil=True)
def quantize_rows_into(x, q, d16_bits, rows: int, qmax: int = QMAX) -> int:
    """Quantize ``x[:rows]`` ([R, n] float32) into ``q [R, n]`` int8 and ``d16_bits [R, n/32]``.

    Returns -1 when all is finite, else the flat index of the first block with a non-finite value.
    """
    nb = x.shape[1] // BLOCK
    for r in range(rows):
        xr = x[r]
        xbits = xr.view(np.int32)
        qr = q[r]
        for b in range(nb):
            s, ok = _quantize_block(xr, xbits, qr, b * BLOCK, qmax)
            if not ok:
                return r * nb + b
            d16_bits[r, b] = f16_bits(s)
    return -1


def quantize(x: np.ndarray, qmax: int = QMAX) -> tuple[np.ndarray, np.ndarray]:
    """Numba version of :func:`quantize_ref`; byte-identical output, same errors."""
    _check_last_axis(x)
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])  # [rows, n]
    q = np.empty(x2.shape, np.int8)
    d = np.empty((x2.shape[0], x2.shape[1] // BLOCK), np.uint16)
    bad = quantize_rows_into(x2, q, d, x2.shape[0], qmax)
    if bad >= 0:
        raise_non_finite(x2, bad)
    return q.reshape(x.shape), d.view(np.float16).reshape(*x.shape[:-1], -1)


def raise_non_finite(x2: np.ndarray, flat_block: int) -> None:
    """Raise :class:`NonFiniteActivation` for block ``flat_block`` of ``x2 [rows, n]``."""
    nb = x2.shape[1] // BLOCK
    r, b = divmod(flat_block, nb)
    blk = x2[r, b * BLOCK:(b + 1) * BLOCK]
    t = int(np.argmax(~np.isfinite(blk)))
    raise NonFiniteActivation(f"non-finite value {blk[t]} at row {r}, column {b * BLOCK + t}")
