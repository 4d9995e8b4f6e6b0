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
    assert same.effective < universe / 2 and fresh.effective > 0.8 * universe
    assert weight.sum() == universe and log_miss.shape[1] == 2
    # the 40 are the hot class: a row of a fresh slot picks one of them far likelier than
    # one of the rest, and a row of the slot itself likelier still (persistence)
    pick = 1 - np.exp(log_miss)  # [P, S]: a row's chance to pick an expert of a pattern
    hot = pick[:, 1].argmax()
    uniform = same.picks_per_row / universe
    assert weight[hot] == 40 and pick[hot, 1] > 5 * uniform
    assert np.delete(pick[:, 1], hot).max() < uniform and pick[hot, 0] > pick[hot, 1]


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
    # RoutingStats.patterns keys each expert's counts and popularity class as one integer;
    # the reference sorts the [K, S + 1] rows of fractions and fresh-pick chance
    # (draft_budget.patterns): the same patterns, order and bits
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
    want = stats._patterns_by_rows(hist, history)
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


def _chain(rng, share, picks, rows, prev, keep):
    """``rows`` consecutive rows of ``picks`` distinct experts each, every row keeping each
    expert of the row before (``prev`` for the first) with chance ``keep``, the rest fresh
    picks by ``share``."""
    out = []
    for _ in range(rows):
        kept = prev[rng.random(len(prev)) < keep] if prev is not None else prev
        row = set(kept.tolist()) if kept is not None else set()
        while len(row) < picks:
            row.update(rng.choice(len(share), picks - len(row), p=share).tolist())
        prev = np.array(sorted(row))[:picks]
        out.append(prev)
    return out


def _learned(rng, share, keep, rows=3, steps=150, slots=4, picks=60):
    """RoutingStats after ``steps`` steps of ``slots`` chained slots of ``rows`` rows."""
    stats, last = RoutingStats(), [None] * slots
    for _ in range(steps):
        for s in range(slots):
            chain = _chain(rng, share, picks, rows, last[s], keep)
            last[s] = chain[-1]
            ids, counts = np.unique(np.concatenate(chain), return_counts=True)
            stats.observe(f"r{s}", rows, ids, counts, len(share))
    return stats, last


@pytest.mark.parametrize("keep", [0.0, 0.3, 0.6])
def test_the_locality_of_consecutive_rows_is_measured(keep):
    # rows that keep a share of the row before's experts touch fewer than independent rows;
    # the budget learns that share from each slot's distinct experts (Zipf-skewed picks)
    rng = np.random.default_rng(5)
    share = np.arange(1, 3001) ** -0.7
    stats, _ = _learned(rng, share / share.sum(), keep)
    assert stats.locality == pytest.approx(keep, abs=0.05)


def test_the_predicted_union_follows_skewed_chained_rows():
    # the union of a step's rows as the budget predicts it (popularity classes, persistence,
    # locality) against the mean of many such steps drawn the same way, 1 to 4 rows a slot:
    # within 5 %, and so its growth from one draft row to the next (what a draft costs)
    from daemon.draft_budget import expected_union, fresh_rows  # noqa: PLC0415

    rng = np.random.default_rng(6)
    share = np.arange(1, 3001) ** -0.8
    share /= share.sum()
    stats, last = _learned(rng, share, 0.3)
    log_miss, weight = stats.patterns([f"r{s}" for s in range(4)])
    for rows in (1, 2, 3, 4):
        drawn = [len(np.unique(np.concatenate(
            [np.concatenate(_chain(rng, share, 60, rows, last[s], 0.3)) for s in range(4)])))
            for _ in range(40)]
        want = np.mean(drawn)
        got = expected_union(fresh_rows(np.full((1, 4), rows), stats.locality), log_miss,
                             weight)[0]
        assert got == pytest.approx(want, rel=0.05), rows
