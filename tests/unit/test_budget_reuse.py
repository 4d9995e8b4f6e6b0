"""The adaptive budget keeps a choice for a few steps (daemon/draft_adaptive.py's module doc):
which steps choose afresh, which steps ask the worker for their routes
(``StepPlan.slot_routing``), the worker dropping the routes of a step that did not ask, and
the routing estimates learning from the steps that did."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from daemon.config import load_config
from daemon.draft_adaptive import ACCEPT_TOLERANCE, REUSE_STEPS, ROUTES_AHEAD, DraftBudget
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
    # the choice on the acceptance means: the steps that choose afresh below follow from how
    # far a verify moves them (test_budget_optimism.py: the raised rates)
    budget.optimism = 0.0
    return budget


def _run(budget: DraftBudget, steps: int, accept_all: bool = True, most: int = 3,
         slots_at: dict[int, int] | None = None, seed: int = 0, between: bool = False,
         spot: list[bool] | None = None):
    """``steps`` steps of four decode slots offering ``most`` MTP drafts each; every draft
    accepted (``accept_all``) or none. Returns, per step, (chosen afresh, routes asked,
    routes the budget received). ``slots_at``: from that step on, that many slots.
    ``between``: DraftBudget.between_steps while each step "runs", as the scheduler calls
    it; ``spot`` gets, per step, whether its choice was solved in ``choose`` itself."""
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
        fresh = budget.last["fresh"]
        if spot is not None:
            spot.append(solved > before)
        asked = budget.wants_routes()
        if between:
            budget.between_steps()
        per_row = [np.sort(rng.choice(UNIVERSE, 20, replace=False))
                   for _ in range(count + sum(drafts))]
        accepted = list(drafts) if accept_all else [0] * count
        plan, result = step_record(step, work, drafts, accepted, per_row,
                                   len(np.unique(np.concatenate(per_row))), UNIVERSE,
                                   routes=asked)
        assert plan.slot_routing == asked
        budget.observe(plan, result, 0.05)
        out.append((fresh, asked, any(len(r.cpu_experts) for r in result.slots)))
        pos = pos[:count] + 1 + np.array(accepted)
        pos = np.concatenate([pos, 40 + 5 * np.arange(count, 4)])
    return out


@pytest.mark.parametrize("between", [False, True])
def test_a_choice_serves_reuse_steps_and_routes_come_two_and_four_steps_before_the_next(
        between):
    spot: list[bool] = []
    steps = _run(_budget(), 40, between=between, spot=spot)
    fresh = [i for i, (f, _, _) in enumerate(steps) if f]
    asked = [i for i, (_, a, _) in enumerate(steps) if a]
    # the first step chooses without history and asks for routes; the first verifies move
    # the acceptance from its prior, so the next choice comes at once, again without
    # history, and the one after it two steps later from its routes; from then on one
    # choice every REUSE_STEPS steps, routes on the second and fourth step before each (the
    # step before each runs while the choice is made, between the steps; the persistence is
    # learned from routes two steps apart)
    assert fresh[:3] == [0, 1, 3] and {0, 1} <= set(asked)
    periodic = fresh[3:]
    assert np.diff(fresh[2:]).tolist() == [REUSE_STEPS] * len(periodic)
    before = {f - k for f in periodic for k in (2, 4)} | {
        i for k in (2, 4) if (i := fresh[-1] + REUSE_STEPS - k) < len(steps)}
    assert set(asked) - {0, 1} == before
    assert len(asked) < len(steps) / 3  # most steps read no routes
    assert all(got == a for _, a, got in steps)  # the worker sends what was asked
    # between steps, every choice made from history was made off the step (none in choose
    # itself); without the calls, each in the choose of its step
    assert [spot[f] for f in fresh[2:]] == [not between] * (len(fresh) - 2)


def test_choices_made_between_steps_are_the_ones_choose_would_make():
    # the same steps, with and without the calls between them: the same lengths and routes
    # asked (the acceptance a choice made between steps saw is one step older, within the
    # tolerance here), so moving the work off the step changes no decision
    plain, between = _budget(), _budget()
    assert _run(plain, 40, seed=4) == _run(between, 40, seed=4, between=True)
    assert plain.chosen.tolist() == between.chosen.tolist()
    # the same forecasts: a choice on the spot takes in the steps before the last only, as
    # one made between steps has them
    assert plain.errors.tolist() == pytest.approx(between.errors.tolist(), rel=1e-12)
    got, want = between.figures(), plain.figures()  # the same steps fitted, in the end
    assert {k: got[k] for k in ("fixed_ms", "row_ms", "expert_ms", "persistence")} == {
        k: want[k] for k in ("fixed_ms", "row_ms", "expert_ms", "persistence")}


def test_a_choice_made_between_steps_gives_way_to_changed_slots():
    # made for the four slots running, it is not taken by a step of three
    spot: list[bool] = []
    steps = _run(_budget(), 20, slots_at={REUSE_STEPS + 1: 3}, between=True, spot=spot)
    assert steps[REUSE_STEPS + 1][0] and spot[REUSE_STEPS + 1]


def test_without_reuse_every_step_chooses_from_every_steps_routes():
    steps = _run(_budget(reuse=False), 12)
    assert all(solved and asked and got for solved, asked, got in steps)


def test_a_change_of_slots_or_acceptance_chooses_again_at_once():
    # (fresh choices at 3, 11, 19, ...; routes at 7, 9, 15, 17, ...)
    steps = _run(_budget(), 24, slots_at={11: 3})
    assert steps[11][0] and steps[11][1]  # the slots changed: a new choice, routes asked
    # ... from the routes of step 9, the second step before it: the next in REUSE_STEPS
    assert [i for i, s in enumerate(steps) if s[0] and i > 11] == [11 + REUSE_STEPS]
    steps = _run(_budget(), 20, slots_at={13: 3})
    assert steps[13][0] and steps[13][1]
    # ... where step 11 had no routes: again two steps later, from the routes of step 13
    assert steps[15][0] and not steps[14][0]
    budget = _budget()
    steps = _run(budget, 6, accept_all=False)
    # no draft accepted: the estimate falls from the optimistic prior by more than the
    # tolerance, step after step, so each step chooses afresh until drafts stop
    assert all(solved for solved, _, _ in steps[:2])
    assert budget.accept.source_rate(1)[0] < 0.8 - ACCEPT_TOLERANCE


@pytest.mark.parametrize("gap", [1, 2])
def test_persistence_is_learned_from_steps_its_gap_apart_only(gap):
    rng = np.random.default_rng(3)
    ids = np.sort(rng.choice(UNIVERSE, 40, replace=False))
    stats = RoutingStats(gap=gap)
    for step in range(0, 80, 3):  # the same experts every time, but never gap steps apart
        stats.observe("r", 2, ids, np.full(40, 2), UNIVERSE, step)
    assert stats.persistence == 0.5  # the prior: nothing measured
    for step in range(100, 100 + 30 * gap, gap):
        stats.observe("r", 2, ids, np.full(40, 2), UNIVERSE, step)
    assert stats.persistence > 0.9
    # a slot whose routes are not of the step asked for has no history in the patterns
    last = 100 + 29 * gap
    log_miss, _ = stats.patterns(["r"], last)
    stale, _ = stats.patterns(["r"], last + 1)
    assert log_miss.min() < stale.min()  # its own experts: likelier with the history


def test_with_every_steps_routes_the_two_step_old_ones_are_kept_and_learned_from():
    # where every step's routes come (offers that change every step: suffix drafts), a
    # choice on the spot for step t still finds its slots' routes of step t - 2, and the
    # persistence is learned from routes two steps apart
    rng = np.random.default_rng(5)
    stats = RoutingStats(gap=2)
    ids = [np.sort(rng.choice(UNIVERSE, 40, replace=False)) for _ in range(2)]
    for step in range(30):  # steps alternate between two sets: two apart, the same
        stats.observe("r", 2, ids[step % 2], np.full(40, 2), UNIVERSE, step)
    assert stats.persistence > 0.9
    assert stats.has_history("r", 29) and stats.has_history("r", 28)
    assert not stats.has_history("r", 27)
    assert stats.routes_of("r", 28)[0].tolist() == ids[0].tolist()
    stats.keep(set())
    assert not stats.has_history("r", 28) and not stats.older


def test_the_budget_learns_the_persistence_of_routes_as_old_as_its_choices_use():
    # the budget's choice starts from routes ROUTES_AHEAD steps old; the persistence it
    # applies to them is learned from routes that far apart (the steps asked are the
    # second and fourth before each choice)
    budget = _budget()
    assert ROUTES_AHEAD == 2 and budget.routing.gap == ROUTES_AHEAD
    _run(budget, 40)
    assert budget.routing.persistence != 0.5  # measured from those pairs


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


def test_the_last_steps_time_is_taken_in_between_steps_not_by_the_choice():
    # choose() takes in the steps before the last one (the choice reads routes two steps
    # old); the last step's routes and time wait for between_steps, off the critical path
    budget = _budget()
    _run(budget, 6)  # steps 0-5 observed: the last choice (step 5's) took in steps 0-3
    fitted = budget.costs.n
    budget.choose(slot_work(40 + 5 * np.arange(4), 3), [3] * 4, True)
    after = budget.costs.n
    assert after == pytest.approx(0.99 * fitted + 1.0)  # step 4 only: not step 5
    budget.between_steps()
    assert budget.costs.n == pytest.approx(0.99 * after + 1.0)  # step 5, now
