"""The synthetic routing model: its statistics follow the knobs (popularity skew, per-sequence
locality), uniform when both are 0; a row's experts depend only on (seed, layer, slot,
position), never on the batch; the calibration fit recovers known knobs."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.expert_stats import consecutive_overlap, hot_order
from gpu_worker.weights import routing_fit as fit
from gpu_worker.weights.routing import RoutingModel, RoutingParams

T = 6000  # positions per sequence


def _sequence(model: RoutingModel, layer: int = 0, slot: int = 0, n: int = T) -> np.ndarray:
    return model.choose(layer, np.full(n, slot), np.arange(n))


def _overlap(ids: np.ndarray) -> float:
    shared, pairs = consecutive_overlap(ids)
    return shared / (pairs * ids.shape[1])


def test_picks_are_distinct_valid_and_deterministic():
    m = RoutingModel(32, 6, RoutingParams(1.5, 0.7), seed=3)
    ids = _sequence(m, layer=2)
    assert ids.shape == (T, 6) and ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < 32
    assert all(len(set(row)) == 6 for row in ids)
    again = RoutingModel(32, 6, RoutingParams(1.5, 0.7), seed=3)
    assert (_sequence(again, layer=2) == ids).all()
    assert not (_sequence(RoutingModel(32, 6, RoutingParams(1.5, 0.7), seed=4), 2) == ids).all()
    assert not (_sequence(m, layer=3) == ids).all()  # layers have their own picks


def test_uniform_when_both_knobs_are_zero():
    E, k = 16, 4
    ids = _sequence(RoutingModel(E, k, RoutingParams(0.0, 0.0), seed=1), n=20000)
    counts = np.bincount(ids.ravel(), minlength=E)
    expected = ids.size / E
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 45  # 15 degrees of freedom: p < 1e-4 above ~40
    # independent tokens share k/E of their experts on average
    assert abs(_overlap(ids) - k / E) < 0.015


@pytest.mark.parametrize("skew", [0.5, 1.2])
def test_single_picks_follow_the_zipf_popularity(skew):
    m = RoutingModel(16, 1, RoutingParams(skew, 0.0), seed=5)
    ids = _sequence(m, n=40000)
    by_rank = np.bincount(ids.ravel(), minlength=16)[m.ranking(0)] / ids.size
    np.testing.assert_allclose(by_rank, m.popularity, atol=0.008)
    np.testing.assert_allclose(m.expected_counts(0)[m.ranking(0)], m.popularity)


@pytest.mark.parametrize("skew", [0.4, 0.9, 1.5])
def test_the_fit_recovers_the_skew_of_k_distinct_picks(skew):
    m = RoutingModel(32, 4, RoutingParams(skew, 0.0), seed=7)
    counts = [np.bincount(_sequence(m, layer).ravel(), minlength=32) for layer in range(4)]
    assert abs(fit.fit_skew(counts, 4) - skew) <= 0.1


@pytest.mark.parametrize("skew,locality", [(0.0, 0.5), (0.8, 0.3), (0.8, 0.8)])
def test_consecutive_tokens_share_what_locality_and_chance_give(skew, locality):
    E, k = 64, 8
    m = RoutingModel(E, k, RoutingParams(skew, locality), seed=2)
    ids = _sequence(m)
    measured = _overlap(ids)
    expected = fit.expected_overlap(locality, skew, E, k)
    assert abs(measured - expected) < 0.03, (measured, expected)
    assert abs(fit.fit_locality(measured, skew, E, k) - locality) < 0.04
    # locality does not change popularity: a fresh pick still follows the skew
    shares = np.bincount(ids.ravel(), minlength=E)[m.ranking(0)] / ids.size
    np.testing.assert_allclose(shares, m.popularity, atol=0.012)


def test_sequences_in_other_slots_are_independent():
    m = RoutingModel(64, 8, RoutingParams(0.0, 0.9), seed=0)
    a, b = _sequence(m, slot=0, n=2000), _sequence(m, slot=1, n=2000)
    same = (a[:, :, None] == b[:, None, :]).any(axis=2).mean()
    assert abs(same - 8 / 64) < 0.03


def test_a_rows_experts_do_not_depend_on_the_batch():
    m = RoutingModel(128, 8, RoutingParams(0.7, 0.6), seed=9)
    slots = np.array([0, 0, 0, 2, 2, 5, 1])
    positions = np.array([40, 41, 42, 7, 8, 1000, 0])
    batch = m.choose(4, slots, positions)
    for r in range(len(slots)):
        alone = m.choose(4, slots[r:r + 1], positions[r:r + 1])
        assert (alone[0] == batch[r]).all()
    bound = m.bind(slots[::-1], positions[::-1])  # reordered rows: same rows, same experts
    assert (bound.ids(4) == batch[::-1]).all()


def test_renumbering_follows_the_placements_permutation():
    m = RoutingModel(16, 4, RoutingParams(1.0, 0.3), seed=1)
    before = _sequence(m, layer=1, n=500)
    order = hot_order(np.bincount(before.ravel(), minlength=16))
    m.renumber(1, order)
    after = _sequence(m, layer=1, n=500)
    new_id = np.argsort(order)
    assert (after == new_id[before]).all()
    assert m.expected_counts(1)[0] == m.popularity.max()  # the hottest is now expert 0


def test_knobs_are_checked():
    with pytest.raises(ValueError, match="skew"):
        RoutingParams(-0.1, 0.0)
    with pytest.raises(ValueError, match="locality"):
        RoutingParams(0.0, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        RoutingModel(4, 5)


def test_all_layers_at_once_equal_one_layer_at_a_time():
    """choose_layers (a pass's routing before it runs) gives each layer's choose."""
    rng = np.random.default_rng(8)
    for params in (RoutingParams(skew=1.0, locality=0.5), RoutingParams()):
        model = RoutingModel(64, 6, params, seed=2)
        slots, positions = rng.integers(0, 4, 17), rng.integers(0, 3000, 17)
        positions[3] = 0
        layers = [0, 3, 7, 40]
        got = model.choose_layers(layers, slots, positions)
        assert got.shape == (4, 17, 6)
        for i, layer in enumerate(layers):
            assert np.array_equal(got[i], model.choose(layer, slots, positions))
            assert np.array_equal(got[i, 5:9], model.choose(layer, slots[5:9], positions[5:9]))
