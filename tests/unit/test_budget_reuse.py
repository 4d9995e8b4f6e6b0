"""The adaptive budget keeps a choice for a few steps (daemon/draft_adaptive.py's module doc):
which steps choose afresh, which steps ask the worker for their routes
(``StepPlan.slot_routing``), the worker dropping the routes of a step that did not ask, and
the routing estimates learning from the steps that did."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from daemon.config import load_config
from daemon.draft_adaptive import ACCEPT_TOLERANCE, REUSE_STEPS, DraftBudget
from daemon.draft_budget import MARGIN
from daemon.draft_stats import RoutingStats
from gpu_worker.experts.counters import ExpertCounters
from protocol.codec import decode, encode
from protocol.messages import StepPlan
from scripts.sim_draft_budget import slot_work, step_record

UNIVERSE = 2000


def _budget(reuse: bool = True) -> DraftBudget:
    spec = load_config(None, {"speculation.mode": "wide",
                              "speculation.draft_budget": "adaptive"}).speculation
    budget = DraftBudget(spec)
    budget.reuse = reuse
    return budget


def _run(budget: DraftBudget, steps: int, accept_all: bool = True, most: int = 3,
         slots_at: dict[int, int] | None = None, seed: int = 0):
    """``steps`` steps of four decode slots offering ``most`` MTP drafts each; every draft
    accepted (``accept_all``) or none. Returns, per step, (solved afresh, routes asked,
    routes the budget received). ``slots_at``: from that step on, that many slots."""
    rng = np.random.default_rng(seed)
    pos = 40 + 5 * np.arange(4)
    out = []
    solved = 0
    original = budget._solve

    def counting(*args, **kwargs):
        nonlocal solved
        solved += 1
        return original(*args, **kwargs)

    budget._solve = counting
    count = 4
    for step in range(steps):
        count = (slots_at or {}).get(step, count)
        work = slot_work(pos, most)[:count]
        before = solved
        drafts = budget.choose(work, [most] * count, True)
        asked = budget.wants_routes()
        per_row = [np.sort(rng.choice(UNIVERSE, 20, replace=False))
                   for _ in range(count + sum(drafts))]
        accepted = list(drafts) if accept_all else [0] * count
        plan, result = step_record(step, work, drafts, accepted, per_row,
                                   len(np.unique(np.concatenate(per_row))), UNIVERSE,
                                   routes=asked)
        assert plan.slot_routing == asked
        budget.observe(plan, result, 0.05)
        out.append((solved > before, asked, any(len(r.cpu_experts) for r in result.slots)))
        pos = pos[:count] + 1 + np.array(accepted)
        pos = np.concatenate([pos, 40 + 5 * np.arange(count, 4)])
    return out


def test_a_choice_serves_reuse_steps_and_routes_come_on_the_two_before_the_next():
    steps = _run(_budget(), 40)
    fresh = [i for i, (solved, _, _) in enumerate(steps) if solved]
    asked = [i for i, (_, a, _) in enumerate(steps) if a]
    # the first step chooses without history and asks for routes; the first verifies move
    # the acceptance from its prior, so the next choice comes within two steps; from then
    # on one choice every REUSE_STEPS steps, routes on the two steps before each
    assert fresh[0] == 0 and fresh[1] <= 2 and 0 in asked
    assert np.diff(fresh[1:]).tolist() == [REUSE_STEPS] * (len(fresh) - 2)
    before = {f - k for f in fresh[2:] for k in (1, 2)} | {
        i for k in (1, 2) if (i := fresh[-1] + REUSE_STEPS - k) < len(steps)}
    assert set(asked) - {0, 1} == before - {0, 1}
    assert len(asked) < len(steps) / 3  # most steps read no routes
    assert all(got == a for _, a, got in steps)  # the worker sends what was asked


def test_without_reuse_every_step_chooses_from_every_steps_routes():
    steps = _run(_budget(reuse=False), 12)
    assert all(solved and asked and got for solved, asked, got in steps)


def test_a_change_of_slots_or_acceptance_chooses_again_at_once():
    steps = _run(_budget(), 20, slots_at={11: 3})
    assert steps[11][0] and steps[11][1]  # the slots changed: a new choice, routes asked
    assert steps[13][0]  # ... and again from the fresh routes of the two steps after it
    budget = _budget()
    steps = _run(budget, 6, accept_all=False)
    # no draft accepted: the estimate falls from the optimistic prior by more than the
    # tolerance, step after step, so each step chooses afresh until drafts stop
    assert all(solved for solved, _, _ in steps[:2])
    assert budget.accept.source_rate(1)[0] < 0.8 - ACCEPT_TOLERANCE


def test_persistence_is_learned_from_consecutive_steps_only():
    rng = np.random.default_rng(3)
    ids = np.sort(rng.choice(UNIVERSE, 40, replace=False))
    stats = RoutingStats()
    for step in range(0, 80, 3):  # the same experts every time, but never two steps running
        stats.observe("r", 2, ids, np.full(40, 2), UNIVERSE, step)
    assert stats.persistence == 0.5  # the prior: nothing measured
    for step in range(100, 130):
        stats.observe("r", 2, ids, np.full(40, 2), UNIVERSE, step)
    assert stats.persistence > 0.9
    # a slot whose routes are not the last step's has no history in the patterns
    log_miss, _ = stats.patterns(["r"], 129)
    stale, _ = stats.patterns(["r"], 130)
    assert log_miss.min() < stale.min()  # its own experts: likelier with the history


def test_the_worker_drops_routes_no_plan_asked_for():
    c = ExpertCounters(bytes_per_expert=1.0)
    ids = np.array([[1, 12], [13, 2]])
    for keep in (False, True):
        c.track_rows(np.array([0, 1]))
        c.add_routes(0, 16, ids, ids >= 10)
        got = c.take_slot_experts(keep)
        assert not c.tracking
        if keep:
            assert {s: v[0].tolist() for s, v in got.items()} == {0: [12], 1: [13]}
        else:
            assert got == {}


@pytest.mark.parametrize("asked", [True, False])
def test_the_plans_ask_travels_on_the_wire(asked):
    plan = StepPlan(step_id=3, slot_routing=asked)
    back = decode(encode(plan))
    assert back == dataclasses.replace(plan) and back.slot_routing is asked


def test_the_figures_say_how_the_plain_lengths_compared_with_the_choice():
    budget = _budget()
    _run(budget, 40)
    got = budget.figures()
    uniform = [got[f"uniform_{k}"] for k in range(1, 5)]
    # the choice is within the margin of the best: no plain length predicted much better
    assert max(uniform) <= 1 / (1 - MARGIN) + 1e-9
    chosen = int(np.argmax(budget.chosen))  # every slot at that count, most steps
    assert uniform[chosen - 1] == pytest.approx(1.0, abs=0.02)
    assert min(uniform) < 0.99  # and some plain length predicted worse
