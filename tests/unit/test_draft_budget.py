"""The adaptive draft budget's pure parts (daemon/draft_budget.py, daemon/draft_stats.py,
issue 15 item 3): the chooser against hand-computed cases and a brute-force reference, the
pattern compression against a per-expert sum, the online estimates, the worker's per-slot
routing record, the wire fields and the config keys."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest

from daemon.cli import build_parser
from daemon.commands import config_from_args
from daemon.config import SpeculationSection, load_config
from daemon.config_checks import ConfigError
from daemon.draft_accept import REQUEST_DECAY, REQUEST_PRIOR_TRIALS, SPREAD_MIN, AcceptanceStats
from daemon.draft_adaptive import DraftBudget
from daemon.draft_budget import (
    MARGIN,
    BudgetProblem,
    StepCost,
    choose,
    expected_union,
    gains,
    patterns,
    ratio,
)
from daemon.lifecycle import worker_config
from gpu_worker.experts.counters import ExpertCounters
from protocol.codec import decode, encode
from protocol.messages import (
    DraftSource,
    PromptPhase,
    SamplingParams,
    SlotResult,
    SlotWork,
    StepResult,
    WorkKind,
)
from protocol.worker_config import GRAPH_BUCKETS, WorkerConfig


def _problem(accept, max_drafts, *, base_rows=None, log_miss=None, weight=None, wide=True):
    S = len(accept)
    return BudgetProblem(
        base_rows=np.array(base_rows or [1] * S), max_drafts=np.array(max_drafts),
        accept=np.array(accept, dtype=np.float64), base_value=np.ones(S),
        log_miss=np.zeros((0, S)) if log_miss is None else np.array(log_miss, np.float64),
        weight=np.zeros(0) if weight is None else np.array(weight, np.float64), wide=wide)


# ---- hand-computed cases ---------------------------------------------------------------------
def test_without_experts_the_length_follows_acceptance():
    # T = 4 + 1 * (1 + k); value 1 + a + ... + a^k
    cost = StepCost(fixed_ms=4.0, row_ms=1.0, expert_ms=0.0)
    # a = 0.6: k=0 1/5 = .2, k=1 1.6/6 = .267, k=2 1.96/7 = .280, k=3 2.176/8 = .272
    assert choose(_problem([0.6], [3]), cost) == [2]
    # a = 0.1: k=1 1.1/6 = .183 < .2
    assert choose(_problem([0.1], [3]), cost) == [0]
    # a = 0.95: every draft pays (k=3: 3.71/8 = .464 > k=2: 2.85/7 = .407)
    assert choose(_problem([0.95], [3]), cost) == [3]


def test_drafts_that_route_to_touched_experts_get_longer_than_ones_that_route_to_new():
    cost = StepCost(fixed_ms=10.0, row_ms=0.0, expert_ms=1.0)
    # slot A: its 10 experts are picked by every row (pi = 1), nothing else: U = 10 always,
    # so T = 20 and the value only grows: all 4 drafts
    a = _problem([0.6], [4], log_miss=[[math.log(1e-300)]], weight=[10])
    assert choose(a, cost) == [4]
    # slot B: every row picks 10 of 1000 experts at random (pi = 0.01): U(n) = 1000 (1 - .99^n)
    # n=1: 1/20 = .0500; n=2: 1.6/29.9 = .0535; n=3: 1.96/39.70 = .0494
    b = _problem([0.6], [4], log_miss=[[math.log(0.99)]], weight=[1000])
    assert choose(b, cost) == [1]
    # together in one pass: A's rows add nothing, B's add experts
    both = _problem([0.6, 0.6], [4, 4], log_miss=[[math.log(1e-300), 0.0],
                                                 [0.0, math.log(0.99)]], weight=[10, 1000])
    k_a, k_b = choose(both, cost)
    assert k_a == 4 and k_b < k_a
    assert [k_a, k_b] == _brute_force(both, cost)


def test_a_long_prompt_chunk_makes_draft_rows_free_of_experts():
    # a 512-row chunk in the same pass touches (nearly) every expert: the decode slot's drafts
    # then cost rows only, where alone they would cost new experts
    cost = StepCost(fixed_ms=10.0, row_ms=0.0, expert_ms=1.0)
    lm = [[math.log(0.99), math.log(0.99)]]
    alone = _problem([0.6], [4], log_miss=[lm[0][:1]], weight=[1000])
    chunk = BudgetProblem(base_rows=np.array([1, 512]), max_drafts=np.array([4, 0]),
                          accept=np.array([0.6, 0.0]), base_value=np.array([1.0, 0.0]),
                          log_miss=np.array(lm), weight=np.array([1000.0]))
    assert choose(alone, cost) == [1]
    assert choose(chunk, cost) == [4, 0]


def test_rows_a_padded_pass_runs_anyway_cost_nothing_more():
    """Where the worker pads a pass up to its graph bucket (ModelInfo.padded_passes), 13 to
    16 rows cost what 16 do: a choice pays for its bucket, not its rows. Three strong slots
    and a weak one: unpadded, 14 rows are best; padded, those 14 cost 16 rows' time and 12
    rows (two strong slots a draft shorter) are best."""
    cost = StepCost(fixed_ms=4.0, row_ms=1.0, expert_ms=0.0)
    accept = [[0.95] * 3] * 3 + [[0.9, 0.5, 0.3]]  # gains 2.7099 at 3; weak 0.9 at 1
    plain, padded = (dataclasses.replace(_problem(accept, [3] * 4), pad_to=pad)
                     for pad in ((), GRAPH_BUCKETS))
    assert choose(plain, cost) == [3, 3, 3, 1]  # 14 rows: 13.03 / 18 ms = 0.724
    got = choose(padded, cost)
    assert sorted(got) == [1, 2, 2, 3] and got[3] == 1  # 12 rows: 11.315 / 16 ms = 0.707
    r = ratio(padded, cost, np.array([[3, 3, 3, 1], got]))
    assert r[0] * 20 == pytest.approx(4 + 3 * 2.709875 + 0.9)  # 14 rows run as 16
    assert r[1] * 16 == pytest.approx(4 + 2 * 1.8525 + 2.709875 + 0.9)


# ---- against an independent reference -------------------------------------------------------
def _step_ms(p: BudgetProblem, cost: StepCost, ks) -> float:
    """The predicted time by loops: passes, their rows, their expected distinct experts."""
    S = len(ks)
    if p.wide:
        groups = [list(range(S))]
    else:
        groups = [[s for s in range(S) if not ks[s]]] + [[s] for s in range(S) if ks[s]]
        groups = [g for g in groups if g]
    ms = 0.0
    for g in groups:
        rows = {s: p.base_rows[s] + ks[s] for s in g}
        union = 0.0
        for e in range(len(p.weight)):
            miss = 1.0
            for s in g:  # consecutive rows: 1 + (n - 1)(1 - locality) independent ones
                miss *= math.exp(p.log_miss[e, s]) ** (1 + (rows[s] - 1) * (1 - p.locality))
            union += p.weight[e] * (1 - miss)
        n = sum(rows.values())  # the pass runs its bucket's rows where the worker pads
        run = next((b for b in p.pad_to if b >= n), n)
        ms += cost.fixed_ms + cost.row_ms * run + cost.expert_ms * union
    return ms


def _value(p: BudgetProblem, ks) -> float:
    return sum(p.base_value[s] + sum(p.accept[s] ** j for j in range(1, k + 1))
               for s, k in enumerate(ks))


def _brute_force(p: BudgetProblem, cost: StepCost) -> list[int]:
    """Of every combination within MARGIN of the best ratio, the fewest drafts, then the
    best ratio."""
    every = [(_value(p, ks) / _step_ms(p, cost, ks), list(ks))
             for ks in itertools.product(*(range(int(n) + 1) for n in p.max_drafts))]
    top = max(r for r, _ in every)
    near = [(sum(ks), -r, ks) for r, ks in every if r >= top * (1 - MARGIN) * (1 - 1e-9)]
    return min(near)[2]


@pytest.mark.parametrize("wide", [True, False])
def test_the_chooser_finds_the_brute_force_optimum(wide):
    rng = random.Random(3)
    for _ in range(60):
        S, P = rng.randrange(1, 5), rng.randrange(0, 4)
        p = BudgetProblem(
            base_rows=np.array([rng.choice([1, 1, 1, 6]) for _ in range(S)]),
            max_drafts=np.array([rng.randrange(0, 5) for _ in range(S)]),
            accept=np.array([rng.random() for _ in range(S)]), base_value=np.ones(S),
            log_miss=np.log(np.array([[rng.uniform(0.3, 1.0) for _ in range(S)]
                                      for _ in range(P)]).reshape(P, S)),
            weight=np.array([rng.randrange(1, 200) for _ in range(P)], np.float64), wide=wide,
            locality=rng.choice([0.0, 0.0, 0.3, 0.9]), pad_to=rng.choice([(), GRAPH_BUCKETS]))
        cost = StepCost(rng.uniform(1, 20), rng.uniform(0, 2), rng.uniform(0, 0.5))
        got = choose(p, cost)
        want = _brute_force(p, cost)
        assert math.isclose(_value(p, got) / _step_ms(p, cost, got),
                            _value(p, want) / _step_ms(p, cost, want), rel_tol=1e-9)
        assert got == want, (got, want)
        ks = np.array([got])
        assert math.isclose(float(ratio(p, cost, ks)[0]),
                            _value(p, got) / _step_ms(p, cost, got), rel_tol=1e-9)


def test_coordinate_ascent_ends_where_no_single_slot_can_do_better():
    rng = np.random.default_rng(0)
    S = 5  # 16^5 combinations: more than the exhaustive search takes
    p = BudgetProblem(base_rows=np.ones(S, int), max_drafts=np.full(S, 15),
                      accept=rng.uniform(0.3, 0.95, S), base_value=np.ones(S),
                      log_miss=np.log(rng.uniform(0.9, 1.0, (6, S))),
                      weight=rng.integers(50, 500, 6).astype(np.float64))
    cost = StepCost(5.0, 0.3, 0.05)
    got = np.array(choose(p, cost))
    for s in range(S):  # each slot's length: the fewest drafts within MARGIN of its best
        alts = np.repeat(got[None], 16, axis=0)
        alts[:, s] = np.arange(16)
        r = ratio(p, cost, alts)
        bar = r.max() * (1 - MARGIN)
        assert r[got[s]] >= bar - 1e-12 and (r[:got[s]] < bar + 1e-12).all()


def test_patterns_give_the_per_expert_expected_union():
    rng = np.random.default_rng(1)
    K, S, universe, lam, p0 = 30, 3, 200, 0.7, 0.02
    frac = np.where(rng.random((K, S)) < 0.3, rng.integers(1, 5, (K, S)) / 4, 0.0)
    frac[np.arange(K), rng.integers(0, S, K)] = 0.5  # every listed expert picked by a slot
    history = np.array([True, True, False])
    frac[:, 2] = 0.0
    chance = rng.choice([p0, 2 * p0], K)  # two popularity classes
    rest_chance, rest_count = np.array([p0 / 2, p0, 2 * p0]), np.array([100, 0, 70])
    log_miss, weight = patterns(frac, chance, history, lam, rest_chance, rest_count)
    assert len(weight) < K + 2 and weight.sum() == universe
    rows = np.array([[1, 3, 1], [5, 1, 16], [2, 2, 2]])
    # reference: every one of the universe's experts on its own
    fresh = np.concatenate([chance, np.full(100, p0 / 2), np.full(70, 2 * p0)])
    pi = np.repeat(fresh[:, None], S, axis=1)
    pi[:K, :2] = lam * frac[:, :2] + (1 - lam) * chance[:, None]
    pi[K:, :2] = (1 - lam) * fresh[K:, None]
    want = [(1 - np.prod((1 - pi) ** r, axis=1)).sum() for r in rows]
    np.testing.assert_allclose(expected_union(rows, log_miss, weight), want, rtol=1e-12)


# ---- the online estimates ---------------------------------------------------------------------
def _chained(successes, trials, first=0.8, weight=2.0):
    """A source's positions, each leaning on the one before (the first on 1.6 of 2)."""
    out, before = [], first
    for s, t in zip(successes, trials, strict=True):
        before = (s + weight * before) / (t + weight)
        out.append(before)
    return np.array(out)


