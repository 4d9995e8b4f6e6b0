"""The synthetic routing kernel (gpu_worker/kernels/synthetic_routing.py) gives the host's
ids bit for bit (RoutingModel.choose_layers): skewed and uniform popularity, with and without
locality (the walk back to a lane's renewal), position 0, rows of one slot and of several,
layers renumbered for a split placement."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.synthetic_routing import DeviceRoutingTables
from gpu_worker.weights.routing import RoutingModel, RoutingParams

cupy = pytest.importorskip("cupy")


@pytest.mark.parametrize("E, k, skew, locality", [(512, 10, 1.0, 0.5), (128, 8, 0.0, 0.0),
                                                  (16, 4, 0.7, 0.9), (64, 6, 1.2, 0.3)])
def test_the_kernel_gives_the_hosts_ids(E, k, skew, locality):
    model = RoutingModel(E, k, RoutingParams(skew=skew, locality=locality), seed=7)
    rng = np.random.default_rng(E + k)
    slots = rng.integers(0, 4, 29)
    positions = rng.integers(0, 3000, 29)
    positions[:3] = [0, 1, 511]
    layers = [0, 2, 5, 47]
    model.renumber(5, rng.permutation(E))  # a split placement's hottest-first order
    tables = DeviceRoutingTables(model, layers)
    got = tables.choose(cupy.asarray(slots), cupy.asarray(positions)).get()
    assert np.array_equal(got, model.choose_layers(layers, slots, positions))


def test_no_rows():
    model = RoutingModel(16, 4, RoutingParams(skew=1.0, locality=0.5))
    tables = DeviceRoutingTables(model, [0, 1])
    empty = cupy.zeros(0, cupy.int64)
    assert tables.choose(empty, empty).shape == (2, 0, 4)
