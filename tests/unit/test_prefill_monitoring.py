"""Prefill monitoring (issue 16): each request is queued | prefilling (done/total, rate) |
decoding, from the worker's PromptPhase metadata or, for a result without it, from the
daemon's inference; in /v1/slots, /metrics and (opt-in) SSE progress events.

The scheduler is driven step by step (plan -> a fake worker -> commit) with a chosen step time,
so every figure is exact."""

from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from daemon.api_http import make_app
from daemon.config import DEFAULT_MODEL, load_config
from daemon.metrics import Metrics, StepStats
from daemon.progress import infer_prompt_phase
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from protocol.messages import Phase, PromptPhase, SamplingParams, SlotResult, StepResult, WorkKind

STEP_S = 0.5


def runner_phase(w) -> PromptPhase:
    """What gpu_worker.runner reports (written out here, independently of the daemon's
    fallback): a prefill chunk that reaches the prompt's end leaves the slot decoding."""
    prefill = w.kind == WorkKind.PREFILL
    at_end = w.start_pos + w.num_tokens >= w.prompt_len
    return PromptPhase(phase=Phase.DECODE if not prefill or at_end else Phase.PREFILL,
                       prompt_tokens_this_step=w.num_tokens if prefill else 0,
                       prompt_len=w.prompt_len, cached_len=w.cached_len)


def result(plan, metadata: bool = True, emit: int = 1) -> StepResult:
    slots = []
    for w in plan.slots:
        n = emit if w.needs_logits and w.kind == WorkKind.DECODE else int(w.needs_logits)
        slots.append(SlotResult(slot=w.slot, request_id=w.request_id, token_ids=[7] * n,
                                num_accepted=n - 1 if n else 0,
                                prompt=runner_phase(w) if metadata else None))
    return StepResult(step_id=plan.step_id, slots=slots,
                      counters={"moe_layers": 2, "gpu_experts": 3, "cpu_experts": 4,
                                "cpu_expert_bytes": 10**9},
                      timings_ms={"cpu_experts": 250.0})


def sched(max_slots: int = 1, metrics: Metrics | None = None) -> Scheduler:
    s = Scheduler(max_slots=max_slots, max_context=256, max_queue=8, prefill_chunk=8,
                  block_size=4, checkpoint_interval=8, prefix_blocks=0, metrics=metrics)
    s.attach(object())  # steps are run by hand here
    return s


def req(rid: str, n_prompt: int, max_tokens: int = 3, priority: int = 0,
        progress: bool = False) -> GenerationRequest:
    return GenerationRequest(rid, list(range(1, n_prompt + 1)), SamplingParams(seed=1),
                             max_tokens, priority=priority, eos=False, progress=progress)


def step(s: Scheduler, metadata: bool = True, emit: int = 1) -> dict:
    plan = s.plan()
    s.commit(plan, result(plan, metadata, emit), STEP_S)
    return s.snapshot()


def states(snap: dict) -> list[tuple]:
    rows = [r for r in snap["slots"] if r["request_id"]] + snap["queued"]
    return sorted((r["request_id"], r["state"], r["prompt_done"], r["prompt_total"],
                   r["prompt_tokens_per_s"]) for r in rows)


def run_scenario(metadata: bool) -> list[list[tuple]]:
    """A 20-token prompt (3 chunks of 8) behind which two wait; the third arrives with a
    higher priority mid-prefill and preempts the first."""
    s = sched()
    s.submit(req("a", 20))
    s.submit(req("b", 5))
    seen = [states(s.snapshot())]
    for i in range(14):
        if i == 1:
            s.submit(req("c", 4, priority=5))
        seen.append(states(step(s, metadata)))
    return seen


# ---- states ---------------------------------------------------------------------------------
def test_a_queued_request_never_shows_as_prefilling():
    seen = run_scenario(metadata=True)
    flat = [row for snap in seen for row in snap]
    assert ("b", "queued", 0, 5, None) in seen[0]
    assert ("a", "prefilling", 8, 20, 16.0) in seen[1]  # 8 tokens in a 0.5 s step
    # "a" was preempted after prefilling 8 tokens: queued, and nothing else, while it waits
    assert ("a", "queued", 8, 20, None) in flat
    for rid in "abc":  # queued: no progress beyond what it had, and no rate
        rows = [r for r in flat if r[0] == rid]
        assert all(r[4] is None for r in rows if r[1] == "queued"), rows
        assert rows[-1][1] == "decoding"
    # a prompt of one chunk goes from queued to decoding in one step; a longer one prefills
    assert [r[1] for r in flat if r[0] == "b" and r[1] != "queued"][0] == "decoding"
    assert all(r[1] in ("queued", "prefilling", "decoding") for r in flat)


def test_the_fallback_inference_gives_the_same_states():
    assert run_scenario(metadata=False) == run_scenario(metadata=True)
    s = sched()
    s.submit(req("x", 20))
    for _ in range(4):
        plan = s.plan()
        for w in plan.slots:
            assert infer_prompt_phase(w) == runner_phase(w)
        s.commit(plan, result(plan), STEP_S)


