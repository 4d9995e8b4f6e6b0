"""The AMX path of int4 experts (cpu_experts/amx.py): amx.run16 applies all blocks of one micro-
tile to 16 consecutive rows as a pipeline over chunks of blocks. Its emulated mode (generic
vector IR in place of the tile instructions, any CPU) is checked bit for bit against a NumPy
float32 formula for every chunk size (block counts 16, 12, 10, 11: chunks of 8, 4, 2, 1),
a row offset and strided outputs, so the pipeline's buffers, the unpacking, the C layout and
the epilogue's order are tested here; on a CPU with AMX (the H200 machine) the tile
instructions must give the emulation's bits."""

import numpy as np
import pytest
from numba import njit

from cpu_experts import amx, shard
from cpu_experts import isa as cpu_isa
from cpu_experts.amx import EMULATED, TILES
from cpu_experts.isa import ISA_AMX

ROWS_X = 24  # activation rows; the 16 used start at row J
J = 5
HAS_AMX = ISA_AMX in cpu_isa.available()


@njit
def _emulated(w, nb, x, xs, o, ooff, ostride):
    bbuf, cbuf = amx.buffers()
    amx.run16(ISA_AMX, EMULATED, w, 0, 288, nb, 0, x, xs, J, o, ooff, ostride, bbuf, cbuf)


@njit
def _tiles(w, nb, x, xs, o, ooff, ostride):
    bbuf, cbuf = amx.buffers()
    amx.tile_begin(ISA_AMX)
    amx.run16(ISA_AMX, TILES, w, 0, 288, nb, 0, x, xs, J, o, ooff, ostride, bbuf, cbuf)
    amx.tile_end(ISA_AMX)


def _case(seed: int, nb: int):
    rng = np.random.default_rng(seed)
    h = 32 * nb
    q = rng.integers(-8, 8, (1, 16, h)).astype(np.int8)
    q[0, 0, :32] = -8                                     # the extremes of both operands
    q[0, 1, :32] = 7
    s = (rng.random((1, 16, nb)) * 0.02 + 1e-4).astype(np.float16)
    tiles = np.zeros((1, 1, nb, 288), np.uint8)
    shard.tile_into4(q, s, tiles)
    x = rng.integers(-128, 128, (ROWS_X, h)).astype(np.int8)
    x[J, :32], x[J + 1, :32] = -128, 127
    xs = (rng.random((ROWS_X, nb)) * 0.05).astype(np.float32)
    return q[0], s[0].astype(np.float32), tiles.reshape(-1), x, xs


def _want(q, s, x, xs, o0):
    """o[k] += float32(dot) * (scales * xs[r, b]) per block in order, in float32."""
    o = o0.copy()
    for k in range(16):
        r = J + k
        for b in range(s.shape[1]):
            dot = (q[:, 32 * b:32 * b + 32].astype(np.int64)
                   * x[r, 32 * b:32 * b + 32].astype(np.int64)).sum(-1).astype(np.float32)
            o[k] = o[k] + dot * (s[:, b] * xs[r, b])
    return o


@pytest.mark.parametrize("nb", [16, 12, 10, 11])
def test_emulated_pipeline_equals_formula(nb: int) -> None:
    q, s, w, x, xs = _case(nb, nb)
    o0 = np.random.default_rng(nb).standard_normal((16, 16)).astype(np.float32)
    ostride = 24                                          # output rows 24 floats apart
    o = np.full(16 * ostride + 8, np.nan, np.float32)
    at = [8 + k * ostride + i for k in range(16) for i in range(16)]
    o[at] = o0.reshape(-1)
    _emulated(w, nb, x, xs, o, 8, ostride)
    want = _want(q, s, x, xs, o0)
    assert o[at].view(np.int32).tobytes() == want.reshape(-1).view(np.int32).tobytes()
    assert np.isnan(np.delete(o, at)).all()              # nothing else written


@pytest.mark.skipif(not HAS_AMX, reason="this CPU cannot run AMX tiles")
@pytest.mark.parametrize("nb", [16, 12, 10, 11, 64])
def test_tiles_equal_emulation(nb: int) -> None:
    q, s, w, x, xs = _case(100 + nb, nb)
    got = np.zeros(16 * 16, np.float32)
    want = got.copy()
    _tiles(w, nb, x, xs, got, 0, 16)
    _emulated(w, nb, x, xs, want, 0, 16)
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


def test_buffers_start_on_cache_lines() -> None:
    """Tile rows are 64 bytes: scratch on a 32-byte boundary splits each across two lines."""
    for _ in range(8):
        bbuf, cbuf = amx.buffers()
        assert bbuf.ctypes.data % 64 == 0 and cbuf.ctypes.data % 64 == 0
        assert bbuf.size == 2 * amx.B_CHUNK and cbuf.size == 2 * amx.C_CHUNK
