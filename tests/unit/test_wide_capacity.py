"""Wide speculation's capacities and eligibility (daemon/draft_plan.py, issue 15 items 1):
drafts trimmed fairly into passes of at most 16 decode rows (capacities 8/12/16), one pass
per step however many slots carry drafts, at most 4 drafted slots taking turns, and the
tokens of plain decoding for every layout up to 4 slots x 4 drafts and for 6 drafted
slots (float64, both architectures)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from structlog.testing import capture_logs

from daemon.config import SpeculationSection
from daemon.draft_plan import (
    MAX_WIDE_SLOTS,
    DraftPlanner,
    capacity_for,
    eligibility,
    trim_fair,
)
from gpu_worker.engine import Engine
from protocol.messages import SamplingParams, SlotWork, WorkKind, token_array
from scripts.tiny_model import make_tiny_model
from tests.unit.spec_serve import drafted, oracle, passes, serve

PROMPTS = [[5, 6, 7, 8] * 4, list(range(20, 36)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3],
           list(range(60, 72)), [9, 8, 7] * 5, list(range(90, 101))]
CONTEXT = 320


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=5,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=6, max_len=CONTEXT).model


# ---- the pure rules ---------------------------------------------------------------------------
def _water_fill(lengths: list[int], budget: int) -> list[int]:
    """Reference: the highest level L with sum(min(n, L)) <= budget; the drafts left over go
    one each to the slots above L, earliest first."""
    if sum(lengths) <= budget:
        return list(lengths)
    level = max(L for L in range(max(lengths) + 1)
                if sum(min(n, L) for n in lengths) <= max(budget, 0))
    out = [min(n, level) for n in lengths]
    spare = max(budget, 0) - sum(out)
    for i, n in enumerate(lengths):
        if n > level and spare:
            out[i] += 1
            spare -= 1
    return out


def test_trim_fair_takes_one_draft_at_a_time_from_the_longest():
    assert trim_fair([4, 4, 1], 6) == [3, 2, 1]
    assert trim_fair([4, 4, 4, 4], 12) == [3, 3, 3, 3]
    assert trim_fair([4, 0, 2], 10) == [4, 0, 2]
    assert trim_fair([3, 2], 0) == [0, 0] == trim_fair([3, 2], -4)
    rng = random.Random(0)
    for _ in range(500):
        lengths = [rng.randrange(0, 16) for _ in range(rng.randrange(1, 9))]
        budget = rng.randrange(-2, sum(lengths) + 3)
        assert trim_fair(lengths, budget) == _water_fill(lengths, budget), (lengths, budget)


def test_capacity_is_the_smallest_bucket_that_holds_the_rows():
    assert [capacity_for(r) for r in (1, 8, 9, 12, 13, 16, 17)] == [8, 8, 12, 12, 16, 16, None]


def test_eligibility_says_which_configurations_go_wide_and_why():
    wide = SpeculationSection(mode="wide")
    assert eligibility(None, max_slots=4).batching == "plain"
    assert eligibility(SpeculationSection(mode="off"), max_slots=4).batching == "plain"
    assert eligibility(wide, max_slots=1).batching == "solo"
    assert eligibility(SpeculationSection(mode="narrow"), max_slots=4).batching == "narrow"
    for backend, placement in itertools.product(("numpy", "cupy", "auto"),
                                                ("gpu", "cpu", "split")):
        got = eligibility(wide, max_slots=4, backend=backend, placement=placement)
        assert got.batching == "wide" and "no room" not in got.reason
    other = eligibility(wide, max_slots=4, backend="tpu")
    assert other.batching == "narrow" and "tpu" in other.reason
    assert "no room" in eligibility(wide, max_slots=16).reason
    with capture_logs() as logs:
        DraftPlanner(wide, max_slots=4, backend="cupy", placement="split")
    lines = [e for e in logs if e["event"] == "speculation eligibility"]
    assert len(lines) == 1
    assert lines[0]["batching"] == "wide" and lines[0]["placement"] == "split"


def _work(slot: int, drafts: int, kind: WorkKind = WorkKind.DECODE) -> SlotWork:
    n = 1 if kind == WorkKind.DECODE else 8
    return SlotWork(slot=slot, request_id=f"r{slot}", kind=kind, input_ids=token_array([1] * n),
                    start_pos=20, num_tokens=n, needs_logits=True, prompt_len=20,
                    draft_ids=token_array(list(range(drafts))),
                    draft_sources=np.full(drafts, 2, np.uint8),
                    sampling=SamplingParams(temperature=0, seed=1))


def test_fit_trims_to_sixteen_rows_and_four_drafted_slots_taking_turns():
    planner = DraftPlanner(SpeculationSection(mode="wide"), max_slots=6)
    work, wide = planner.fit([_work(s, 4) for s in range(4)])  # 4 x (1 + 4) = 20 rows
    assert wide and drafted_counts(work) == [3, 3, 3, 3] and planner.last_capacity == 16
    work, _ = planner.fit([_work(0, 2), _work(1, 1), _work(2, 0)])
    assert drafted_counts(work) == [2, 1, 0] and planner.last_capacity == 8
    planner = DraftPlanner(SpeculationSection(mode="wide"), max_slots=6)
    seen = []
    for _ in range(6):  # six drafted slots: four per pass, nobody waits two steps running
        work, wide = planner.fit([_work(s, 2) for s in range(6)])
        counts = drafted_counts(work)
        assert wide and sum(1 for n in counts if n) == MAX_WIDE_SLOTS
        assert 6 + sum(counts) <= 16
        seen.append({w.slot for w in work if len(w.draft_ids)})
    for before, after in itertools.pairwise(seen):
        assert set(range(6)) - before <= after


def test_fit_applies_the_step_cap_and_the_admission_preference():
    capped = DraftPlanner(SpeculationSection(mode="narrow", max_drafts_per_step=5), max_slots=4)
    work, wide = capped.fit([_work(0, 4), _work(1, 4), _work(2, 1)])
    assert not wide and drafted_counts(work) == [2, 2, 1]
    mixed = [_work(0, 3), _work(1, 0, WorkKind.PREFILL)]
    first = DraftPlanner(SpeculationSection(mode="wide", prefer="admission"), max_slots=2)
    assert drafted_counts(first.fit(mixed)[0]) == [0, 0]
    assert drafted_counts(first.fit([_work(0, 3), _work(1, 2)])[0]) == [3, 2]
    drafts = DraftPlanner(SpeculationSection(mode="wide", prefer="drafts"), max_slots=2)
    assert drafted_counts(drafts.fit(mixed)[0]) == [3, 0]


def drafted_counts(work: list[SlotWork]) -> list[int]:
    return [len(w.draft_ids) for w in work]


# ---- exact tokens through the scheduler and the Runner ------------------------------------------
def _layouts(slots: int) -> list[tuple[int, ...]]:
    """Every assignment of 0-4 drafts to the slots, up to order (4 slots: 70 layouts)."""
    return list(itertools.combinations_with_replacement(range(5), slots))


class _LayoutDriver:
    """Runs the layouts one per step in which every request decodes: wraps the scheduler's
    plan, records (layout, plan) and gives the oracle its length for each slot."""

    def __init__(self, sched, slots: int) -> None:
        self.sched, self.slots, self.todo = sched, slots, _layouts(slots)
        self.current: tuple[int, ...] | None = None
        self.steps: list[tuple[tuple[int, ...], object]] = []
        plan = sched.plan

        def planned():
            active = [s for s in sched.slots if s is not None]
            ready = len(active) == slots and not any(s.in_prefill for s in active)
            self.current = self.todo.pop(0) if ready and self.todo else None
            p = plan()
            if self.current is not None:
                self.steps.append((self.current, p))
            return p
        sched.plan = planned

    def length(self, seq) -> int:
        return 0 if self.current is None else self.current[seq.slot]


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
def test_every_layout_up_to_four_slots_by_four_drafts_gives_plain_tokens(model, slots):
    # n: room for the worst case (every draft accepted: 4 slots' last one takes 294 tokens)
    prompts, n = PROMPTS[:slots], 300
    plain, _, _ = serve(model, prompts, n=n, context=CONTEXT)
    driver: list[_LayoutDriver] = []
    vocab = model.cfg.vocab_size
    got, worker, _ = serve(model, prompts, n=n, mode="wide", context=CONTEXT,
                           drafts=oracle(plain, vocab, lambda seq: driver[0].length(seq)),
                           setup=lambda s: driver.append(_LayoutDriver(s, slots)))
    assert got == plain
    assert not driver[0].todo, f"{len(driver[0].todo)} layouts never ran"
    for layout, plan in driver[0].steps:
        want = trim_fair(list(layout), 16 - slots)  # plan order is slot order
        assert drafted(plan) == want, (layout, drafted(plan))
        assert plan.num_rows <= 16 and plan.wide
    assert set(passes(worker)) == {1}
    assert sum(r.num_accepted for res in worker.results for r in res.slots) > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_six_drafted_slots_take_turns_in_one_pass_with_plain_tokens(model, temperature):
    n = [60, 52, 44, 60, 36, 50]
    plain, _, _ = serve(model, PROMPTS, n=n, temperature=temperature)
    vocab = model.cfg.vocab_size
    for mode in ("wide", "narrow"):
        got, worker, _ = serve(model, PROMPTS, n=n, mode=mode, temperature=temperature,
                               drafts=oracle(plain, vocab, lambda seq: 3))
        assert got == plain, mode
        full = [p for p in worker.plans if len(p.slots) == 6
                and all(w.kind == WorkKind.DECODE for w in p.slots)]
        assert full, "no step had six decoding slots"
        if mode == "narrow":  # one pass per drafted slot (none left for a plain pass)
            assert any(r.counters["passes"] == 6 and len(p.slots) == 6
                       for p, r in zip(worker.plans, worker.results, strict=True))
            continue
        assert set(passes(worker)) == {1}
        for p in full:
            counts = drafted(p)
            assert sum(1 for c in counts if c) == MAX_WIDE_SLOTS and p.num_rows <= 16
        verified = {w.request_id for p in full for w in p.slots if len(w.draft_ids)}
        assert verified == {f"r{i}" for i in range(6)}


def test_one_drafted_slot_costs_one_pass_and_goes_solo_when_alone(model):
    prompts, n = PROMPTS[:3], [40, 12, 10]
    plain, plain_worker, _ = serve(model, prompts, n=n)
    lone = oracle(plain, model.cfg.vocab_size, lambda seq: 3 if seq.req.request_id == "r0"
                  else 0)
    for mode, with_others in (("wide", 1), ("narrow", 2)):
        got, worker, _ = serve(model, prompts, n=n, mode=mode, drafts=lone)
        assert got == plain, mode
        steps = list(zip([p for p in worker.plans if p.slots], passes(worker), strict=True))
        shared = [k for p, k in steps if drafted(p)[0] and len(p.slots) == 3]
        assert shared and set(shared) == {with_others}, mode
        alone = [k for p, k in steps if len(p.slots) == 1 and drafted(p)[0]]
        assert alone and set(alone) == {1}, mode  # solo: its own rows only
        assert worker.runner.num_passes == sum(k for _, k in steps)
    assert set(passes(plain_worker)) == {1}
