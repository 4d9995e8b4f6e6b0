"""The adaptive budget's anchor (daemon/draft_adaptive.DraftBudget._anchor): a choice not
clearly better than the uniform length its choices found best on average takes that length."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.config import load_config
from daemon.draft_adaptive import ANCHOR, ANCHOR_SPAN, DraftBudget

ALT = np.minimum(np.arange(1, 5)[:, None], np.array([3, 3, 3, 3])[None, :])  # [k, S]


def _budget() -> DraftBudget:
    spec = load_config(None, {"speculation.mode": "wide",
                              "speculation.draft_budget": "adaptive"}).speculation
    return DraftBudget(spec)


def _ratios(two: float, three: float, chosen: float) -> np.ndarray:
    """Predicted tokens per ms of all-1 .. all-4 (4 capped at the offer 3) and the choice."""
    return np.array([0.9, two, three, three, chosen])


def test_a_wavering_forecast_keeps_the_length_best_on_average():
    budget = _budget()
    # all-3 predicted 1.3 % better on average, all-2 better every third choice
    got = []
    for i in range(30):
        two, three = (1.0, 0.992) if i % 3 == 2 else (1.0, 1.03)
        mixed = max(two, three) * (1.0 + ANCHOR / 2)  # [2, 3, 3, 2]: hardly better
        out, r = budget._anchor([2, 3, 3, 2], ALT, _ratios(two, three, mixed), 4)
        got.append(out)
        assert r == pytest.approx(three if out == [3] * 4 else mixed)
    assert all(out == [3, 3, 3, 3] for out in got[3:])


def test_a_choice_clearly_better_than_every_uniform_length_stands():
    budget = _budget()
    for _ in range(5):
        out, r = budget._anchor([1, 3, 0, 2], ALT, _ratios(1.0, 1.01, 1.01 * (1 + 3 * ANCHOR)),
                                4)
        assert out == [1, 3, 0, 2] and r == pytest.approx(1.01 * (1 + 3 * ANCHOR))


def test_the_average_is_kept_per_number_of_drafted_slots_and_off_at_zero():
    budget = _budget()
    for _ in range(10):  # four drafted slots: 3 best
        budget._anchor([2, 2, 2, 2], ALT, _ratios(1.0, 1.02, 1.0), 4)
    two_slots = np.minimum(np.arange(1, 5)[:, None], np.array([3, 3, 0, 0])[None, :])
    out, _ = budget._anchor([3, 2, 0, 0], two_slots, _ratios(1.02, 1.0, 1.02), 2)
    assert out == [2, 2, 0, 0]  # two drafted slots: their own average, 2 best
    budget.anchor = 0.0
    assert budget._anchor([2, 2, 2, 2], ALT, _ratios(1.0, 1.02, 1.0), 4)[0] == [2, 2, 2, 2]


def test_a_length_predicted_far_worse_now_is_not_held():
    # the estimates moved (a request's acceptance turned): not a wavering forecast
    budget = _budget()
    for _ in range(10):
        budget._anchor([3, 3, 3, 3], ALT, _ratios(1.0, 1.02, 1.02), 4)
    near = _ratios(1.0, 1.0 - ANCHOR_SPAN / 2, 1.0)  # all-2 best now, all-3 near it
    assert budget._anchor([2, 2, 2, 2], ALT, near, 4)[0] == [3, 3, 3, 3]
    far = _ratios(1.0, 1.0 - 2 * ANCHOR_SPAN, 1.0)  # all-2 now clearly best
    assert budget._anchor([2, 2, 2, 2], ALT, far, 4)[0] == [2, 2, 2, 2]
