"""gpu_worker/kernels/route_pack.py on a CUDA device: a pass's routes at the synthetic 80B's
shape (49 routed layers, 16 rows, top-10 of 512, the router's int64 ids) packed in one launch
equal the NumPy reference; and int32 ids, a row count past one block, too."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.route_pack import pack_routes, pack_routes_reference

cp = pytest.importorskip("cupy")


@pytest.mark.parametrize(("layers", "rows", "dtype"), [(49, 16, np.int64), (3, 300, np.int32)])
def test_device_packing_equals_the_reference(layers, rows, dtype) -> None:
    rng = np.random.default_rng(9)
    ids = [np.argsort(rng.random((rows, 512)), axis=1)[:, :10].astype(dtype)
           for _ in range(layers)]
    cpu = [a >= 45 for a in ids]
    bases = [layer * 512 for layer in range(layers)]
    got = pack_routes(bases, [cp.asarray(a) for a in ids], [cp.asarray(c) for c in cpu])
    assert got.tobytes() == pack_routes_reference(bases, ids, cpu).tobytes()
