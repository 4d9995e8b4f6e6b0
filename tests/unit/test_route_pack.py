"""gpu_worker/kernels/route_pack.py on the CUDA emulator (scripts/cuda_emu): the packing
kernel gives its NumPy reference's values for both id dtypes, partial blocks and several
blocks a layer; and the per-slot experts read from device route buffers (as the launched
path keeps them) are those read from the same routes on the host."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from gpu_worker.experts.counters import ExpertCounters
from gpu_worker.kernels.route_pack import pack_routes, pack_routes_reference
from scripts.cuda_emu.module import gxx

pytestmark = pytest.mark.skipif(gxx() is None, reason="no g++ for the CUDA emulator")


@pytest.fixture
def cupy(monkeypatch):
    from scripts.cuda_emu import fake_cupy  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    return fake_cupy


def _layers(rng, L: int, R: int, k: int, E: int, dtype):
    ids = [rng.integers(0, E, (R, k)).astype(dtype) for _ in range(L)]
    cpu = [rng.random((R, k)) < 0.7 for _ in range(L)]
    return [layer * E for layer in range(L)], ids, cpu


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(3, 1, 4), (5, 33, 10)])  # 33 x 10: three blocks a layer
def test_packing_kernel_gives_the_reference(cupy, dtype, shape) -> None:
    rng = np.random.default_rng(3)
    bases, ids, cpu = _layers(rng, *shape, 512, dtype)
    want = pack_routes_reference(bases, ids, cpu)
    got = pack_routes(bases, [cupy.asarray(a) for a in ids], [cupy.asarray(c) for c in cpu])
    assert got.dtype == np.int32 and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    assert (got == -1).any() and (got >= 512).any()  # both kinds of pick, past layer 0


def test_packing_refuses_mixed_routes(cupy) -> None:
    ids = [cupy.zeros((2, 3), np.int64), cupy.zeros((2, 3), np.int32)]
    cpu = [cupy.zeros((2, 3), bool)] * 2
    with pytest.raises(ValueError, match="routes to pack"):
        pack_routes([0, 8], ids, cpu)
    with pytest.raises(TypeError, match="int32 or int64"):
        pack_routes([0], [cupy.zeros((2, 3), np.int16)], cpu[:1])


def test_device_routes_give_the_host_routes_experts(cupy) -> None:
    rng = np.random.default_rng(4)
    row_slot = np.array([1, 1, 1, -1, 0, 0, 3], np.int64)
    bases, ids, cpu = _layers(rng, 6, len(row_slot), 4, 64, np.int64)
    got = {}
    for name, xp in (("host", np), ("device", cupy)):
        c = ExpertCounters(1.0)
        c.track_rows(row_slot)
        for layer, (a, m) in enumerate(zip(ids, cpu, strict=True)):
            c.add_routes(layer, 64, xp.asarray(a), xp.asarray(m))
        got[name] = c.take_slot_experts()
    assert set(got["device"]) == set(got["host"]) == {0, 1, 3}
    for s, (e, n) in got["host"].items():
        assert got["device"][s][0].tobytes() == e.tobytes()
        assert got["device"][s][1].tobytes() == n.tobytes()
