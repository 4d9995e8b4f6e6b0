"""Elementwise and normalisation math shared by every layer, written against ``xp``."""

from __future__ import annotations

from typing import Any

Array = Any  # numpy.ndarray or cupy.ndarray


class Ops:
    """Math helpers bound to one array module and one compute dtype.

    ``exact=True`` computes every matrix product one row at a time, so a row's result never
    depends on which other rows share the batch (BLAS picks different kernels and summation
    orders for different row counts). Tests use it in float64 to prove batching bit-exact.
    """

    def __init__(self, xp, dtype, *, exact: bool = False) -> None:
        self.xp = xp
        self.dtype = xp.dtype(dtype)
        self.exact = exact

    def linear(self, x: Array, w: Array, bias: Array | None = None) -> Array:
        """x [R, in] @ w[out, in].T -> [R, out]."""
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
        """RMSNorm over the last axis; ``zero_centered`` multiplies by (1 + w) (Qwen3-Next)."""
        xp = self.xp
        var = xp.mean(x * x, axis=-1, keepdims=True)
        normed = x / xp.sqrt(var + self.dtype.type(eps))
        return normed * ((1 + w) if zero_centered else w)

    def silu(self, x: Array) -> Array:
        return x * self.sigmoid(x)

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
        """x [R, heads, hd]; rotates the first cos.shape[-1] dims (pairs i, i + rot/2)."""
        xp = self.xp
        rot = cos.shape[-1]
        xr, xpass = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = xp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
        out = xr * cos[:, None, :] + rotated * sin[:, None, :]
        return xp.concatenate([out, xpass], axis=-1) if xpass.shape[-1] else out
