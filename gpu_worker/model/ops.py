"""Elementwise and normalisation math shared by every layer, written against ``xp``."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_worker.kernels.bf16 import BF16, BITS, to_bf16, widen
from gpu_worker.kernels.enabled import enabled
from gpu_worker.kernels.fused_norm import (
    ONE_WARP_MAX,
    add_rms_norm_rows,
    gated_rms_norm_rows,
    rms_norm_rows,
)
from gpu_worker.kernels.fused_rope import rope
from gpu_worker.kernels.fused_silu import sigmoid_mul, sigmoid_mul_add, silu_mul
from gpu_worker.kernels.int8_stack import Int8Stack
from gpu_worker.kernels.qk_norm_rope import fits as qk_norm_rope_fits
from gpu_worker.kernels.qk_norm_rope import qk_norm_rope
from gpu_worker.kernels.rowtile import linear_rows, linear_rows_split

Array = Any  # numpy.ndarray or cupy.ndarray


def is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """Whether canonical tensor ``name`` is a weight matrix (stored in bf16 by a bf16 model):
    every 2-D tensor (projections, embeddings, lm_head, routers, MTP fc) and the stacked
    routed experts [E, ...]. Norm weights, conv1d [C, 1, K], A_log, dt_bias, biases: no."""
    return len(shape) == 2 or ".experts." in name


class Ops:
    """Math helpers bound to one array module and one compute dtype.

    ``dtype`` "bfloat16" (``ml_dtypes.bfloat16``): weight matrices stored in bf16 (see
    :meth:`weight`), everything computed in float32 (:attr:`dtype` is float32 then).
    Matrix products (:meth:`linear`) on CuPy in float32 and bf16 run the row-tile kernel
    (gpu_worker/kernels/rowtile.py), whose per-row summation order never depends on the
    batch. Elsewhere (NumPy, CuPy float64) BLAS picks kernels and orders by row count, so
    ``exact=True`` computes those products one row at a time, so that a row's result never
    depends on which other rows share the batch; tests use it in float64 to prove batching
    bit-exact.
    """

    def __init__(self, xp, dtype, *, exact: bool = False) -> None:
        self.xp = xp
        self.bf16 = np.dtype(dtype) == BF16
        self.dtype = np.dtype(np.float32) if self.bf16 else xp.dtype(dtype)  # compute dtype
        self.exact = exact

    def weight(self, name: str, host: np.ndarray) -> Array:
        """Canonical tensor ``name`` (a host array of any float dtype) on the backend in its
        storage dtype: a bf16 model's matrices (:func:`is_matrix`) in bf16 (NumPy:
        ``ml_dtypes.bfloat16``; CuPy: its raw uint16 bits, gpu_worker/kernels/bf16.py),
        rounded to nearest even once here; everything else in the compute dtype. Raw bf16
        bits (uint16) must come as ``bits.view(ml_dtypes.bfloat16)``. An int8 expert stack
        (gpu_worker/kernels/int8_stack.py) stays int8: its two arrays on the backend."""
        if isinstance(host, Int8Stack):
            return Int8Stack(self.xp.asarray(host.q), self.xp.asarray(host.d))
        if host.dtype.kind != "f" and host.dtype != BF16:
            raise TypeError(f"{name}: weights come as floats or ml_dtypes.bfloat16, not "
                            f"{host.dtype}")
        if self.bf16 and is_matrix(name, host.shape):
            w = to_bf16(host)
            return w if self.xp is np else self.xp.asarray(w.view(BITS))
        if host.dtype == BF16:  # widening is exact; CuPy 13 has no bf16 to convert from
            host = host.astype(np.float32)
        return self.xp.asarray(host, dtype=self.dtype)

    def up(self, w: Array) -> Array:
        """A stored weight (or a slice of one) in the compute dtype: bf16 widened exactly."""
        if w.dtype == self.dtype:
            return w
        if w.dtype == BITS:  # CuPy bf16 bits
            return widen(w)
        return w.astype(self.dtype)

    def embed(self, table: Array, tokens) -> Array:
        """Rows ``tokens`` [R] of the embedding ``table`` [V, H] -> [R, H] compute dtype."""
        return self.up(table[self.xp.asarray(tokens)])

    def _kernel(self, switch: str, *operands: Array) -> bool:
        """Whether a CuPy kernel takes the op: the CuPy backend computing in float32, every
        operand float32, and ``switch`` on (gpu_worker/kernels/enabled.py)."""
        return (self.xp is not np and self.dtype == np.float32
                and all(a.dtype == np.float32 for a in operands) and enabled(switch))

    def linear_split(self, x: Array, w: Array, sizes: tuple[int, ...]) -> tuple[Array, ...]:
        """One product per part of a stack of matrices ``w [sum(sizes), in]`` that read the
        same ``x``: a tuple of ``[R, size]``, each the bits of :meth:`linear` on its part. With
        the row-tile kernel: one launch for all parts (rowtile.linear_rows_split)."""
        if self._kernel("rowtile"):
            return linear_rows_split(x, w, sizes)
        bounds = np.cumsum((0, *sizes))
        return tuple(self.linear(x, w[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True))

    def linear_parts(self, x: Array, p: dict[str, Array], names: tuple[str, ...],
                     stack: str) -> tuple[Array, ...]:
        """``x``'s product with each matrix ``p[name]`` (``p[name[:-7] + ".bias"]`` added where
        it exists): one :meth:`linear_split` launch where ``p`` holds their stack ``p[stack]``
        (model.stack_inputs), else one :meth:`linear` each; the same bits either way."""
        if stack in p:
            return self.linear_split(x, p[stack], tuple(p[n].shape[0] for n in names))
        return tuple(self.linear(x, p[n], p.get(n.removesuffix(".weight") + ".bias"))
                     for n in names)

    def linear(self, x: Array, w: Array, bias: Array | None = None) -> Array:
        """x [R, in] @ w[out, in].T (+ bias [out]) -> [R, out]. CuPy float32/bf16: the
        row-tile kernel reads ``w`` (bf16 bits widened in registers, no temporary) once per
        16 rows, a row's bits the same in any batch. Otherwise a bf16 ``w`` is widened to
        float32 first and BLAS does the product (row by row with ``exact``)."""
        if self._kernel("rowtile"):
            return linear_rows(x, w, bias)
        w = self.up(w)
        if self.exact and x.shape[0] > 0:
            out = self.xp.empty((x.shape[0], w.shape[0]), dtype=self.dtype)
            for r in range(x.shape[0]):
                out[r] = w @ x[r]
        else:
            out = x @ w.T
        if bias is not None:
            out = out + bias
        return out

    def rms_norm(self, x: Array, w: Array, eps: float, *, zero_centered: bool) -> Array:
        """RMSNorm over the last axis; ``zero_centered`` multiplies by (1 + w) (Qwen3-Next).
        CuPy float32 with ``fused_norm`` on: one launch, a fixed per-row order
        (gpu_worker/kernels/fused_norm.py)."""
        xp = self.xp
        if self._kernel("fused_norm", x, w):
            return rms_norm_rows(x, w, eps, zero_centered=zero_centered)
        var = xp.mean(x * x, axis=-1, keepdims=True)
        normed = x / xp.sqrt(var + self.dtype.type(eps))
        return normed * ((1 + w) if zero_centered else w)

    def add_rms_norm(self, x: Array, delta: Array | None, w: Array, eps: float, *,
                     zero_centered: bool) -> tuple[Array, Array]:
        """``s = x + delta`` (``x`` itself where ``delta`` is None) and ``rms_norm(s)``: the
        residual stream and the next block's input. CuPy float32 with ``fused_norm`` on: one
        launch for both (the same bits as the add, then the norm)."""
        if delta is None:
            return x, self.rms_norm(x, w, eps, zero_centered=zero_centered)
        if x.shape == delta.shape and self._kernel("fused_norm", x, delta, w):
            return add_rms_norm_rows(x, delta, w, eps, zero_centered=zero_centered)
        s = x + delta
        return s, self.rms_norm(s, w, eps, zero_centered=zero_centered)

    def gated_rms_norm(self, x: Array, gate: Array, w: Array, eps: float, *,
                       zero_centered: bool) -> Array:
        """``silu(gate) * rms_norm(x)`` (Gated DeltaNet's output norm, per value head), ``gate``
        of ``x``'s shape: the bits of :meth:`rms_norm`, then :meth:`silu_mul`. One launch
        where both would take their kernels (CuPy float32, switches ``fused_norm`` and
        ``fused_silu``) and a row fits one warp (fused_norm.gated_rms_norm_rows)."""
        if (x.shape == gate.shape and 0 < x.shape[-1] <= ONE_WARP_MAX
                and self._kernel("fused_norm", x, gate, w) and enabled("fused_silu")):
            return gated_rms_norm_rows(x, gate, w, eps, zero_centered=zero_centered)
        return self.silu_mul(gate, self.rms_norm(x, w, eps, zero_centered=zero_centered))

    def silu(self, x: Array) -> Array:
        return x * self.sigmoid(x)

    def silu_mul(self, gate: Array, up: Array) -> Array:
        """``silu(gate) * up`` (SwiGLU's activation), same shapes. CuPy float32 with
        ``fused_silu`` on: one launch (gpu_worker/kernels/fused_silu.py, its own exp)."""
        if self._kernel("fused_silu", gate, up):
            return silu_mul(gate, up)
        return self.silu(gate) * up

    def sigmoid_mul(self, gate: Array, x: Array) -> Array:
        """``sigmoid(gate) * x``, same shapes (a gate). CuPy float32 with ``fused_sigmoid`` on:
        one launch (gpu_worker/kernels/fused_silu.py, its own exp)."""
        if self._kernel("fused_sigmoid", gate, x):
            return sigmoid_mul(gate, x)
        return self.sigmoid(gate) * x

    def sigmoid_mul_add(self, gate: Array, x: Array, base: Array) -> Array:
        """``base + sigmoid(gate) * x``: with ``fused_sigmoid`` on CuPy float32 one launch (the
        bits of :meth:`sigmoid_mul` then the add, subnormal sums kept)."""
        if base.shape == x.shape and self._kernel("fused_sigmoid", gate, x, base):
            return sigmoid_mul_add(gate, x, base)
        return base + self.sigmoid_mul(gate, x)

    def sigmoid(self, x: Array) -> Array:
        xp = self.xp
        # NOTE: split by sign so exp never overflows; equals 1 / (1 + exp(-x)).
        e = xp.exp(-xp.abs(x))
        return xp.where(x >= 0, 1 / (1 + e), e / (1 + e))

    def softplus(self, x: Array) -> Array:
        xp = self.xp
        return xp.where(x > 20, x, xp.log1p(xp.exp(xp.minimum(x, 20))))

    def softmax(self, x: Array, axis: int = -1) -> Array:
        xp = self.xp
        x = x - xp.max(x, axis=axis, keepdims=True)
        e = xp.exp(x)
        return e / xp.sum(e, axis=axis, keepdims=True)

    def rope_tables(self, positions: Array, rot: int, theta: float) -> tuple[Array, Array]:
        """cos, sin of shape [R, rot] for rotate-half RoPE over the first ``rot`` dims."""
        xp = self.xp
        inv_freq = 1.0 / (theta ** (xp.arange(0, rot, 2, dtype=self.dtype) / rot))  # [rot/2]
        freqs = positions.astype(self.dtype)[:, None] * inv_freq[None, :]  # [R, rot/2]
        emb = xp.concatenate([freqs, freqs], axis=-1)  # [R, rot]
        return xp.cos(emb).astype(self.dtype), xp.sin(emb).astype(self.dtype)

    def apply_rope(self, x: Array, cos: Array, sin: Array) -> Array:
        """x [R, heads, hd]; rotates the first cos.shape[-1] dims (pairs i, i + rot/2).
        CuPy float32 with ``fused_rope`` on: one launch (gpu_worker/kernels/fused_rope.py)."""
        xp = self.xp
        if (xp is not np and x.dtype == np.float32 and cos.dtype == np.float32
                and enabled("fused_rope")):
            return rope(x, cos, sin)
        rot = cos.shape[-1]
        xr, xpass = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = xp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
        out = xr * cos[:, None, :] + rotated * sin[:, None, :]
        return xp.concatenate([out, xpass], axis=-1) if xpass.shape[-1] else out

    def qk_norm_rope(self, q: Array, k: Array, qw: Array, kw: Array, eps: float, cos: Array,
                     sin: Array, *, zero_centered: bool) -> tuple[Array, Array]:
        """Attention's q [R, Hq, hd] and k [R, Hkv, hd]: each head RMS-normed by its weight
        (``qw``, ``kw`` [hd]), then rotated (:meth:`apply_rope`) -> ``(q', k')``. CuPy float32
        with ``fused_norm`` and ``fused_rope`` on and hd <= 256: one launch for all four
        (gpu_worker/kernels/qk_norm_rope.py), the bits of the four calls it replaces, which
        run otherwise (NumPy, float64, a switch off, longer heads)."""
        if (self._kernel("fused_norm", q, k, qw, kw, cos, sin) and enabled("fused_rope")
                and qk_norm_rope_fits(q.shape[-1], cos.shape[-1])):
            return qk_norm_rope(q, k, qw, kw, cos, sin, eps, zero_centered=zero_centered)
        q = self.rms_norm(q, qw, eps, zero_centered=zero_centered)
        k = self.rms_norm(k, kw, eps, zero_centered=zero_centered)
        return self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)
