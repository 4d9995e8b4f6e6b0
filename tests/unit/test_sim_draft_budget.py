"""scripts/sim_draft_budget.py on a small model: the policies' figures add up."""

from __future__ import annotations

import json

import numpy as np
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
        if policy != "adaptive":
            assert r["mixed_steps"] == 0.0  # every slot the same count
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


def test_requests_that_differ_change_the_tokens_and_a_fixed_weight_the_choice():
    base = ["--layers", "3", "--steps", "60", "--seeds", "0", "--turnover", "10",
            "--accept", "0.8,0.8,0.8"]
    alike = sim_draft_budget.simulate("2", sim_draft_budget.parse_args(base), 0)
    apart = sim_draft_budget.simulate(
        "2", sim_draft_budget.parse_args([*base, "--request-spread", "0.3"]), 0)
    assert apart["tokens_per_step"] != alike["tokens_per_step"]  # each request its own rate
    # the budget's weight for a request's own counts: by their spread, or fixed
    spread = [*base, "--request-spread", "0.3"]
    own = sim_draft_budget.simulate("adaptive", sim_draft_budget.parse_args(spread), 0)
    fixed = sim_draft_budget.simulate(
        "adaptive", sim_draft_budget.parse_args([*spread, "--request-weight", "1000"]), 0)
    assert own["drafts_chosen"] != fixed["drafts_chosen"]


def test_paired_draws_and_the_expected_tokens_of_a_fixed_policy():
    base = ["--layers", "3", "--steps", "40", "--seeds", "0", "--accept", "0.8,0.8,0.8"]
    plain = sim_draft_budget.simulate("2", sim_draft_budget.parse_args(base), 0)
    paired = sim_draft_budget.simulate("2", sim_draft_budget.parse_args([*base, "--paired"]), 0)
    again = sim_draft_budget.simulate("2", sim_draft_budget.parse_args([*base, "--paired"]), 0)
    assert paired == again  # the draws of (seed, request, position)
    assert paired["tokens_per_step"] != plain["tokens_per_step"]  # not one stream's
    for r in (plain, paired):  # four slots of 1 + 0.8 + 0.64 expected tokens, whatever drawn
        per_step = r["expected_tokens_per_ms"] / r["tokens_per_ms"] * r["tokens_per_step"]
        assert per_step == pytest.approx(4 * 2.44, rel=1e-12)


def test_four_slots_verify_what_a_pass_holds():
    base = ["--layers", "3", "--steps", "30", "--seeds", "0", "--accept", "0.9,0.9,0.9,0.9"]
    counted = 4 * (30 - sim_draft_budget.WARM_UP)
    capped = sim_draft_budget.simulate("4", sim_draft_budget.parse_args(base), 0)
    assert capped["drafts_chosen"] == [0, 0, 0, counted, 0]  # 16 rows: 3 drafts a slot
    free = sim_draft_budget.simulate("4", sim_draft_budget.parse_args([*base, "--capacity", "0"]),
                                     0)
    assert free["drafts_chosen"] == [0, 0, 0, 0, counted]
    budget = sim_draft_budget.simulate("adaptive", sim_draft_budget.parse_args(base), 0)
    assert budget["drafts_chosen"][4] == 0


