"""Expert weights into a CPU format: the canonical 4-bit quantizer, and blocks quantized
elsewhere (a GGUF's Q8_0 / Q4_0, formats.Blocks) taken as they are where the format allows.

The int4 rule is quant.py's rule with ``QMAX = 7``: per block of 32 along the reduction
axis, ``d16 = fp16(float32(amax) / 7)`` (round to nearest even, clamped to 65504) and
``q = clamp(rint(x / float32(d16)), -7, 7)`` (round half to even, true division by the
stored scale); a block whose stored scale is 0 is all zeros; non-finite weights are an
error. Symmetric: the int4 format's -8 is never produced here, but Q4_0 blocks, which use
it, are held exactly. :func:`quantize4_ref` is the NumPy reference, :func:`quantize4` the
Numba version (byte-identical; tests/unit/test_cpu_int4.py).
"""

from __future__ import annotations

import numpy as np

from cpu_experts.formats import QMAX, Blocks, check_format
from cpu_experts.quant import quantize, quantize_ref

QMAX4 = QMAX["int4"]


def quantize4_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NumPy reference: float ``[..., n]`` -> ``(q int8 [..., n] in [-7, 7], d16 f16
    [..., n/32])``."""
    return quantize_ref(x, QMAX4)


def quantize4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Numba version of :func:`quantize4_ref`; byte-identical."""
    return quantize(x, QMAX4)


def to_format(t: np.ndarray | Blocks, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """One expert tensor ``[n, U, K]`` in format ``fmt``'s canonical form: ``(q int8, d16
    float16 [n, U, K/32])`` (q in [-127, 127] for int8, [-8, 7] for int4).

    * float: the canonical quantizer of ``fmt``;
    * Q8_0 blocks into int8, Q4_0 blocks into either format: the blocks' own values and
      scales, exactly (no second rounding; a Q4_0 block is an int8 block of small values);
    * Q8_0 blocks into int4: dequantized (``q * d``, exact in float32) and quantized again
      by the int4 rule: the one conversion that adds error."""
    check_format(fmt)
    if isinstance(t, Blocks):
        q, s = t.values()
        if t.kind == "q4_0" or fmt == "int8":
            if fmt == "int8" and q.size and int(q.min()) < -127:
                raise ValueError("Q8_0 blocks hold -128: the int8 kernels take [-127, 127]")
            return q, s
        t = q.astype(np.float32) * np.repeat(s.astype(np.float32), 32, axis=-1)
    return quantize(np.asarray(t), QMAX[fmt])
