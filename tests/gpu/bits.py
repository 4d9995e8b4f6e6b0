"""Bit-for-bit comparison of float32 results for the GPU kernel tests, with a one-line report
of a difference that is enough to fix the kernel without another device run."""

from __future__ import annotations

import numpy as np


def ulps(a: np.ndarray) -> np.ndarray:
    """float32 bits as integers ordered like the values (distance in ulps by subtraction)."""
    i = a.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def assert_same_bits(got, want, what: str) -> None:
    """Equal bits, or one line: how many differ, at which indices per axis, the first index
    with both values and their bits, the ulps and the relative difference."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if got.tobytes() == want.tobytes():
        return
    diff = got.view(np.uint32) != want.view(np.uint32)
    at = np.argwhere(diff)
    first = tuple(int(i) for i in at[0])
    g, w = got[first], want[first]
    where = ", ".join(f"axis {a}: {np.unique(at[:, a])[:8].tolist()}" for a in range(at.shape[1]))
    ulp = np.abs(ulps(got) - ulps(want))[diff]
    rel = np.abs(got.astype(np.float64) - want)[diff] / np.maximum(np.abs(want[diff]), 1e-45)
    raise AssertionError(
        f"{what}: {int(diff.sum())} of {diff.size} differ ({where}); first {first}: got "
        f"{g!r} 0x{int(g.view(np.uint32)):08x}, want {w!r} 0x{int(w.view(np.uint32)):08x}; "
        f"ulps max {int(ulp.max())} median {float(np.median(ulp))}, max relative difference "
        f"{float(rel.max()):.3g}")