def test_acceptance_is_measured_per_draft_position_leaning_on_its_source():
    acc = AcceptanceStats()
    assert np.all(acc.rate("r0", 2) == 0.8)  # the source prior (1.6 of 2) at every position
    acc.observe("r0", 2, drafts=4, accepted=4)  # positions 1-4 succeed
    acc.observe("r1", 2, drafts=4, accepted=1)  # position 1 succeeds, 2 fails, 3-4 untried
    src = _chained([2, 1, 1, 1, 0], [2, 2, 1, 1, 0])
    np.testing.assert_allclose(src[:4], [0.9, 0.7, 0.8, 2.6 / 3])  # by hand
    np.testing.assert_allclose(acc.source_rate(2)[:5], src, rtol=1e-15)
    w, d = REQUEST_PRIOR_TRIALS, REQUEST_DECAY  # a request leans on its source
    np.testing.assert_allclose(acc.rate("r0", 2)[:5], (np.r_[1, 1, 1, 1, 0] + w * src)
                               / (np.r_[1, 1, 1, 1, 0] + w), rtol=1e-15)
    np.testing.assert_allclose(acc.rate("r1", 2)[:5], (np.r_[1, 0, 0, 0, 0] + w * src)
                               / (np.r_[1, 1, 0, 0, 0] + w), rtol=1e-15)
    acc.observe("r1", 2, drafts=2, accepted=2)  # r1's old counts decay
    src = _chained([3, 2, 1, 1], [3, 3, 1, 1])
    np.testing.assert_allclose(acc.rate("r1", 2)[:4], (np.r_[1 + d, 1, 0, 0] + w * src)
                               / (np.r_[1 + d, 1 + d, 0, 0] + w), rtol=1e-15)
    assert np.all(acc.rate("r0", 1) == 0.8)  # another source
    acc.keep({"r1"})
    np.testing.assert_allclose(acc.rate("r0", 2)[:4], src, rtol=1e-15)  # the source alone
    acc.observe("r2", 3, drafts=15, accepted=15)  # the longest drafts fit the positions
    assert acc.rate("r2", 3)[14] > 0.8 and acc.rate("r2", 3)[15] > 0.8  # leans on the 15th


