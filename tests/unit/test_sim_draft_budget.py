"""scripts/sim_draft_budget.py on a small model: the policies' figures add up."""

from __future__ import annotations

import json

import pytest

from scripts import sim_draft_budget


def test_the_simulation_reports_each_policy_and_seed(tmp_path):
    out = tmp_path / "sim.json"
    assert sim_draft_budget.main(["--layers", "4", "--steps", "30", "--seeds", "0,1",
                                  "--policies", "0,2,adaptive", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = {(r["policy"], r["seed"]): r for r in data["runs"]}
    assert set(runs) == {(p, s) for p in ("0", "2", "adaptive") for s in (0, 1)}
    counted = 30 - sim_draft_budget.WARM_UP
    for (policy, _), r in runs.items():
        assert sum(r["drafts_chosen"]) == 4 * counted  # four slots a step
        assert r["tokens_per_ms"] > 0 and r["cpu_experts_per_token"] > 0
        if policy == "0":
            assert r["tokens_per_step"] == 4.0 and r["drafts_chosen"][0] == 4 * counted
        if policy == "2":
            assert 4.0 < r["tokens_per_step"] <= 12.0 and r["drafts_chosen"][2] == 4 * counted
    assert set(data["mean_tokens_per_ms"]) == {"0", "2", "adaptive"}


def test_noise_moves_the_times_not_the_tokens_of_a_fixed_policy():
    base = ["--layers", "3", "--steps", "30", "--seeds", "0", "--policies", "2"]
    quiet = sim_draft_budget.simulate("2", sim_draft_budget.parse_args(base), 0)
    noisy = sim_draft_budget.simulate("2", sim_draft_budget.parse_args([*base, "--noise", "0.1"]),
                                      0)
    assert noisy["tokens_per_step"] == quiet["tokens_per_step"]
    assert noisy["tokens_per_ms"] != quiet["tokens_per_ms"]


@pytest.mark.parametrize("bad", [["--policies", "4"], ["--policies", "x"], ["--steps", "5"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        sim_draft_budget.main(["--layers", "2", *bad])
