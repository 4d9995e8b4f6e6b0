"""The CPU experts' weight formats, their sizes, and blocks quantized elsewhere (no Numba here:
the memory plan and weight sources import this module).

* ``int8``: int8 weights with one float32 scale per block of 32 (tiles.py): 576 bytes per
  block of 32 positions x 16 units, 1.125 bytes per weight.
* ``int4``: 4-bit weights in [-8, 7] with one fp16 scale per block of 32 (tiles4.py): 256
  bytes of nibbles (stored as ``q + 8``, the Q4_0 convention) then 16 fp16 scales, 288
  bytes per block of 32 x 16 units, 0.5625 bytes per weight.

:class:`Blocks` carries one expert tensor already quantized in blocks of 32 along its
reduction axis -- a GGUF file's Q8_0 or Q4_0 data -- to :meth:`CpuExpertPool.fill`, which
tiles it without quantizing again where the pool's format holds it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMATS = ("int8", "int4")
BLOCK = 32
TU = 16  # output units per micro-tile
BLOCK_BYTES = {"int8": 512 + TU * 4, "int4": 256 + TU * 2}  # one block of one micro-tile
QMAX = {"int8": 127, "int4": 7}  # the canonical quantizer's range for expert weights


def bytes_per_weight(fmt: str) -> float:
    """Bytes a CPU worker holds (and reads) per expert weight in format ``fmt``."""
    return BLOCK_BYTES[check_format(fmt)] / (TU * BLOCK)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"CPU expert format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


KINDS = ("q8_0", "q4_0")


@dataclass(frozen=True, slots=True)
class Blocks:
    """One expert tensor ``[n, U, K]`` (n experts, U output units, K reduced) quantized in
    blocks of 32 along K, as GGUF stores Q8_0 and Q4_0:

    * ``kind="q8_0"``: ``q`` int8 ``[n, U, K]``; value = ``q * scale``.
    * ``kind="q4_0"``: ``q`` uint8 ``[n, U, K/2]``, 16 bytes per block: byte i holds
      ``(v[i] + 8) | (v[i + 16] + 8) << 4`` for the block's values ``v`` in [-8, 7] (a GGUF
      Q4_0 block's ``qs``); value = ``v * scale``.

    ``scales``: float16 ``[n, U, K/32]`` (or their uint16 bits), finite, one per block (a
    GGUF block's ``d``)."""

    kind: str
    q: np.ndarray
    scales: np.ndarray

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"block kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        want = np.int8 if self.kind == "q8_0" else np.uint8
        per = BLOCK if self.kind == "q8_0" else BLOCK // 2
        q, s = self.q, self.scales
        if q.dtype != want or q.ndim != 3 or q.shape[2] % per:
            raise ValueError(f"{self.kind} q must be {np.dtype(want)} [n, U, K{'/2' * (per < 32)}]"
                             f" with whole blocks, got {q.dtype} {q.shape}")
        want_s = (*q.shape[:2], q.shape[2] // per)
        if s.dtype.itemsize != 2 or s.shape != want_s:
            raise ValueError(f"{self.kind} scales must be float16 {want_s}, got {s.dtype} "
                             f"{s.shape}")
        if not np.isfinite(s.view(np.float16)).all():
            raise ValueError(f"{self.kind} scales must be finite")

    @property
    def shape(self) -> tuple[int, int, int]:
        """``[n, U, K]`` of the tensor the blocks hold."""
        n, U, k = self.q.shape
        return n, U, k * (1 if self.kind == "q8_0" else 2)

    def values(self) -> tuple[np.ndarray, np.ndarray]:
        """``(v int8 [n, U, K], scales float16 [n, U, K/32])``: the blocks' integer values and
        scales, exactly (no rounding)."""
        s = self.scales.view(np.float16)
        return (self.q, s) if self.kind == "q8_0" else (unpack_q4(self.q), s)


def pack_q4(v: np.ndarray) -> np.ndarray:
    """int8 ``[..., K]`` values in [-8, 7] -> uint8 ``[..., K/2]`` in Q4_0 order (per block of
    32: byte i = ``(v[i] + 8) | (v[i + 16] + 8) << 4``)."""
    if v.size and (int(v.min()) < -8 or int(v.max()) > 7):
        raise ValueError("4-bit values must lie in [-8, 7]")
    n = (v.astype(np.int16) + 8).astype(np.uint8).reshape(*v.shape[:-1], -1, 2, BLOCK // 2)
    return (n[..., 0, :] | (n[..., 1, :] << 4)).reshape(*v.shape[:-1], v.shape[-1] // 2)


def unpack_q4(p: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_q4`: uint8 ``[..., K/2]`` -> int8 ``[..., K]`` in [-8, 7]."""
    b = p.reshape(*p.shape[:-1], -1, BLOCK // 2)
    v = np.stack([b & 15, b >> 4], axis=-2).astype(np.int8) - np.int8(8)  # [..., nb, 2, 16]
    return v.reshape(*p.shape[:-1], p.shape[-1] * 2)