def test_positions_that_accept_less_get_fewer_drafts():
    # one chain probability and per-position ones tell different lengths
    cost = StepCost(fixed_ms=10.0, row_ms=1.0, expert_ms=0.0)
    chain = _problem([0.8], [3])
    late = dataclasses.replace(chain, accept=np.array([[0.95, 0.9, 0.1]]))
    assert choose(chain, cost) == [3]
    assert choose(late, cost) == [2]  # a third draft that is rarely accepted does not pay
    np.testing.assert_allclose(gains(late.accept, 3), [[0, 0.95, 0.95 + 0.855,
                                                        0.95 + 0.855 + 0.0855]])
    np.testing.assert_allclose(gains(chain.accept, 3), [[0, 0.8, 1.44, 1.952]])


def test_the_budget_counts_its_choices_for_drafted_slots():
    budget = DraftBudget(SpeculationSection(mode="wide", draft_budget="adaptive"))
    budget.fit_costs = False
    work = [SlotWork(slot=s, request_id=f"r{s}", kind=WorkKind.DECODE,
                     input_ids=np.array([5], np.int32), start_pos=3, num_tokens=1,
                     needs_logits=True, sampling=SamplingParams(seed=1), prompt_len=3,
                     draft_ids=np.array([7, 8, 9], np.int32),
                     draft_sources=np.full(3, int(DraftSource.MTP), np.uint8))
            for s in range(3)]
    out = budget.choose(work, [3, 2, 0], True)  # the third slot offers none: not counted
    assert budget.chosen.sum() == 2 and budget.chosen[out[0]] >= 1
    assert budget.chosen[out[1]] >= 1 and out[2] == 0
    assert set(budget.figures()) == {"fixed_ms", "row_ms", "expert_ms", "cost_slots",
                                     "fitted_steps", "persistence", "locality",
                                     "effective_experts", "picks_per_row", "union_error",
                                     "step_error", "request_weight", "uniform_1",
                                     "uniform_2", "uniform_3", "uniform_4"}
    assert budget.figures()["request_weight"] == REQUEST_PRIOR_TRIALS  # nothing verified yet
    for i in range(SPREAD_MIN):  # requests that accepted alike, ended: they lean on it more
        for _ in range(20):
            budget.accept.observe(f"old{i}", int(DraftSource.MTP), drafts=1, accepted=1)
    budget.accept.keep(set())
    assert budget.figures()["request_weight"] > REQUEST_PRIOR_TRIALS


