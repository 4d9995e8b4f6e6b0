"""The adaptive budget's optimism (daemon/draft_accept.py, ``OPTIMISM``): it chooses on its
sources' acceptance raised by the estimates' standard deviations, so a position that a few
unlucky verifies pulled down is tried again until its estimate is sure, where the means
alone would stop verifying it and keep the low estimate."""

from __future__ import annotations

import numpy as np

from daemon.config import load_config
from daemon.draft_accept import OPTIMISM, REQUEST_PRIOR_TRIALS, SOURCE_PRIOR, AcceptanceStats
from daemon.draft_adaptive import DraftBudget
from scripts import sim_draft_budget


def test_the_bound_is_each_positions_mean_raised_by_its_standard_deviation():
    acc = AcceptanceStats()
    for accepted in (3, 3, 1, 0, 3, 2):
        acc.observe("r0", 1, drafts=3, accepted=accepted)
    s, t = acc.sources[1][:, :4]
    mean = acc.source_rate(1)
    before, w = SOURCE_PRIOR[0] / SOURCE_PRIOR[1], SOURCE_PRIOR[1]
    for j in range(4):  # by hand: a Beta posterior's mean and standard deviation
        before = (s[j] + w * before) / (t[j] + w)
        sd = np.sqrt(before * (1 - before) / (t[j] + w + 1))
        assert mean[j] == before
        assert acc.source_rate(1, 0.75)[j] == min(before + 0.75 * sd, 1.0)
    assert acc.source_rate(1, 0.0).tolist() == mean.tolist()
    # a request leans on the raised rates as it leans on the means
    req, w = acc.requests[("r0", 1)], acc.request_weight(1)
    np.testing.assert_allclose(acc.rate("r0", 1, 0.75),
                               (req[0] + w * acc.source_rate(1, 0.75)) / (req[1] + w),
                               rtol=1e-15)
    assert w == REQUEST_PRIOR_TRIALS
    assert np.all(acc.rate("r0", 1, 0.75) >= acc.rate("r0", 1))


def test_the_bound_nears_the_mean_as_a_position_is_measured():
    acc = AcceptanceStats()
    rng = np.random.default_rng(0)
    for n in range(2000):
        a = 0
        while a < 2 and rng.random() < 0.8:
            a += 1
        acc.observe(f"r{n % 4}", 1, drafts=2, accepted=a)
    gap = acc.source_rate(1, OPTIMISM) - acc.source_rate(1)
    assert 0 < gap[0] < 0.01 and 0 < gap[1] < 0.015  # 2,000 and ~1,600 verifies
    assert gap[2] > 0.1  # never verified: the chain's guess, as unsure as its prior


def test_the_budget_chooses_on_the_raised_rates():
    spec = load_config(None, {"speculation.mode": "wide",
                              "speculation.draft_budget": "adaptive"}).speculation
    assert DraftBudget(spec).optimism == OPTIMISM > 0


# an H100 machine's four-stream essays (session 31): the replay's acceptance, 0.879 at every
# position, and its pinned step cost; the streams start one after another, and a pass holds at
# most 16 rows (four slots: 3 drafts each)
SCENARIO = ["--fixed-ms", "11.3", "--row-ms", "0.2", "--expert-ms", "0.0298", "--ramp", "8",
            "--steps", "50", "--accept", "0.879,0.879,0.879,0.879", "--paired"]


def _runs(policy: str, *extra: str) -> tuple[np.ndarray, float]:
    """Draft counts chosen (summed) and mean expected tokens per ms over six seeds."""
    args = sim_draft_budget.parse_args([*SCENARIO, *extra])
    runs = [sim_draft_budget.simulate(policy, args, seed) for seed in range(6)]
    return (np.sum([r["drafts_chosen"] for r in runs], axis=0),
            float(np.mean([r["expected_tokens_per_ms"] for r in runs])))


def test_optimism_keeps_trying_the_drafts_a_few_early_misses_made_look_poor():
    _, two = _runs("2")
    _, three = _runs("3")
    assert three > two * 1.01  # here 3 drafts a slot (16 rows, the most a pass holds) pay most
    means, on_means = _runs("adaptive", "--optimism", "0")
    raised, on_raised = _runs("adaptive")
    share = lambda chosen: chosen[3] / chosen.sum()  # noqa: E731
    # on the means, the positions some early verifies pulled down stay down in some runs;
    # raised by their uncertainty, they are verified again and the choice finds three
    assert share(means) < 0.85 and share(raised) > 0.9
    assert on_raised > on_means and on_raised > 0.998 * three
