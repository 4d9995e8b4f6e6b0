"""Routed experts held on the backend as int8 blocks of 32 (``[experts] gpu_format = "int8"``).

The CPU experts' int8 format, byte for byte (cpu_experts/quant.py's rule: per 32 weights of a
row, ``d = fp16(max|w| / 127)``, ``q = rint(w / d)``), kept on the GPU: ``q [E, rows, cols]``
int8 and ``d [E, rows, cols / 32]`` the fp16 scales' bits (uint16). A weight's value is
``float32(q) * float32(d)``: 8 bits times 11 fit float32's 24, so the product is exact and a
kernel that widens each weight to that value before its products computes the float32
kernel's arithmetic on these values (gpu_worker/kernels/moe_merged.py, its NumPy reference
the float32 one on :meth:`Int8Stack.values`). 1.0625 bytes a weight against bf16's 2: a GPU
budget holds 1.88x the experts, and a step reads that much less per GPU expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

BLOCK = 32
BYTES_PER_WEIGHT = 1 + 2 / BLOCK  # int8 value + its share of the fp16 scale


@dataclasses.dataclass(frozen=True)
class Int8Stack:
    """Stacked expert matrices ``[E, rows, cols]`` as int8 blocks (NumPy or CuPy arrays)."""

    q: Any  # int8 [E, rows, cols]
    d: Any  # uint16 [E, rows, cols / 32]: fp16 bits of each block's scale

    def __post_init__(self) -> None:
        q, d = self.q, self.d
        if q.ndim != 3 or q.dtype != np.int8 or q.shape[2] % BLOCK:
            raise ValueError(f"int8 experts: q must be int8 [E, rows, cols], cols a multiple "
                             f"of {BLOCK}; got {q.dtype} {q.shape}")
        if d.dtype != np.uint16 or d.shape != (*q.shape[:2], q.shape[2] // BLOCK):
            want = (*q.shape[:2], q.shape[2] // BLOCK)
            raise ValueError(f"int8 experts: d must be uint16 (fp16 bits) {want}, got "
                             f"{d.dtype} {d.shape}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes) + int(self.d.nbytes)

    def expert(self, e: int, dtype: Any = np.float32) -> Any:
        """Expert ``e``'s matrix ``[rows, cols]`` as its exact values, in ``dtype``."""
        return _values(self.q[e], self.d[e]).astype(dtype, copy=False)

    def values(self) -> Any:
        """Every expert's values, float32 ``[E, rows, cols]`` (the kernels' weights)."""
        return _values(self.q, self.d)


def _values(q: Any, d: Any) -> Any:
    """``float32(q) * float32(fp16 d)`` per block of 32, exact (on q's backend)."""
    scale = d.view(np.float16).astype(np.float32)  # fp16 -> float32: exact
    blocks = q.reshape(*q.shape[:-1], -1, BLOCK).astype(np.float32) * scale[..., None]
    return blocks.reshape(q.shape)


def quantize_stack(w: np.ndarray) -> Int8Stack:
    """Host float ``w [E, rows, cols]`` as an :class:`Int8Stack` by the CPU experts' int8
    rule (ValueError naming the first non-finite weight)."""
    from cpu_experts.quant import quantize  # noqa: PLC0415 (numba: only when int8 is asked)

    w = np.asarray(w, np.float32)
    if w.ndim != 3 or w.shape[2] % BLOCK:
        raise ValueError(f"int8 experts need [E, rows, cols] with cols a multiple of {BLOCK}, "
                         f"got {w.shape}")
    if w.size == 0:
        return Int8Stack(np.zeros(w.shape, np.int8),
                         np.zeros((*w.shape[:2], w.shape[2] // BLOCK), np.uint16))
    try:
        q, d = quantize(w)
    except ValueError as e:  # NonFiniteActivation: here a weight
        raise ValueError(f"int8 experts: {e}") from None
    return Int8Stack(q, d.view(np.uint16))
