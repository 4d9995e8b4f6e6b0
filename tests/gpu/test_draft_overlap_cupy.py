"""Draft overlap on CuPy with CPU experts (gpu_worker/draft_overlap.py): narrow MTP speculation,
three requests, the launched path (the drafter on a second stream before the step's stream is
awaited) and the host path (one head pass per CPU load). With the key on, the tokens, plans
and drafts are those with the key off; head passes are issued before the stream is awaited."""

from __future__ import annotations

import asyncio

import pytest

from daemon.config import SpeculationSection
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.engine import Engine
from gpu_worker.runner import Runner
from protocol.messages import SamplingParams
from scripts.tiny_model import make_tiny_model
from tests.harness import InProcessWorker, drain

pytest.importorskip("cupy")
PROMPTS = [list(range(5, 40)), list(range(200, 211)), [7, 9, 11, 13] * 6]


def _serve(path, *, launched: bool, overlap: bool):
    engine = Engine.from_dir(path, backend="cupy", placement="split", cpu_experts_per_layer=3,
                             cpu_workers=1, max_slots=3, max_len=128)
    events: list[str] = []
    try:
        placement = engine.placement
        assert placement.launched
        if not launched:
            placement.use_host_path()
        runner = Runner(engine.model, max_slots=3, max_context=128, block_size=4,
                        extra_blocks=32, experts=placement, draft_overlap=overlap)
        assert (runner.overlap is not None) == overlap, runner.overlap_reason
        if overlap:
            runner.overlap.record = events.append
            end_step = placement.end_step

            def awaited():
                events.append("end_step")
                end_step()

            placement.end_step = awaited
        sched = Scheduler(max_slots=3, max_context=128, max_queue=4, prefill_chunk=16,
                          block_size=4, checkpoint_interval=8, prefix_blocks=32,
                          speculation=SpeculationSection(mode="narrow", proposer="mtp",
                                                         num_drafts=3))
        worker = InProcessWorker(runner)
        sched.attach(worker)
        handles = [sched.submit(GenerationRequest(
            f"r{i}", p, SamplingParams(temperature=0.8 if i else 0.0, seed=i), 24, eos=False))
            for i, p in enumerate(PROMPTS)]
        out = [ids for ids, _ in asyncio.run(drain(sched, handles))]
        plans = [[(w.slot, w.start_pos, w.input_ids.tolist(), w.draft_ids.tolist())
                  for w in p.slots] for p in worker.plans]
        drafts = [[list(r.drafts) for r in res.slots] for res in worker.results]
        return out, plans, drafts, worker.results, events
    finally:
        engine.close()


@pytest.mark.parametrize("launched", [True, False], ids=["launched", "host"])
def test_draft_overlap_keeps_tokens_and_drafts_on_the_device(tmp_path, launched):
    path = make_tiny_model(tmp_path, "qwen3_next", seed=5, tokenizer=False,
                           moe_intermediate=64, std=0.1)
    off, plans_off, drafts_off, _, _ = _serve(path, launched=launched, overlap=False)
    on, plans_on, drafts_on, results, events = _serve(path, launched=launched, overlap=True)
    first = next((i for i, (a, b) in enumerate(zip(drafts_on, drafts_off, strict=False))
                  if a != b), None)
    assert first is None, (first, drafts_on[first], drafts_off[first])
    assert plans_on == plans_off
    assert on == off and [len(t) for t in on] == [24, 24, 24]
    units = sum(r.counters.get("draft_units_overlapped", 0) for r in results)
    overlapped_ms = sum(r.timings_ms.get("draft_overlapped", 0.0) for r in results)
    print(f"overlapped head passes {units}, {overlapped_ms:.1f} ms of "
          f"{sum(r.timings_ms.get('draft', 0.0) for r in results):.1f} ms drafter time")
    assert units > 0
    for i, e in enumerate(events):  # issued before the pass's stream was awaited
        if e == "draft_unit_overlapped":
            nxt = next((x for x in events[i + 1:] if x in ("end_step", "draft_unit_exposed")),
                       None)
            assert nxt == "end_step", events[max(0, i - 4):i + 4]
