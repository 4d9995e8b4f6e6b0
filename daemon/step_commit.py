"""Applying one step's results to the scheduler's requests (``Scheduler.commit``).

Per slot: its position in the worker's cache, its MTP drafts, its prompt progress (the worker's
PromptPhase, daemon.progress), its new tokens (to its handle), its latency figures; then the
step's figures for /metrics. Bookkeeping over plain data: nothing here awaits.
"""

from __future__ import annotations

import time
from typing import Any

from daemon import progress
from daemon.metrics import Metrics, NullMetrics, StepStats
from daemon.sequence import Sequence
from protocol.messages import DraftSource, StepPlan, StepResult, WorkKind


def commit_step(sched: Any, plan: StepPlan, result: StepResult, seconds: float,
                t_plan: float | None = None) -> None:
    """Apply ``result`` (the worker's answer to ``plan``) to ``sched`` (a daemon.scheduler
    Scheduler: its slots, queue, metrics and ending helpers). ``seconds``: the worker's step;
    ``t_plan``: when planning began (the steady-decode figures count from there)."""
    now = time.monotonic()
    prompt_tokens = decode_tokens = emitted = 0
    for work, res in zip(plan.slots, result.slots, strict=True):
        seq = sched.slots[work.slot]
        # the input rows and the accepted drafts are in the worker's cache now
        seq.processed = work.start_pos + work.num_tokens + res.num_accepted
        seq.mtp_drafts = list(res.drafts)
        prompt_tokens += progress.observe(seq, progress.prompt_phase(work, res), seconds)
        if work.kind != WorkKind.PREFILL:
            decode_tokens += work.num_tokens
        if len(work.draft_ids):
            sched.metrics.observe_drafts(DraftSource(int(work.draft_sources[0])).name.lower(),
                                         len(work.draft_ids), res.num_accepted)
        progress.push_event(seq)  # before its tokens: "decoding" precedes the first one
        if not res.token_ids:
            continue
        emitted += len(res.token_ids)
        try:
            event = seq.add_tokens(res.token_ids)
        except Exception as exc:  # e.g. its detokenizer: this request alone fails
            sched._fail_request(work.slot, seq, exc)
            continue
        observe_latency(sched.metrics, seq, now, len(res.token_ids))
        if event is not None:
            seq.handle.push(event)
        if seq.finished:
            sched._done(seq)
            release_finished(sched, work.slot, seq)
    sched.draft_plan.observe(plan, result, seconds)  # the adaptive draft budget's estimates
    waiting = [entry[2] for entry in sched.queue]
    for seq in waiting:  # e.g. preempted by this plan: now queued
        progress.push_event(seq)
    # steady: every slot decoding, no admission underway (docs/architecture.md §8, steady decode)
    steady = t_plan is not None and bool(plan.slots) and not prompt_tokens
    sched.metrics.record_step(StepStats(
        seconds=seconds, rows=plan.num_rows, prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens, emitted=emitted,
        active_slots=sum(s is not None for s in sched.slots), queue_depth=len(sched.queue),
        steady_seconds=time.monotonic() - t_plan if steady else None,
        steady_slots=len(plan.slots), counters=result.counters,
        cpu_expert_seconds=result.timings_ms.get("cpu_experts", 0.0) / 1e3,
        worker_ms=result.timings_ms))
    sched.metrics.set_request_states(
        progress.counts([s for s in sched.slots if s is not None] + waiting))
    if sched.trace is not None:  # benchmarks only (daemon/step_trace.py)
        sched.trace.add(plan, result, seconds,
                        None if t_plan is None else time.monotonic() - t_plan,
                        sched.draft_plan.budget_step())


def release_finished(sched: Any, slot: int, seq: Sequence) -> None:
    """Free a finished request's slot, first keeping its state after every token it fed (its
    prompt and its answer but the last token) as a prefix checkpoint: a conversation's next
    turn (this prompt, this answer, a new message) then prefills only what is new, if it
    repeats the answer token for token; a weak entry, evicted first until a turn hits it
    (daemon/prefix_cache.py). It runs before the slot is freed (both are the next step's
    cache commands)."""
    # NOTE: drafts accepted past the request's end (its stop or max_tokens) are in the
    # worker's cache but not in ``generated``: then its state is after unknown tokens
    known = len(seq.prompt) + len(seq.generated)
    if (sched.prefix is not None and len(seq.prompt) < seq.processed < known
            and sched._shareable(slot, seq)):
        sched._checkpoint(slot, seq.tokens(0, seq.processed), sched._ops,
                          sched._space(slot, seq), weak=True)
    sched._release(slot)


def observe_latency(metrics: Metrics | NullMetrics, seq: Sequence, now: float,
                    k: int) -> None:
    """``k`` tokens of ``seq`` arrived at ``now``: one latency figure per token. The first
    token of a request is its TTFT; every other token records the gap before it, a step's
    interval shared evenly by the k tokens it emitted (speculation: k gaps, not one)."""
    if k <= 0:
        return
    if seq.t_last is None:
        metrics.observe_ttft(now - seq.t_submit)
        gaps = [0.0] * (k - 1)  # emitted together with the first
    else:
        gaps = [(now - seq.t_last) / k] * k
    for gap in gaps:
        metrics.observe_itl(gap)
    seq.t_last = now
