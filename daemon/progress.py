"""Where each request's prompt stands: ``queued | prefilling (done/total, rate) | decoding``.

The source is the worker's explicit metadata: every SlotResult carries a PromptPhase (protocol
v2 on; the protocol version is the capability, checked at READY). A result without it (a
worker that does not send it, e.g. a test double) gets `infer_prompt_phase`, the daemon's own
reading of the plan's SlotWork, which yields the same phases.

Rules the monitor keeps (issue 16): a request waiting for a slot is ``queued``, never
``prefilling``, whatever work it did before a preemption; a rate belongs to the latest step
only: a step that did no prompt work for the request reports its rate as None, not the last
value.
"""

from __future__ import annotations

from daemon.request import RequestEvent
from daemon.sequence import PromptProgress, Sequence
from protocol.messages import Phase, PromptPhase, SlotResult, SlotWork, WorkKind

QUEUED, PREFILLING, DECODING = "queued", "prefilling", "decoding"
STATES = (QUEUED, PREFILLING, DECODING)


def infer_prompt_phase(work: SlotWork) -> PromptPhase:
    """The fallback: the phase a worker reports after running ``work`` (a prefill chunk that
    reaches the end of the prompt leaves the slot decoding)."""
    prefill = work.kind == WorkKind.PREFILL
    reached = work.start_pos + work.num_tokens >= work.prompt_len
    return PromptPhase(phase=Phase.PREFILL if prefill and not reached else Phase.DECODE,
                       prompt_tokens_this_step=work.num_tokens if prefill else 0,
                       prompt_len=work.prompt_len, cached_len=work.cached_len)


def prompt_phase(work: SlotWork, result: SlotResult) -> PromptPhase:
    """The worker's metadata when the result carries it, else the inference."""
    phase = getattr(result, "prompt", None)
    return phase if phase is not None else infer_prompt_phase(work)


def admitted(seq: Sequence) -> None:
    """``seq`` got a slot: no result yet, so its work so far is all that is known."""
    seq.progress = PromptProgress(done=min(seq.processed, seq.prefill_len),
                                  total=seq.prefill_len, cached=seq.cached)


def observe(seq: Sequence, phase: PromptPhase, seconds: float) -> int:
    """Record a step's result for ``seq`` (after ``seq.processed`` moved); returns the prompt
    tokens the step did for it."""
    work = phase.prompt_tokens_this_step
    seq.progress = PromptProgress(
        phase=phase.phase, done=min(seq.processed, phase.prompt_len), total=phase.prompt_len,
        cached=phase.cached_len, rate=work / seconds if work and seconds > 0 else None)
    return work


def state(seq: Sequence) -> str:
    if seq.slot is None:  # waiting in the queue (new, or preempted)
        return QUEUED
    phase = seq.progress.phase
    if phase is None:  # admitted, its first step under way
        return PREFILLING if seq.in_prefill else DECODING
    return PREFILLING if phase == Phase.PREFILL else DECODING


def row(seq: Sequence) -> dict:
    """The request's progress as GET /v1/slots and the SSE progress events show it."""
    st, p = state(seq), seq.progress
    if st == QUEUED:
        done, total, rate = min(seq.processed, seq.prefill_len), seq.prefill_len, None
    elif st == DECODING:
        done, total, rate = p.total or seq.prefill_len, p.total or seq.prefill_len, None
    else:
        done, total, rate = p.done, p.total, p.rate
    return {"state": st, "prompt_done": done, "prompt_total": total,
            "prompt_tokens_per_s": None if rate is None else round(rate, 3)}


def counts(seqs: list[Sequence]) -> dict[str, int]:
    """How many of ``seqs`` are in each state (the /metrics gauge)."""
    out = dict.fromkeys(STATES, 0)
    for seq in seqs:
        out[state(seq)] += 1
    return out


def slot_status(slot: int, seq: Sequence | None) -> dict:
    """One slot's row of GET /v1/slots (``phase``: the older prefill/decode/idle field)."""
    base = {"slot": slot, "request_id": seq.req.request_id if seq else None,
            "phase": seq.phase if seq else "idle",
            "prompt_tokens": len(seq.prompt) if seq else 0,
            "processed": min(seq.processed, len(seq.prompt)) if seq else 0,
            "cached": seq.cached if seq else 0,
            "generated": len(seq.generated) if seq else 0}
    idle = {"state": "idle", "prompt_done": 0, "prompt_total": 0, "prompt_tokens_per_s": None}
    return base | (row(seq) if seq else idle)


def queue_status(position: int, seq: Sequence, now: float) -> dict:
    """One waiting request's row of GET /v1/slots (``queued``, in admission order)."""
    return {"position": position, "request_id": seq.req.request_id,
            "priority": seq.req.priority, "prompt_tokens": len(seq.prompt),
            "generated": len(seq.generated), "waited_s": round(now - seq.t_submit, 3)} | row(seq)


def push_event(seq: Sequence) -> None:
    """Push ``seq``'s progress to its handle when it asked for them (SSE include_progress)
    and it changed since the last one pushed."""
    if not seq.req.progress or seq.finished:
        return
    current = row(seq)
    if current != seq.progress_sent:
        seq.progress_sent = current
        seq.handle.push(RequestEvent([], "", progress=current))
