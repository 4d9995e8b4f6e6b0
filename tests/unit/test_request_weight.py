"""How far a request's acceptance estimate leans on its source's (daemon/draft_accept.py,
``request_weight``): by the spread of the source's requests' own rates, an empirical Bayes
prior."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.draft_accept import (
    REQUEST_PRIOR_TRIALS,
    SPREAD_MIN,
    SPREAD_REQUESTS,
    WEIGHT_RANGE,
    AcceptanceStats,
)


def _verifies(acc: AcceptanceStats, request: str, rate: float, n: int,
              rng: np.random.Generator, source: int = 1) -> None:
    """``n`` one-draft verifies of ``request``, each accepted with ``rate``."""
    for _ in range(n):
        acc.observe(request, source, drafts=1, accepted=int(rng.random() < rate))


def _ended(acc: AcceptanceStats, rates: list[float], n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for i, rate in enumerate(rates):
        _verifies(acc, f"r{i}", rate, n, rng)
    acc.keep(set())  # all ended


def test_few_requests_keep_the_fixed_weight():
    acc = AcceptanceStats()
    _ended(acc, [0.9] * (SPREAD_MIN - 1), 40)
    assert acc.request_weight(1) == REQUEST_PRIOR_TRIALS
    rng = np.random.default_rng(1)
    _verifies(acc, "short", 0.9, 5, rng)  # too few verifies to count
    assert acc.request_weight(1) == REQUEST_PRIOR_TRIALS
    _verifies(acc, "live", 0.9, 40, rng)  # a live request counts once it has enough
    assert acc.request_weight(1) != REQUEST_PRIOR_TRIALS


def test_requests_that_accept_alike_lean_on_the_source():
    acc = AcceptanceStats()
    _ended(acc, [0.88] * 40, 40)
    # their rates spread no wider than 40 verifies' sampling explains (what is left is that
    # estimate's own noise): the source's rate stands for each, 4x the fixed weight at least
    assert acc.request_weight(1) >= 4 * REQUEST_PRIOR_TRIALS
    rng = np.random.default_rng(2)
    for _ in range(3):  # a new request's first misses hardly move its estimate
        acc.observe("new", 1, drafts=2, accepted=0)
    assert acc.rate("new", 1)[0] > acc.source_rate(1)[0] - 0.03
    _verifies(acc, "other", 0.88, 1, rng, source=2)  # another source: its own weight
    assert acc.request_weight(2) == REQUEST_PRIOR_TRIALS


def test_requests_that_differ_follow_their_own_counts():
    acc = AcceptanceStats()
    _ended(acc, [0.97, 0.45] * 20, 40)
    # the true rates' spread (0.26) dwarfs the sampling's: a few trials' weight
    assert acc.request_weight(1) == pytest.approx(WEIGHT_RANGE[0])
    for _ in range(6):
        acc.observe("poor", 1, drafts=2, accepted=0)
    assert acc.rate("poor", 1)[0] < 0.35  # its own misses decide (16 trials: 0.53)


def test_the_spread_is_over_the_last_requests_and_moves_with_them():
    acc = AcceptanceStats()
    _ended(acc, [0.97, 0.45] * 20, 40)
    low = acc.request_weight(1)
    _ended(acc, [0.88] * SPREAD_REQUESTS, 40, seed=3)  # the mixed ones age out
    assert len(acc.ended[1]) == SPREAD_REQUESTS
    assert acc.request_weight(1) > 20 * low
