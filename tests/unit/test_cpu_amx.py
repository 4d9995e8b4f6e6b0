"""The AMX path of int4 experts (cpu_experts/amx.py): amx.rows16_blocks applies up to CHUNK
blocks of one micro-tile to 16 rows. Its emulated mode (generic vector IR in place of the tile
instructions, any CPU) is checked bit for bit against a NumPy float32 formula for every chunk
size, gathered and strided rows and a block offset, so the gather, the unpacking, the C
layout and the epilogue's order are tested here; on a CPU with AMX (the H200 machine) the
tile instructions must give the emulation's bits."""

import numba
import numpy as np
import pytest
from numba import njit

from cpu_experts import amx, shard
from cpu_experts import isa as cpu_isa
from cpu_experts.amx import CHUNK
from cpu_experts.isa import ISA_AMX

NB, ROWS_X, H = 11, 40, 11 * 32  # blocks of the micro-tile, activation rows, their width
HAS_AMX = ISA_AMX in cpu_isa.available()


@njit
def _apply(mode, w, woff, x, xs, xc, rows, j, b0, nb, o, ooff, ostride):
    """Blocks b0..nb-1: CHUNK at a time while that many are left, then one at a time."""
    numba.literally(mode)
    b = b0
    while b < nb:
        at = woff + (b - b0) * 288
        if nb - b >= CHUNK:
            amx.rows16_blocks(ISA_AMX, mode, CHUNK, w, at, x, xs, xc, rows, j, b, o, ooff,
                              ostride)
            b += CHUNK
        else:
            amx.rows16_blocks(ISA_AMX, mode, 1, w, at, x, xs, xc, rows, j, b, o, ooff, ostride)
            b += 1


@njit
def _apply_tiles(w, woff, x, xs, xc, rows, j, b0, nb, o, ooff, ostride):
    amx.tile_begin(ISA_AMX)
    _apply(amx.TILES, w, woff, x, xs, xc, rows, j, b0, nb, o, ooff, ostride)
    amx.tile_end(ISA_AMX)


def _case(seed: int):
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, (1, 16, H)).astype(np.int8)
    q[0, 0, :32] = -8                                     # the extremes of both operands
    q[0, 1, :32] = 7
    s = (rng.random((1, 16, NB)) * 0.02 + 1e-4).astype(np.float16)
    tiles = np.zeros((1, 1, NB, 288), np.uint8)
    shard.tile_into4(q, s, tiles)
    x = rng.integers(-128, 128, (ROWS_X, H)).astype(np.int8)
    x[3, :32], x[4, :32] = -128, 127
    xs = (rng.random((ROWS_X, NB)) * 0.05).astype(np.float32)
    xc = (-8 * x.astype(np.int32).reshape(ROWS_X, NB, 32).sum(-1)).astype(np.int32)
    return q[0], s[0].astype(np.float32), tiles.reshape(-1), x, xs, xc


def _want(q, s, x, xs, rows, b0, o0):
    """o[k] += float32(dot) * (scales * xs[r, b]) per block in order, in float32."""
    o = o0.copy()
    for k, r in enumerate(rows):
        for b in range(b0, NB):
            dot = (q[:, 32 * b:32 * b + 32].astype(np.int64)
                   * x[r, 32 * b:32 * b + 32].astype(np.int64)).sum(-1).astype(np.float32)
            o[k] = o[k] + dot * (s[:, b] * xs[r, b])
    return o


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("b0", [0, 2, NB - 1])
def test_emulated_chunks_equal_formula(gather: bool, b0: int) -> None:
    q, s, w, x, xs, xc = _case(5 + b0)
    rng = np.random.default_rng(b0)
    rows = rng.permutation(ROWS_X)[:16] if gather else np.arange(3, 19)
    o0 = rng.standard_normal((16, 16)).astype(np.float32)
    ostride = 24                                          # output rows 24 floats apart
    o = np.full(16 * ostride + 8, np.nan, np.float32)
    for k in range(16):
        o[8 + k * ostride:8 + k * ostride + 16] = o0[k]
    woff = b0 * 288
    if gather:
        _apply(amx.EMULATED, w, woff, x, xs, xc, rows.astype(np.int64), 0, b0, NB, o, 8,
               ostride)
    else:
        _apply(amx.EMULATED, w, woff, x, xs, xc, None, 3, b0, NB, o, 8, ostride)
    got = np.stack([o[8 + k * ostride:8 + k * ostride + 16] for k in range(16)])
    want = _want(q, s, x, xs, rows, b0, o0)
    assert got.view(np.int32).tobytes() == want.view(np.int32).tobytes()
    rest = np.delete(o, [8 + k * ostride + i for k in range(16) for i in range(16)])
    assert np.isnan(rest).all()                           # nothing else written


@pytest.mark.skipif(not HAS_AMX, reason="this CPU cannot run AMX tiles")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiles_equal_emulation(seed: int) -> None:
    q, s, w, x, xs, xc = _case(seed)
    rows = np.random.default_rng(seed).permutation(ROWS_X)[:16].astype(np.int64)
    got = np.zeros(16 * 16, np.float32)
    want = got.copy()
    _apply_tiles(w, 0, x, xs, xc, rows, 0, 0, NB, got, 0, 16)
    _apply(amx.EMULATED, w, 0, x, xs, xc, rows, 0, 0, NB, want, 0, 16)
    assert got.view(np.int32).tobytes() == want.view(np.int32).tobytes()


def test_tile_config_bytes() -> None:
    """Palette 1; tmm0-2 and tmm3-5 are (C 16 x 64, A 16 x 32, B 8 x 64 bytes)."""
    cfg = bytes(amx._config())
    assert cfg[0] == 1 and len(cfg) == 64 and not any(cfg[1:16])
    for base in (0, 3):
        assert [int.from_bytes(cfg[16 + 2 * (base + i):18 + 2 * (base + i)], "little")
                for i in range(3)] == [64, 32, 64]
        assert list(cfg[48 + base:51 + base]) == [16, 16, 8]
    assert not any(cfg[28:48]) and not any(cfg[54:])  # tmm6, tmm7 unused
