"""Speculative decoding (docs/architecture.md §4): suffix drafts verified by sample-and-match
give exactly the tokens of plain decoding, narrow and wide, greedy and sampled, on both
architectures (for Qwen3-Next the recurrent state of the last accepted row is adopted)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from daemon.config import SpeculationSection
from daemon.proposers.suffix import SuffixProposer
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.engine import Engine
from gpu_worker.runner import PlanError, Runner
from protocol.messages import (
    CacheOp,
    CacheOpKind,
    SamplingParams,
    SlotWork,
    StepPlan,
    WorkKind,
    token_array,
)
from scripts.tiny_model import make_tiny_model
from tests.harness import InProcessWorker, drain

SLOTS, CONTEXT = 3, 160


# ---- the proposer ---------------------------------------------------------------------------
def test_suffix_proposer_continues_the_latest_longest_match():
    p = SuffixProposer(2, 4)
    p.extend([1, 2, 3, 4, 5, 1, 2])
    assert p.propose(3) == [3, 4, 5]
    assert p.propose(0) == []
    p.extend([9])  # (2, 9) never occurred before
    assert p.propose(3) == []
    p = SuffixProposer(2, 8)  # "1 2 3" beats the later, shorter "2 3"
    p.extend([7, 1, 2, 3, 40, 5, 2, 3, 50, 6, 1, 2, 3])
    assert p.propose(2) == [40, 5]
    p = SuffixProposer(2, 8)  # among equally long matches the latest wins
    p.extend([1, 2, 10, 1, 2, 20, 1, 2])
    assert p.propose(1) == [20]
    p = SuffixProposer(2, 8)  # a period: the continuation runs into the suffix itself
    p.extend([4, 5, 4, 5])
    assert p.propose(5) == [4, 5]
    p = SuffixProposer(3, 8)  # a 2-token match is too short
    p.extend([1, 2, 9, 1, 2])
    assert p.propose(2) == []
    with pytest.raises(ValueError):
        SuffixProposer(3, 2)


# ---- exact tokens through the scheduler and the real Runner ---------------------------------
@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def model(request, tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=4,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=SLOTS, max_len=CONTEXT).model


PROMPTS = [[5, 6, 7, 8] * 6, list(range(20, 44)) + list(range(20, 30)), [3, 1, 4, 1, 5, 9, 2, 6]]


def _serve(model, mode: str, temperature: float, n: int = 40, eos_ids=(), oracle=None,
           prompts=PROMPTS, metrics=None, kv_int8=False, cuda_graphs=False, **spec):
    """Three concurrent requests through the scheduler and the Runner. ``oracle``: the
    plain run's outputs; drafts are then its true continuation with one token in two of
    every three steps made wrong (so verification meets long hits and misses).
    ``cuda_graphs``: the Runner's (CuPy; with capacity buckets, as a server runs)."""
    runner = Runner(model, max_slots=SLOTS, max_context=CONTEXT, block_size=4, extra_blocks=32,
                    kv_int8=kv_int8, cuda_graphs=cuda_graphs, max_drafts=4,
                    speculation_mode=mode)
    sched = Scheduler(max_slots=SLOTS, max_context=CONTEXT, max_queue=4, prefill_chunk=16,
                      block_size=4, checkpoint_interval=8, prefix_blocks=32, eos_ids=eos_ids,
                      speculation=SpeculationSection(mode=mode, **spec), metrics=metrics)
    if oracle is not None:
        vocab = model.cfg.vocab_size

        def drafts(seq):
            i, g = int(seq.req.request_id[1:]), len(seq.generated)
            d = list(oracle[i][0][g:g + min(4, seq.req.max_tokens - g - 1)])
            if d and g % 3:
                d[g % len(d)] = (d[g % len(d)] + 1) % vocab
            return d

        sched._drafts = drafts
    worker = InProcessWorker(runner)
    sched.attach(worker)
    handles = [sched.submit(GenerationRequest(
        f"r{i}", p, SamplingParams(temperature=temperature, seed=11 + i), n - 3 * i,
        eos=bool(eos_ids))) for i, p in enumerate(prompts)]
    return asyncio.run(drain(sched, handles)), worker


def _drafts(worker) -> tuple[int, int]:
    proposed = sum(len(w.draft_ids) for p in worker.plans for w in p.slots)
    accepted = sum(r.num_accepted for res in worker.results for r in res.slots)
    return proposed, accepted


def _drafted(plan) -> int:
    return sum(1 for w in plan.slots if len(w.draft_ids))


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_suffix_drafts_give_the_tokens_of_plain_decoding(model, temperature):
    plain, plain_worker = _serve(model, "off", temperature)
    assert _drafts(plain_worker) == (0, 0)
    for mode in ("narrow", "wide"):
        got, worker = _serve(model, mode, temperature, min_match=1)
        assert got == plain, mode
        assert _drafts(worker)[0] > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_verification_is_exact_through_hits_and_misses(model, temperature):
    plain, plain_worker = _serve(model, "off", temperature)
    for mode in ("narrow", "wide"):
        got, worker = _serve(model, mode, temperature, oracle=plain)
        assert got == plain, mode
        proposed, accepted = _drafts(worker)
        assert 0 < accepted < proposed, (mode, proposed, accepted)
        assert len(worker.plans) < len(plain_worker.plans) * 0.7  # accepted drafts save steps
        drafted = [p for p in worker.plans if _drafted(p)]
        if mode == "narrow":
            assert not any(p.wide for p in drafted)
        else:  # every drafted slot shares the one pass, a lone drafted slot too (issue 15)
            assert any(p.wide and _drafted(p) == 3 for p in drafted)
            assert any(p.wide and _drafted(p) == 1 and len(p.slots) > 1 for p in drafted)
            assert all(p.wide for p in drafted)