def test_a_rate_goes_to_none_when_prompt_work_stops():
    metrics = Metrics()
    s = sched(metrics=metrics)
    s.submit(req("a", 12, max_tokens=5))
    snap = step(s)
    assert snap["slots"][0]["prompt_tokens_per_s"] == 16.0
    assert _value(metrics, "tandem_prompt_throughput_tokens_per_second") == 16.0
    snap = step(s)  # the last 4 prompt tokens and the first token
    assert snap["slots"][0]["state"] == "decoding"
    assert snap["slots"][0]["prompt_tokens_per_s"] is None  # decoding shows no prompt rate
    assert _value(metrics, "tandem_prompt_throughput_tokens_per_second") == 8.0
    snap = step(s)  # decode only: the rate is stale, so absent, not the last value
    assert snap["slots"][0]["prompt_tokens_per_s"] is None
    assert _value(metrics, "tandem_prompt_throughput_tokens_per_second") is None
    assert _value(metrics, "tandem_prompt_work_seconds_total") == 2 * STEP_S
    assert _value(metrics, "tandem_step_prompt_tokens_total") == 12


# ---- /metrics -------------------------------------------------------------------------------
def _value(metrics: Metrics, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def test_request_state_gauges_count_queued_requests():
    metrics = Metrics()
    s = sched(metrics=metrics)
    for rid in "abc":
        s.submit(req(rid, 10))
    assert _value(metrics, "tandem_requests", state="queued") == 3
    step(s)
    assert _value(metrics, "tandem_requests", state="queued") == 2
    assert _value(metrics, "tandem_requests", state="prefilling") == 1
    step(s)
    assert _value(metrics, "tandem_requests", state="decoding") == 1


def test_inter_token_latency_counts_every_emitted_token():
    metrics = Metrics()
    s = sched(metrics=metrics)
    s.submit(req("a", 4, max_tokens=20))
    step(s)  # prefill + first token: a TTFT, no gap
    assert _value(metrics, "tandem_inter_token_latency_seconds_count") == 0
    step(s)
    assert _value(metrics, "tandem_inter_token_latency_seconds_count") == 1
    step(s, emit=3)  # a verified step that emitted 3 tokens: 3 gaps
    assert _value(metrics, "tandem_inter_token_latency_seconds_count") == 4
    assert _value(metrics, "tandem_time_to_first_token_seconds_count") == 1


def test_cpu_expert_dram_bandwidth_gauge():
    metrics = Metrics()
    base = dict(seconds=1.0, rows=1, prompt_tokens=0, decode_tokens=1, emitted=1,
                active_slots=1, queue_depth=0, steady_seconds=None, steady_slots=1)
    counters = {"moe_layers": 2, "gpu_experts": 1, "cpu_experts": 4, "cpu_expert_bytes": 3 * 10**9}
    metrics.record_step(StepStats(**base, counters=counters, cpu_expert_seconds=0.5))
    assert _value(metrics, "tandem_cpu_expert_dram_gbytes_per_second") == 6.0
    no_cpu = counters | {"cpu_experts": 0, "cpu_expert_bytes": 0}
    metrics.record_step(StepStats(**base, counters=no_cpu, cpu_expert_seconds=0.0))
    assert _value(metrics, "tandem_cpu_expert_dram_gbytes_per_second") is None


# ---- events: the handle and the SSE stream ----------------------------------------------------
def test_progress_events_only_for_requests_that_ask():
    s = sched()
    loud, quiet = s.submit(req("a", 20, progress=True)), s.submit(req("b", 4))
    for _ in range(12):
        step(s)
    got = []
    while not loud._queue.empty():
        ev = loud._queue.get_nowait()
        got.append(ev.progress["state"] + str(ev.progress["prompt_done"]) if ev.progress
                   else "tokens")
    assert got[:5] == ["queued0", "prefilling8", "prefilling16", "decoding20", "tokens"]
    assert all(g == "tokens" for g in got[4:])
    while not quiet._queue.empty():
        assert quiet._queue.get_nowait().progress is None


class SlowWorker:
    async def step(self, plan):
        await asyncio.sleep(0.01)
        return result(plan)


async def test_sse_progress_events_with_include_progress():
    config = load_config(None, {"model.path": DEFAULT_MODEL, "scheduler.max_context": 256})
    s = Scheduler(max_slots=1, max_context=256, max_queue=8, prefill_chunk=8, block_size=4,
                  checkpoint_interval=8, prefix_blocks=0)
    s.attach(SlowWorker())
    loop = asyncio.create_task(s.run())
    client = TestClient(TestServer(make_app(s, None, config, Metrics())))
    await client.start_server()
    body = {"prompt": list(range(1, 21)), "max_tokens": 2, "stream": True,
            "stream_options": {"include_progress": True}}
    r = await client.post("/v1/completions", json=body)
    assert r.status == 200
    text = await r.text()
    events = text.strip().split("\n\n")
    progress = [json.loads(e.split("data: ", 1)[1]) for e in events
                if e.startswith("event: progress\n")]
    assert [p["object"] for p in progress] == ["tandem.prompt_progress"] * len(progress)
    assert [(p["progress"]["state"], p["progress"]["prompt_done"]) for p in progress] == [
        ("queued", 0), ("prefilling", 8), ("prefilling", 16), ("decoding", 20)]
    assert events[-1] == "data: [DONE]"
    r = await client.post("/v1/completions", json=body | {"stream_options": None})
    assert "event: progress" not in await r.text()
    loop.cancel()
    await client.close()
