"""The adaptive draft budget through the scheduler and the real Runner (issue 15 item 3): the
tokens of plain decoding on both architectures, greedy and sampled, wide and narrow, while
the budget cuts drafts; and with CPU experts (a real pool), the worker's per-slot routing
reaches the budget and agrees with the step's distinct-expert counter."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from daemon.config import SpeculationSection
from daemon.draft_adaptive import PROBE_STEPS
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.engine import Engine, load_model
from gpu_worker.runner import Runner
from protocol.messages import SamplingParams, WorkKind
from scripts.tiny_model import make_tiny_model
from tests.harness import InProcessWorker, drain
from tests.unit.spec_serve import oracle, serve

PROMPTS = [[5, 6, 7, 8] * 4, list(range(20, 36)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
# rows cost half a pass: with the oracle's acceptance the best length is about 2 of 4
ADAPTIVE = dict(draft_budget="adaptive", cost_fixed_ms=1.0, cost_row_ms=0.5,
                cost_expert_ms=0.0)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=5,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=4, max_len=256).model


def _constants_only(sched) -> None:
    sched.draft_plan.budget.fit_costs = False  # the config's costs: a deterministic choice


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("mode", ["wide", "narrow"])
def test_the_adaptive_budget_keeps_plain_tokens_and_cuts_drafts(model, mode, temperature):
    plain, _, _ = serve(model, PROMPTS, n=28, temperature=temperature)
    proposed: dict[tuple[str, int], int] = {}
    base = oracle(plain, model.cfg.vocab_size, lambda seq: 4)

    def drafts(seq):
        d = base(seq)
        proposed[seq.req.request_id, seq.processed] = len(d)
        return d

    got, worker, sched = serve(model, PROMPTS, n=28, temperature=temperature, mode=mode,
                               drafts=drafts, setup=_constants_only, **ADAPTIVE)
    assert got == plain
    verified = [(len(w.draft_ids), proposed[w.request_id, w.start_pos])
                for p in worker.plans for w in p.slots if w.kind == WorkKind.DECODE]
    assert all(n <= k for n, k in verified)
    assert any(0 < n < k for n, k in verified)  # cut
    assert any(n >= 2 for n, _ in verified)  # and kept
    assert sched.draft_plan.budget.accept.sources  # acceptance was measured


def test_without_acceptance_the_budget_stops_drafting(model):
    plain, _, _ = serve(model, PROMPTS, n=40)
    vocab = model.cfg.vocab_size

    def wrong(seq):  # four drafts, never the plain continuation
        g = len(seq.generated)
        return [(t + 1) % vocab for t in plain[int(seq.req.request_id[1:])][0][g:g + 4]]

    got, worker, _ = serve(model, PROMPTS, n=40, mode="wide", drafts=wrong,
                           setup=_constants_only, **ADAPTIVE)
    assert got == plain
    per_request: dict[str, list[int]] = {}
    for p in worker.plans:
        for w in p.slots:
            if w.kind == WorkKind.DECODE:
                per_request.setdefault(w.request_id, []).append(len(w.draft_ids))
    for counts in per_request.values():
        first = next(i for i, n in enumerate(counts) if n)
        assert first == 0  # the optimistic prior: drafts run from the start, until measured
        later = counts[first + 1:]
        # then only one-draft probes, one per PROBE_STEPS steps without drafts
        assert max(later) <= 1 and 0 < sum(later) <= len(later) // PROBE_STEPS


# ---- with CPU experts: the worker's per-slot routing --------------------------------------------
def _serve_pool(model, experts, mode: str, routing: bool):
    runner = Runner(model, max_slots=3, max_context=160, block_size=4, extra_blocks=32,
                    experts=experts, slot_routing=routing)
    sched = Scheduler(max_slots=3, max_context=160, max_queue=4, prefill_chunk=16,
                      block_size=4, checkpoint_interval=8, prefix_blocks=32,
                      speculation=SpeculationSection(mode=mode, min_match=1,
                                                     draft_budget="adaptive"))
    worker = InProcessWorker(runner)
    sched.attach(worker)
    handles = [sched.submit(GenerationRequest(f"r{i}", p * 2, SamplingParams(
        temperature=0.0 if i else 0.8, seed=11 + i), 24)) for i, p in enumerate(PROMPTS)]
    return asyncio.run(drain(sched, handles)), worker, sched


def test_cpu_expert_routing_reaches_the_budget_and_tokens_stay_plain(tmp_path):
    path = make_tiny_model(tmp_path, "qwen3_moe", seed=4, tokenizer=False)
    model, experts = load_model(path, placement="split", cpu_experts_per_layer=4,
                                cpu_workers=1)
    try:
        plain, _, _ = _serve_pool(model, experts, "off", routing=False)
        got, worker, sched = _serve_pool(model, experts, "wide", routing=True)
    finally:
        experts.close()
    assert got == plain
    held = experts.cpu_experts_held
    assert held == 4 * len(experts.on_cpu)
    decode_only = 0
    for plan, res in zip(worker.plans, worker.results, strict=True):
        if not plan.slots:
            continue
        assert res.counters["cpu_experts_held"] == held
        for w, r in zip(plan.slots, res.slots, strict=True):
            if w.kind == WorkKind.PREFILL or not plan.slot_routing:  # not asked: none sent
                assert not len(r.cpu_experts)
            else:
                assert len(r.cpu_experts) and r.cpu_expert_rows.max() <= w.num_rows
        if plan.slot_routing and all(w.kind == WorkKind.DECODE for w in plan.slots):
            decode_only += 1  # every row is tracked
            union = np.unique(np.concatenate([r.cpu_experts for r in res.slots]))
            assert len(union) == res.counters["cpu_experts"]
    assert decode_only > 5
    # the routes are asked where a choice may need them: here the suffix drafts' offers
    # change from step to step, so nearly every step (with steady offers the budget skips
    # most steps' routes: tests/unit/test_budget_reuse.py)
    asked = [p.slot_routing for p in worker.plans if p.slots]
    assert sum(asked) > len(asked) / 2
    routing = sched.draft_plan.budget.routing
    assert routing.universe == held and routing.picks_per_row > 0
    assert routing.persistence != 0.5  # measured
