"""The adaptive budget's probes (daemon/draft_adaptive.py, ``PROBE_STEPS``): a slot whose
drafts the choice cut short of its offer for that many steps running verifies one more, so
the position after its chosen drafts is measured (until its source has ``PROBE_TRIALS``
verifies there). Without them an estimate that a
few early misses pulled down stays there: the choice no longer offers that position, so
nothing measures it again."""

from __future__ import annotations

import numpy as np

from daemon.config import load_config
from daemon.draft_adaptive import PROBE_STEPS, PROBE_TRIALS, DraftBudget
from scripts import sim_draft_budget
from scripts.sim_draft_budget import slot_work, step_record

UNIVERSE = 2000


def _budget() -> DraftBudget:
    """The config's step cost (no fit): 8 ms a pass, 1 ms a row, no CPU experts. With every
    position's acceptance 0.9 four drafts a slot pay most; with the second position's
    estimate near 0.3, one draft does."""
    spec = load_config(None, {"speculation.mode": "wide", "speculation.draft_budget": "adaptive",
                              "speculation.cost_row_ms": 1.0}).speculation
    budget = DraftBudget(spec)
    budget.fit_costs = False
    return budget


def _steps(budget: DraftBudget, accepted_of, steps: int, start: int = 0) -> list[list[int]]:
    """``steps`` steps of four slots offering 4 drafts; ``accepted_of(drafts)`` the accepted
    count of a slot's verify. Returns the chosen counts per step."""
    pos = 40 + 5 * np.arange(4)
    rng = np.random.default_rng(start)
    out = []
    for step in range(start, start + steps):
        work = slot_work(pos, 4)
        drafts = budget.choose(work, [4] * 4, True)
        accepted = [accepted_of(k) for k in drafts]
        per_row = [np.sort(rng.choice(UNIVERSE, 20, replace=False))
                   for _ in range(4 + sum(drafts))]
        plan, result = step_record(step, work, drafts, accepted, per_row,
                                   len(np.unique(np.concatenate(per_row))), UNIVERSE,
                                   routes=budget.wants_routes())
        budget.observe(plan, result, 0.05)
        out.append(list(drafts))
        pos = pos + 1 + np.array(accepted)
    return out


def test_a_position_pulled_down_early_is_measured_again_and_recovers():
    budget = _budget()
    first = _steps(budget, lambda k: min(k, 1), 1)  # every slot: the second draft missed
    assert min(first[0]) >= 2  # the optimistic prior: drafts run, and get measured
    assert budget.accept.source_rate(1)[1] < 0.4
    # from now on every draft is accepted: the second position pays, if measured
    later = _steps(budget, lambda k: k, 6 * PROBE_STEPS, start=1)
    # what the estimates say right after the misses, until a slot has been cut short for
    # PROBE_STEPS steps running (counting the first): then it verifies one more
    assert all(counts == [1, 1, 1, 1] for counts in later[:PROBE_STEPS - 2])
    assert any(max(counts) == 2 for counts in later[PROBE_STEPS - 2:PROBE_STEPS])
    # the measured second position recovers, and with it the choice
    assert budget.accept.source_rate(1)[1] > 0.8
    assert all(min(counts) >= 3 for counts in later[-PROBE_STEPS:])


def test_probes_stop_once_the_position_is_measured():
    """Drafts past the first never accepted: the budget keeps one draft a slot; its probes add
    one draft a slot once per PROBE_STEPS steps until the source has PROBE_TRIALS verifies
    that reached the second position, then stop."""
    budget = _budget()
    counts = np.array(_steps(budget, lambda k: min(k, 1), 20 * PROBE_STEPS))
    tail = counts[PROBE_STEPS:]
    assert set(tail.ravel()) <= {1, 2}
    assert (tail == 2).any()  # probes ran
    assert budget.accept.trials(1, 1) >= PROBE_TRIALS
    last_probe = max(s for s, c in enumerate(counts) if (c == 2).any())
    assert (counts[last_probe + 1:] == 1).all() and len(counts) - last_probe > 4 * PROBE_STEPS


def test_the_simulation_no_longer_locks_a_seed_at_one_draft():
    """scripts/sim_draft_budget.py at the replay proposer's per-position rate (0.879 at every
    position) and the H100-like costs: seed 1's first verifies missed early, and before the
    probes the budget chose one draft a slot for the rest of the run (0.92x the best fixed)."""
    args = sim_draft_budget.parse_args(["--fixed-ms", "16", "--expert-ms", "0.04", "--accept",
                                        "0.879,0.879,0.879,0.879", "--steps", "80"])
    run = sim_draft_budget.simulate("adaptive", args, 1)
    chosen = np.array(run["drafts_chosen"])
    assert chosen[3:].sum() > chosen[:2].sum()
