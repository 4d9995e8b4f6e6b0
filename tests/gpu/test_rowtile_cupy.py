"""The row-tile matrix kernel (gpu_worker/kernels/rowtile.py) on the device: bits equal to its
NumPy formula, a row's bits the same alone and at every position of every batch size, within
the stated float64 bound, bf16 bits == float32 weights of the same values, subnormals kept
(not flushed, although CuPy compiles with -ftz=true), Ops.linear on it.

A failure says in one line what differs: shape, count, which rows and columns, the first
index with both values and their bits, and the distance in ulps. About 25 kernel variants are
compiled (NVRTC) on first use; the shapes reuse them where they can to keep the file fast."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.bf16 import BF16
from gpu_worker.kernels.rowtile import linear_rows, linear_rows_split
from gpu_worker.kernels.rowtile_ref import error_bound, linear_rows_reference, weights_f32
from gpu_worker.model.ops import Ops
from tests.gpu.bits import assert_same_bits as _same

cupy = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    """The model takes the kernels under test (gpu_worker/kernels/enabled.py)."""
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")

# (K, N): aligned; K not a multiple of 8 and N not of a block's 8-32 rows; K past one
# 256-element lane sweep with a short tail; K = 4096 (several shared-memory slices at 16 rows)
SHAPES = [(512, 64), (1003, 77), (2056, 40), (4096, 33)]
BATCHES = (2, 3, 5, 8, 12, 16, 17, 33, 100)


def _weights(rng, n: int, k: int, bf16: bool):
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, : min(k, 5)] = [0.0, -0.0, 1e-38, -3e-39, 7.0][: min(k, 5)]  # zeros, subnormals
    return w.astype(BF16).view(np.uint16) if bf16 else w


def _x(rng, r: int, k: int) -> np.ndarray:
    x = rng.standard_normal((r, k)).astype(np.float32)
    if r > 2:
        x[1] = 0.0  # an all-zero row: +0 lane sums
        x[2] *= 1e4
    return x






@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "f32"])
@pytest.mark.parametrize("K,N", SHAPES)
def test_bits_equal_the_numpy_formula(K, N, bf16):
    rng = np.random.default_rng(K + N)
    w = _weights(rng, N, K, bf16)
    bias = rng.standard_normal(N).astype(np.float32)
    wg = cupy.asarray(w)
    for R in (1, 4, 16, 21):
        x = _x(rng, R, K)
        for b in (None, bias):
            what = f"{'bf16' if bf16 else 'f32'} K {K} N {N} R {R} bias {b is not None}"
            got = cupy.asnumpy(linear_rows(cupy.asarray(x), wg,
                                           None if b is None else cupy.asarray(b)))
            _same(got, linear_rows_reference(x, w, b), what)
            exact = x.astype(np.float64) @ weights_f32(w).astype(np.float64).T
            exact = exact + (0 if b is None else b)
            err = np.abs(got - exact)
            bound = error_bound(x, w, b)
            if not (err <= bound).all():
                i = np.unravel_index(np.argmax(err - bound), err.shape)
                raise AssertionError(f"{what}: error {err[i]:.3g} over the bound {bound[i]:.3g} "
                                     f"at {tuple(map(int, i))} ({int((err > bound).sum())} "
                                     f"outputs)")


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "f32"])
def test_a_row_is_the_same_alone_and_at_every_position(bf16):
    """Batch invariance by layout: for each batch size, a random arrangement of rows, so that
    every position of every row tile holds some row; its bits == that row computed alone."""
    K, N = 1000, 150  # odd tails on both axes
    rng = np.random.default_rng(7)
    w = cupy.asarray(_weights(rng, N, K, bf16))
    bias = cupy.asarray(rng.standard_normal(N).astype(np.float32))
    x = _x(rng, max(BATCHES), K)
    xg = cupy.asarray(x)
    alone = np.stack([cupy.asnumpy(linear_rows(xg[r:r + 1], w, bias))[0]
                      for r in range(len(x))])
    for R in BATCHES:
        for trial in range(2):
            rows = rng.permutation(len(x))[:R]
            got = cupy.asnumpy(linear_rows(xg[cupy.asarray(rows)], w, bias))
            for pos, r in enumerate(rows):
                _same(got[pos], alone[r], f"R {R} trial {trial}: row {r} at position {pos}")


def test_bf16_bits_equal_float32_weights_and_speed_knobs_do_not_change_bits():
    K, N, R = 2048, 96, 12
    rng = np.random.default_rng(3)
    bits = _weights(rng, N, K, True)
    x = cupy.asarray(_x(rng, R, K))
    want = cupy.asnumpy(linear_rows(x, cupy.asarray(bits)))
    _same(cupy.asnumpy(linear_rows(x, cupy.asarray(weights_f32(bits)))), want, "float32 w")
    for nw, pf in ((1, 2), (2, 3), (4, 4), (8, 2)):
        _same(cupy.asnumpy(linear_rows(x, cupy.asarray(bits), nw=nw, pf=pf)), want,
              f"nw {nw} pf {pf}")
    for rt in (1, 2, 4, 8):  # 12 rows as several smaller row tiles
        _same(cupy.asnumpy(linear_rows(x, cupy.asarray(bits), rt=rt)), want, f"row tile {rt}")
    with pytest.raises(ValueError, match="row tile 3"):
        linear_rows(x, cupy.asarray(bits), rt=3)
    # a weight matrix not 16-byte aligned: element loads, the same order
    flat = cupy.zeros(N * K + 1, np.uint16)
    flat[1:] = cupy.asarray(bits).ravel()
    _same(cupy.asnumpy(linear_rows(x, flat[1:].reshape(N, K))), want, "unaligned w")


@pytest.mark.parametrize("sizes", [(64,), (40, 7, 33, 1), (1, 80), (33, 16, 31)])
@pytest.mark.parametrize("R", [1, 5, 16, 17])
def test_a_split_product_gives_each_part_its_own_product(sizes, R):
    """One launch over stacked matrices (a layer's router and shared-expert projections):
    each part's array holds the bits of that part's own product, contiguous."""
    K = 1003 if R == 5 else 2048  # element loads too
    rng = np.random.default_rng(R * 100 + len(sizes))
    parts = [_weights(rng, n, K, True) for n in sizes]
    x = cupy.asarray(_x(rng, R, K))
    got = linear_rows_split(x, cupy.asarray(np.concatenate(parts)), sizes)
    assert len(got) == len(sizes)
    for i, (part, out) in enumerate(zip(parts, got, strict=True)):
        assert out.shape == (R, part.shape[0]) and out.flags.c_contiguous
        _same(cupy.asnumpy(out), cupy.asnumpy(linear_rows(x, cupy.asarray(part))), f"part {i}")


def test_a_split_product_refuses_bad_parts():
    x = cupy.zeros((2, 64), np.float32)
    w = cupy.zeros((10, 64), np.uint16)
    for sizes in ((5, 4), (10, 0), (2, 2, 2, 2, 2), ()):
        with pytest.raises(ValueError, match="parts"):
            linear_rows_split(x, w, sizes)


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_ops_linear_uses_the_kernel(dtype):
    rng = np.random.default_rng(4)
    host = (rng.standard_normal((70, 300)) * 0.1).astype(np.float32)
    bias = rng.standard_normal(70).astype(np.float32)
    ops = Ops(cupy, dtype)
    w = ops.weight("model.layers.0.self_attn.q_proj.weight", host)
    b = ops.weight("model.layers.0.self_attn.q_proj.bias", bias)
    x = _x(rng, 4, 300)  # a 4-row tile, element loads (K % 8 = 4)
    got = cupy.asnumpy(ops.linear(cupy.asarray(x), w, b))
    _same(got, linear_rows_reference(x, cupy.asnumpy(w), bias), "Ops.linear")
    assert ops.linear(cupy.zeros((0, 300), np.float32), w).shape == (0, 70)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "f32"])
def test_subnormals_are_kept_not_flushed(bf16):
    """CuPy appends -ftz=true to every compile; flushed, a row of subnormal weights or of
    subnormal activations would give 0 (or the bias alone) here. K = 264: a tail past 256."""
    K, N, R = 264, 24, 4
    rng = np.random.default_rng(11)
    w = _weights(rng, N, K, bf16)
    sub = (rng.standard_normal(K) * 1e-39).astype(np.float32)  # subnormal float32 values
    w[1] = (sub.view(np.uint32) >> 16).astype(np.uint16) if bf16 else sub
    x = rng.standard_normal((R, K)).astype(np.float32)
    x[3] = (rng.standard_normal(K) * 1e-39).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    want = linear_rows_reference(x, w, None)
    # (subnormal x subnormal underflows to 0 even unflushed: output (3, 1) is left out)
    assert (want[:3, 1] != 0).all() and (np.delete(want[3], 1) != 0).all(), want[:, 1]
    for b in (None, bias):
        got = cupy.asnumpy(linear_rows(cupy.asarray(x), cupy.asarray(w),
                                       None if b is None else cupy.asarray(b)))
        _same(got, linear_rows_reference(x, w, b), f"subnormals, bias {b is not None}")
