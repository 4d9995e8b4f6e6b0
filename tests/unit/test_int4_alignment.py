"""The int4 kernels wherever the tiles lie in memory: a 288-byte block starts on a cache line
or 32 bytes into one (every other block of a 64-byte-aligned shard), and the 64-byte chunk
loads take a different path for each (tiles4._chunks64: aligned lines joined, or direct
loads). Every start, those two and unaligned ones, gives the emulation's bits, on every
instruction set this CPU runs, at 1 row and at 16 (the wide calls)."""

import numpy as np
import pytest

from cpu_experts import isa as cpu_isa
from cpu_experts import kernels, reference, shard
from cpu_experts.quant import quantize

ISAS = [pytest.param(i, id=cpu_isa.NAMES[i], marks=pytest.mark.skipif(
    i not in cpu_isa.available(), reason=f"this CPU cannot run {cpu_isa.NAMES[i]}"))
    for i in cpu_isa.NAMES]
E, I, H = 3, 96, 320  # down tiles of 3 blocks (864 bytes): their starts alternate too


@pytest.fixture(scope="module")
def layer() -> shard.QuantizedLayer:
    rng = np.random.default_rng(17)
    return shard.quantize_layer(*(rng.standard_normal(s).astype(np.float32) * 0.03
                                  for s in ((E, I, H), (E, I, H), (E, H, I))), "int4")


def placed(ql: shard.QuantizedLayer, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """The layer's int4 tiles in a buffer starting ``offset`` bytes past a 64-byte line."""
    manifest, size = shard.plan_shard({0: ql}, {0: (0, I)}, "int4")
    raw = np.zeros(size + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    buf = raw[start:start + size]
    shard.write_shard(buf, manifest, {0: ql}, {0: (0, I)})
    gu, down = shard.views(buf, manifest)[0]
    assert gu.ctypes.data % 64 == offset
    return gu, down


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("offset", [0, 32, 16, 8, 1])
def test_tile_start_does_not_change_bits(layer, offset: int, isa: int) -> None:
    gu, down = placed(layer, offset)
    rng = np.random.default_rng(offset)
    for rows in (1, 16):
        xq, xs = quantize(rng.standard_normal((rows, H)).astype(np.float32))
        ids = rng.integers(0, E, (rows, 2))
        ids[:, 1] = (ids[:, 0] + 1) % E  # two distinct experts per row
        w = rng.random(ids.shape).astype(np.float32)
        out = np.full((rows, H), np.nan, np.float32)
        rc = kernels.layer_kernel(isa)(gu, down, xq, xs.view(np.uint16), ids.astype(np.int32),
                                       w, out, kernels.PREFETCH_AHEAD)
        assert rc == kernels.ERR_OK
        want = reference.moe_reference([layer.shard(0, I)], xq, xs, ids, w)
        bad = np.argwhere(out.view(np.int32) != want.view(np.int32))
        assert not bad.size, f"rows={rows}: {len(bad)} outputs differ, first at {bad[0]}"