# ---- the worker's record and the wire ----------------------------------------------------------
def test_counters_record_each_slots_distinct_cpu_experts():
    rng = np.random.default_rng(5)
    c = ExpertCounters(bytes_per_expert=1.0)
    row_slot = np.array([3, 3, 3, -1, -1, 0, 1, 1])  # slot 3: 3 rows, 2 prompt rows, ...
    want: dict[int, dict[int, int]] = {}
    c.track_rows(row_slot)
    for layer in range(4):
        ids = np.stack([rng.choice(16, 4, replace=False) for _ in row_slot])  # [R, k]
        cpu = ids >= 10
        c.add_routes(layer, 16, ids, cpu)
        for r, s in enumerate(row_slot):
            for e in ids[r][cpu[r]]:
                if s >= 0:
                    slot = want.setdefault(int(s), {})
                    slot[layer * 16 + int(e)] = slot.get(layer * 16 + int(e), 0) + 1
    got = c.take_slot_experts()
    assert set(got) == set(want)
    for s, (ids, rows) in got.items():
        assert ids.dtype == np.int32 and rows.dtype == np.uint16
        assert dict(zip(ids.tolist(), rows.tolist(), strict=True)) == want[s]
    assert c.take_slot_experts() == {} and not c.tracking


def test_slot_routing_travels_and_is_configured():
    res = SlotResult(slot=1, request_id="r", token_ids=[5], num_accepted=0,
                     prompt=PromptPhase(phase=2, prompt_tokens_this_step=0, prompt_len=3,
                                        cached_len=0),
                     cpu_experts=np.array([4, 90], np.int32),
                     cpu_expert_rows=np.array([1, 3], np.uint16))
    back = decode(encode(StepResult(step_id=1, slots=[res])))
    assert back.slots[0].cpu_experts.tolist() == [4, 90]
    assert back.slots[0].cpu_expert_rows.tolist() == [1, 3]
    with pytest.raises(ValueError, match="one row count per expert"):
        SlotResult(slot=1, request_id="r", token_ids=[5], num_accepted=0, prompt=res.prompt,
                   cpu_experts=np.array([4], np.int32))
    for ids, rows in (([-1, 4], [1, 1]), ([4, 5], [1, 0])):  # a negative id, an unpicked one
        with pytest.raises(ValueError, match="cpu_experts must be >= 0"):
            SlotResult(slot=1, request_id="r", token_ids=[5], num_accepted=0,
                       prompt=res.prompt, cpu_experts=np.array(ids, np.int32),
                       cpu_expert_rows=np.array(rows, np.uint16))
    cfg = WorkerConfig(run_dir="/tmp/x", model="m", slot_routing=True)
    assert WorkerConfig.from_json(cfg.to_json()).slot_routing is True
    with pytest.raises(ValueError, match="slot_routing must be a bool"):
        WorkerConfig(run_dir="/tmp/x", model="m", slot_routing=1)


def test_the_budget_config_keys_are_validated():
    spec = load_config(None).speculation
    assert spec.draft_budget == "fixed"
    for bad, message in (({"draft_budget": "off"}, "speculation.draft_budget: must be one of"),
                         ({"cost_row_ms": -1.0}, "speculation.cost_row_ms: must be >= 0"),
                         ({"cost_expert_ms": "1"}, "must be a finite number"),
                         ({"cost_fixed_ms": float("nan")}, "must be a finite number")):
        with pytest.raises(ConfigError, match=message):
            SpeculationSection(mode="wide", **bad)
    got = load_config(None, {"speculation.draft_budget": "adaptive",
                             "speculation.cost_expert_ms": 0.05}).speculation
    assert (got.draft_budget, got.cost_expert_ms) == ("adaptive", 0.05)
    args = build_parser().parse_args(["serve", "--speculation", "wide", "--draft-budget",
                                      "adaptive", "--num-drafts", "6"])
    config = config_from_args(args)
    assert (config.speculation.draft_budget, config.speculation.num_drafts) == ("adaptive", 6)
    assert worker_config(config).slot_routing is True  # the worker reports routing
    assert worker_config(load_config(None, {"speculation.mode": "wide"})).slot_routing is False
