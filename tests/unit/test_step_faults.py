"""The scheduler's step loop survives any single bad request (issue 16, defect 1): a fault in
one request's data fails that request alone; an unexpected error of the worker link means the
worker is broken (run() returns for a restart); nothing raises out of run()."""

from __future__ import annotations

import asyncio

import pytest

from daemon.request import GenerationRequest, RequestRejected
from daemon.scheduler import Scheduler
from protocol.messages import (
    Phase,
    PromptPhase,
    SamplingParams,
    SlotResult,
    StepResult,
    WorkKind,
)


class EchoWorker:
    """Samples token 7 wherever logits are asked for."""

    def __init__(self, broken_at: int | None = None) -> None:
        self.steps, self.broken_at = 0, broken_at

    async def step(self, plan):
        self.steps += 1
        await asyncio.sleep(0)
        if self.broken_at is not None and self.steps >= self.broken_at:
            raise RuntimeError("garbled reply")
        slots = []
        for w in plan.slots:
            prefill = w.kind == WorkKind.PREFILL
            phase = PromptPhase(phase=Phase.PREFILL if prefill else Phase.DECODE,
                                prompt_tokens_this_step=w.num_tokens if prefill else 0,
                                prompt_len=w.prompt_len, cached_len=w.cached_len)
            slots.append(SlotResult(slot=w.slot, request_id=w.request_id,
                                    token_ids=[7] if w.needs_logits else [], num_accepted=0,
                                    prompt=phase))
        return StepResult(step_id=plan.step_id, slots=slots)


def _sched(worker, vocab: int | None = None) -> Scheduler:
    s = Scheduler(max_slots=2, max_context=64, max_queue=4, prefill_chunk=8, block_size=4,
                  checkpoint_interval=8, prefix_blocks=0)
    s.vocab_size = vocab
    s.attach(worker)
    return s


def _req(rid: str, ids: list[int], n: int = 5) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(temperature=0.0, seed=1), n, eos=False)


async def _collect(handle):
    ids, last = [], None
    async for ev in handle:
        ids += ev.token_ids
        last = ev
    return ids, last


def _run(sched, handles):
    async def go():
        loop = asyncio.create_task(sched.run())
        out = await asyncio.wait_for(asyncio.gather(*map(_collect, handles)), 10)
        assert not loop.done(), "the step loop ended"
        loop.cancel()
        return out
    return asyncio.run(go())


def test_a_request_that_breaks_planning_fails_alone():
    sched = _sched(EchoWorker())
    good = sched.submit(_req("good", [1, 2, 3]))
    bad = sched.submit(_req("bad", [1, 2, 3]))
    sched.by_id["bad"].req.prompt_ids[1] = -1  # data that got past admission somehow
    (ids, last), (_, failed) = _run(sched, [good, bad])
    assert ids == [7] * 5 and last.finish_reason == "length"
    assert failed.finish_reason == "error" and "token ids" in failed.error
    assert sched.slots == [None, None] and not sched.by_id


def test_a_request_that_breaks_commit_fails_alone():
    sched = _sched(EchoWorker())
    good, bad = sched.submit(_req("good", [4, 5])), sched.submit(_req("bad", [4, 5]))

    def boom(ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")
    sched.by_id["bad"].add_tokens = boom
    (ids, last), (_, failed) = _run(sched, [good, bad])
    assert ids == [7] * 5 and last.finish_reason == "length"
    assert failed.finish_reason == "error" and "UnicodeDecodeError" in failed.error
    assert sched.slots == [None, None]


def test_a_broken_worker_link_ends_the_loop_and_fails_in_flight_requests():
    sched = _sched(EchoWorker(broken_at=3))
    h = sched.submit(_req("r", [1, 2, 3], n=20))

    async def go():
        await asyncio.wait_for(sched.run(), 5)  # returns (for a restart), does not raise
        return await _collect(h)
    _, last = asyncio.run(go())
    assert last.finish_reason == "error" and "garbled reply" in last.error
    assert sched.worker is None and sched.slots == [None, None]


@pytest.mark.parametrize("ids, words", [([1, -1], "must be >= 0"), ([1, 2**31 - 1], "vocabulary"),
                                        ([100], "vocabulary")])
def test_admission_refuses_ids_outside_the_vocabulary(ids, words):
    sched = _sched(EchoWorker(), vocab=100)
    with pytest.raises(RequestRejected, match=words):
        sched.submit(_req("r", ids))
    assert not sched.by_id and not sched.queue
