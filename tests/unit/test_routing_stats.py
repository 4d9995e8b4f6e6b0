"""RoutingStats (daemon/draft_stats.py): the persistence of a slot's experts between steps,
the effective number of CPU experts picks spread over, and the routing patterns the adaptive
budget's expected union is summed over (docs/speculation.md, "Which experts a row will
pick")."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.draft_stats import MAX_SHARE_IDS, POPULARITY_EMA, RoutingStats


def test_routing_persistence_is_measured_over_chance():
    universe = 1000
    same, fresh = RoutingStats(), RoutingStats()
    rng = np.random.default_rng(2)
    ids = np.sort(rng.choice(universe, 40, replace=False))
    for _ in range(40):
        same.observe("r", 2, ids, np.full(40, 2), universe)  # the same experts every step
        new = np.sort(rng.choice(universe, 40, replace=False))
        fresh.observe("r", 2, new, np.full(40, 2), universe)
    assert same.persistence > 0.95 and fresh.persistence < 0.1
    assert same.picks_per_row == 40.0
    log_miss, weight = same.patterns(["r", None])
    # the same 40 experts every step: picks spread over far fewer than the universe
    assert weight.sum() == same.effective < universe / 2 and log_miss.shape == (2, 2)
    assert fresh.effective > 0.8 * universe  # fresh picks: about the universe


@pytest.mark.parametrize("seed", range(4))
def test_routing_observe_sorts_what_it_keeps_and_measures_as_isin_would(seed):
    # observe keeps a slot's experts sorted (the worker sends them so) and finds last
    # step's by binary search: the same persistence as np.isin, whatever the input order
    rng = np.random.default_rng(seed)
    universe = 3000
    steps = [rng.choice(universe, int(rng.integers(0, 600)), replace=False) for _ in range(6)]
    counts = [rng.integers(1, 5, len(ids)) for ids in steps]
    shuffled, ordered = RoutingStats(), RoutingStats()
    persistence, prev = 0.5, None
    share = np.full(universe, 1.0 / universe)  # each expert's share of the picks (EMA)
    for ids, c in zip(steps, counts, strict=True):
        shuffled.observe("r", 4, ids, c, universe)
        order = np.argsort(ids)
        ordered.observe("r", 4, ids[order], c[order], universe)
        if prev is not None and len(ids):
            hit = c[np.isin(ids, prev)].sum() / c.sum()
            chance = share[prev].sum()  # where a fresh pick lands by the shares so far
            persistence += 0.1 * (min(max((hit - chance) / (1 - chance), 0), 1) - persistence)
        if len(ids):
            share *= 1 - POPULARITY_EMA
            share[ids] += POPULARITY_EMA * c / c.sum()
        prev = ids if len(ids) else prev
        kept_ids, kept_counts, _ = shuffled.last["r"] if len(ids) else (None, None, None)
        if len(ids):
            assert np.array_equal(kept_ids, ids[order]) and np.array_equal(kept_counts,
                                                                           c[order])
    assert shuffled.persistence == ordered.persistence == pytest.approx(persistence)
    assert shuffled.persistence != 0.5  # measured


def test_the_effective_expert_count_follows_the_skew_of_the_picks():
    # a skewed router (Zipf shares) makes rows collide as often as uniform picks over
    # 1 / sum(share^2) experts would: the count the union of a step's rows is predicted on
    universe, rng = 5000, np.random.default_rng(3)
    for skew in (0.0, 0.7, 1.0):
        share = np.arange(1, universe + 1) ** -skew
        share /= share.sum()
        stats = RoutingStats()
        assert stats.effective == 0
        for step in range(600):
            picks = rng.choice(universe, 1200, p=share)
            ids, counts = np.unique(picks, return_counts=True)
            stats.observe(f"r{step % 4}", 3, ids, counts, universe)
        want = min(universe, 1.0 / (share @ share))
        assert stats.effective == pytest.approx(want, rel=0.1), skew


@pytest.mark.parametrize("seed", range(6))
def test_keyed_patterns_equal_the_row_sort_bit_for_bit(seed):
    # RoutingStats.patterns keys each expert's counts as one integer; the reference sorts
    # the [K, S] fraction rows (draft_budget.patterns): the same patterns, order and bits
    rng = np.random.default_rng(seed)
    universe = int(rng.integers(50, 3000))
    stats = RoutingStats()
    names = [f"r{i}" for i in range(int(rng.integers(1, 6)))]
    for name in names:
        for _ in range(2):
            rows = int(rng.integers(1, 17))
            ids = np.sort(rng.choice(universe, int(rng.integers(0, min(universe, 400))),
                                     replace=False))
            stats.observe(name, rows, ids, rng.integers(1, rows + 1, len(ids)), universe)
    slots = [n if rng.random() < 0.8 else None for n in names] + [None]
    hist = [stats.last.get(r) if r is not None else None for r in slots]
    history = np.array([h is not None for h in hist])
    p0 = stats.picks_per_row / stats.effective
    want = stats._patterns_by_rows(hist, history, p0, stats.effective)
    got = stats.patterns(slots)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.tobytes() == w.tobytes()


def test_ids_past_any_models_layers_keep_their_routing_and_teach_no_share():
    stats = RoutingStats()
    huge = np.array([3, MAX_SHARE_IDS + 5])
    stats.observe("r", 2, huge, np.array([1, 2]), 1000)
    assert stats.last["r"][0].tolist() == huge.tolist()  # its routing is kept
    assert len(stats._seen) == 0 and stats.effective == 1000  # no 32 MB+ array, no share
    stats.observe("r", 0, np.array([3]), np.array([1]), 1000)  # no rows: nothing to learn
    assert stats.last["r"][0].tolist() == huge.tolist()
