"""The synthetic routing kernel (gpu_worker/kernels/synthetic_routing.py) gives the host's
ids bit for bit (RoutingModel.choose_layers): skewed and uniform popularity, with and without
locality (the walk back to a lane's renewal), position 0, rows of one slot and of several,
layers renumbered for a split placement, routing keys of the whole 63 bits (a request's
SlotWork.route_key)."""

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


def test_the_kernel_takes_63_bit_routing_keys():
    """Keys past 32 bits up to 2**63 - 1 (the daemon's hash of a request's user) give the
    host's ids, which are not the ids of small keys (slots)."""
    model = RoutingModel(64, 6, RoutingParams(skew=0.66, locality=0.5), seed=3)
    keys = np.array([0, 2, 2**32 + 1, 3835311112964728579, 2**63 - 1] * 4, np.int64)
    positions = np.arange(keys.size, dtype=np.int64) * 97
    layers = [0, 3]
    tables = DeviceRoutingTables(model, layers)
    got = tables.choose(cupy.asarray(keys), cupy.asarray(positions)).get()
    want = model.choose_layers(layers, keys, positions)
    assert np.array_equal(got, want)
    assert not np.array_equal(want, model.choose_layers(layers, keys % 3, positions))