@pytest.mark.parametrize("bad", [["--policies", "4"], ["--policies", "x"], ["--steps", "5"],
                                 ["--ramp", "20", "--steps", "50"], ["--slot-cost", "1,1"],
                                 ["--capacity", "3"], ["--capacity", "-1"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        sim_draft_budget.main(["--layers", "2", *bad])


def test_adaptive_reports_how_far_its_predicted_union_was():
    r = sim_draft_budget.simulate("adaptive", sim_draft_budget.parse_args(
        ["--layers", "6", "--steps", "60", "--policies", "adaptive"]), 0)
    assert abs(r["union_error"]["mean"]) < 0.05 and r["union_error"]["std"] > 0


def test_the_union_check_predicts_each_draft_rows_growth(tmp_path):
    # scripts/check_union_model.py: the budget's predicted union against the routed one at
    # 0-3 drafts a slot; its growth per draft row (a draft's cost) within a few per cent
    from scripts import check_union_model  # noqa: PLC0415

    out = tmp_path / "union.json"
    assert check_union_model.main(["--layers", "12", "--steps", "120", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["predicted"]) == len(data["routed"]) == 4
    assert all(abs(e) < 0.06 for e in data["growth_error"]), data["growth_error"]
    assert data["learned"]["locality"] == pytest.approx(0.12, abs=0.04)  # the routing's own
    with pytest.raises(SystemExit):
        check_union_model.main(["--drafts", "7"])


def test_turnover_replaces_each_slots_request_and_the_budget_chooses_for_new_ones():
    from scripts.sim_draft_budget import parse_args, simulate

    args = parse_args(["--steps", "60", "--turnover", "20", "--layers", "4"])
    got = simulate("adaptive", args, 0)
    plain = simulate("adaptive", parse_args(["--steps", "60", "--layers", "4"]), 0)
    assert got["tokens_per_step"] > 4 and sum(got["drafts_chosen"]) == 4 * (60 - 20)
    # new requests route by new keys: another run than the steady four requests'
    assert got["cpu_experts_per_step"] != plain["cpu_experts_per_step"]



def test_a_ramp_counts_the_four_slot_steps_and_dearer_experts_cost_only_time():
    base = ["--layers", "3", "--steps", "40", "--seeds", "0", "--ramp", "8"]
    plain = sim_draft_budget.simulate("2", sim_draft_budget.parse_args(base), 0)
    counted = 40 - max(sim_draft_budget.WARM_UP, 3 * 8)
    assert sum(plain["drafts_chosen"]) == 4 * counted  # four slots in every counted step
    dear = sim_draft_budget.simulate(
        "2", sim_draft_budget.parse_args([*base, "--slot-cost", "2,2,2,1"]), 0)
    assert dear["tokens_per_step"] == plain["tokens_per_step"]
    assert dear["tokens_per_ms"] == plain["tokens_per_ms"]  # four-slot steps cost the same
    dearer = sim_draft_budget.simulate(
        "2", sim_draft_budget.parse_args([*base, "--slot-cost", "1,1,1,2"]), 0)
    assert dearer["tokens_per_ms"] < plain["tokens_per_ms"]
    # the adaptive budget chooses for the slots there are, from its first step
    ramp = sim_draft_budget.simulate("adaptive", sim_draft_budget.parse_args(base), 0)
    assert sum(ramp["drafts_chosen"]) == 4 * counted


def test_padded_passes_cost_their_bucket_and_the_budget_is_told():
    """--padded: four slots of 2 drafts (12 rows, a bucket) cost what they did; with
    --capacity 0 and 4 drafts a slot (20 rows, past the buckets) too; the step record
    carries the padding rows the budget's fit reads."""
    base = ["--layers", "3", "--steps", "30", "--seeds", "0"]
    for policy, extra in (("2", []), ("3", ["--capacity", "0", "--accept", "0.9,0.9,0.9,0.9"])):
        plain = sim_draft_budget.simulate(policy, sim_draft_budget.parse_args(base + extra), 0)
        padded = sim_draft_budget.simulate(
            policy, sim_draft_budget.parse_args([*base, *extra, "--padded"]), 0)
        assert padded["tokens_per_ms"] == plain["tokens_per_ms"]
    work = sim_draft_budget.slot_work(np.array([40, 45, 50, 55]), 3)
    per_row = [np.array([7])] * 14
    _, result = sim_draft_budget.step_record(0, work, [3, 3, 3, 1], [0] * 4, per_row, 1, 100,
                                             padding=2)
    assert result.counters["padding_rows"] == 2