def test_drafts_stop_at_eos_and_max_tokens_like_plain_decoding(model):
    plain, _ = _serve(model, "off", 0.0)
    eos = next(t for ids, _ in plain for t in ids[4:] if t not in ids[:4])  # emitted mid-way
    want, _ = _serve(model, "off", 0.0, eos_ids=(eos,))
    got, worker = _serve(model, "wide", 0.0, eos_ids=(eos,), oracle=plain)
    assert got == want
    assert any(finish == "stop" for _, finish in got)
    assert _drafts(worker)[1] > 0
    for (ids, finish), n in zip(got, (40, 37, 34), strict=True):
        assert finish == "stop" or len(ids) == n  # never past max_tokens


def test_plan_with_drafts_past_the_context_is_refused(model):
    runner = Runner(model, max_slots=1, max_context=16, block_size=4)
    runner.execute(StepPlan(step_id=1, cache_ops=[CacheOp(op=CacheOpKind.ALLOCATE, slot=0,
                                                          num_tokens=12)], slots=[SlotWork(
        slot=0, request_id="r", kind=WorkKind.PREFILL, input_ids=token_array(list(range(12))),
        start_pos=0, num_tokens=12, needs_logits=True, prompt_len=12,
        sampling=SamplingParams(temperature=0, seed=1))]))
    with pytest.raises(PlanError, match="past the context limit"):
        runner.execute(StepPlan(step_id=2, slots=[SlotWork(
            slot=0, request_id="r", kind=WorkKind.DECODE, input_ids=token_array([3]),
            start_pos=12, num_tokens=1, needs_logits=True, prompt_len=12,
            draft_ids=token_array([1, 2, 3, 4]), draft_sources=np.full(4, 2, np.uint8),
            sampling=SamplingParams(temperature=0, seed=1))]))


# ---- MTP drafts -------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_mtp_drafts_give_the_tokens_of_plain_decoding(model, temperature):
    """The worker's MTP head proposes (its KV kept over prompt chunks and accepted rows);
    whatever it proposes, the tokens are plain decoding's."""
    plain, _ = _serve(model, "off", temperature)
    for mode in ("narrow", "wide"):
        got, worker = _serve(model, mode, temperature, proposer="mtp", num_drafts=3)
        assert got == plain, mode
        proposed, _ = _drafts(worker)
        if model.mtp is None:  # Qwen3-MoE has no MTP head: no drafts, plain decoding
            assert proposed == 0
            continue
        assert proposed > 0
        sources = {int(s) for p in worker.plans for w in p.slots for s in w.draft_sources}
        assert sources == {1}  # DraftSource.MTP


def test_mtp_drafts_of_the_embedded_model_are_often_right():
    """The shipped model's MTP head (trained; 70 % agreement on code) through the scheduler:
    plain tokens, and a good share of its drafts accepted."""
    from daemon.config import DEFAULT_MODEL
    from daemon.tokenizer import Tokenizer

    engine = Engine.from_dir(DEFAULT_MODEL, dtype="float64", max_slots=SLOTS, max_len=CONTEXT)
    tok = Tokenizer.from_dir(DEFAULT_MODEL)
    prompts = [tok.encode(t) for t in ("def reverse(s):\n    return s[::-1]\n\n\ndef ",
                                       "import os\nimport sys\n\n\nclass Config:\n",
                                       "The quick brown fox")]
    plain, _ = _serve(engine.model, "off", 0.0, prompts=prompts)
    got, worker = _serve(engine.model, "wide", 0.0, prompts=prompts, proposer="mtp",
                         num_drafts=3)
    assert got == plain
    proposed, accepted = _drafts(worker)
    assert accepted >= 0.25 * proposed > 0, (proposed, accepted)


@pytest.mark.parametrize("mode", ["off", "wide"])
def test_steady_decode_counters_count_the_tokens_of_all_decoding_steps(model, mode):
    """N-stream decode TPS (docs/architecture.md §8) comes from these: every token emitted by a step
    in which all active slots decoded is counted under that slot count, the others not."""
    from daemon.metrics import Metrics
    from tests.unit.test_metrics import _value

    metrics = Metrics()
    outs, worker = _serve(model, mode, 0.0, metrics=metrics)
    want: dict[int, int] = {}
    for plan, res in zip(worker.plans, worker.results, strict=True):
        if plan.slots and all(w.kind != WorkKind.PREFILL for w in plan.slots):
            n = len(plan.slots)
            want[n] = want.get(n, 0) + sum(len(r.token_ids) for r in res.slots)
    assert want.get(3, 0) > 0 and sum(want.values()) < sum(len(ids) for ids, _ in outs)
    for n in (1, 2, 3):
        tokens = _value(metrics, "tandem_steady_decode_tokens_total", slots=str(n))
        seconds = _value(metrics, "tandem_steady_decode_seconds_total", slots=str(n))
        assert (tokens or 0) == want.get(n, 0)
        assert (seconds or 0) > 0 if want.get(n) else seconds is None
