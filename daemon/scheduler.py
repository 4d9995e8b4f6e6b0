"""Continuous batching: admission, slots, chunked prefill, preemption, prefix reuse.

The step loop is plan -> run on the worker -> commit -> emit. Planning and committing are
bookkeeping over plain data; only ``run`` awaits the worker.

Cache ops wait in one list, ``_ops``: whatever frees, swaps or drops worker state appends to
it, and the next plan takes it whole. The plan's ``cache_ops_after`` are the checkpoints of
this step's prefill chunks, built with the plan (the worker takes them after the forward).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import structlog

from daemon import progress
from daemon.draft_plan import DraftPlanner, overlapped
from daemon.metrics import Metrics, NullMetrics
from daemon.prefix_cache import PrefixCache
from daemon.progress import queue_status, slot_status
from daemon.proposers.replay import ReplayRecorder
from daemon.request import (
    EngineUnavailable,
    GenerationRequest,
    QueueFull,
    RequestHandle,
    RequestRejected,
)
from daemon.sequence import Sequence
from daemon.step_commit import commit_step
from daemon.step_trace import StepTrace
from daemon.worker_client import WorkerDied, WorkerStepError
from protocol.messages import (
    CacheOp,
    CacheOpKind,
    DraftSource,
    SlotWork,
    StepPlan,
    StepResult,
    WorkKind,
    token_array,
    vocab_error,
)

if TYPE_CHECKING:
    from daemon.config import SpeculationSection
    from daemon.tokenizer import Tokenizer

log = structlog.get_logger("tandem.scheduler")
OP = CacheOpKind


class StepWorker(Protocol):
    """What the scheduler runs its plans on: the GPU worker process
    (daemon.worker_client.WorkerProcess) or, in tests, the Runner in-process."""

    async def step(self, plan: StepPlan) -> StepResult: ...


class Scheduler:
    """Admission, slots and the step loop of one worker; the front ends submit and cancel."""

    def __init__(self, *, max_slots: int, max_context: int, max_queue: int, prefill_chunk: int,
                 block_size: int, checkpoint_interval: int, prefix_blocks: int,
                 tokenizer: Tokenizer | None = None, eos_ids: Iterable[int] = (),
                 metrics: Metrics | None = None, model_name: str = "",
                 preemption: str = "swap", speculation: SpeculationSection | None = None,
                 backend: str = "numpy", placement: str = "gpu") -> None:
        if preemption not in ("swap", "recompute"):
            raise ValueError(f"preemption must be swap or recompute, got {preemption!r}")
        self.recorder = ReplayRecorder.of(speculation)  # benchmarks only: record_file
        self.trace = StepTrace.of(speculation)  # benchmarks only: step_trace_file
        self.speculation = speculation if speculation is not None and \
            speculation.mode != "off" else None
        mtp = self.speculation is not None and self.speculation.proposer == "mtp"
        self._mtp_drafts = self.speculation.num_drafts if mtp else 0  # asked of the worker
        self._source = DraftSource.MTP if mtp else DraftSource.SUFFIX
        # eligibility (logged), the global suffix index, each step's draft budget
        self.draft_plan = DraftPlanner(self.speculation, max_slots=max_slots, backend=backend,
                                       placement=placement)
        self.preemption = preemption
        self.max_slots, self.max_context, self.max_queue = max_slots, max_context, max_queue
        self.prefill_chunk = prefill_chunk
        self.checkpoint_interval = checkpoint_interval
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.vocab_size: int | None = None  # the worker's (READY); prompt ids must be below
        self.metrics: Metrics | NullMetrics = metrics if metrics is not None else NullMetrics()
        self.prefix = PrefixCache(prefix_blocks, block_size) if prefix_blocks else None
        # the worker's model routes by SlotWork.route_key (READY: ModelInfo.synthetic_routing):
        # prefix states are then shared only between requests of one routing key
        self.route_keyed = False
        self.worker: StepWorker | None = None  # set by attach()
        self.slots: list[Sequence | None] = [None] * max_slots
        self.queue: list[tuple[int, int, Sequence]] = []  # heap of (-priority, order, seq)
        self.by_id: dict[str, Sequence] = {}
        self._order = 0
        self._step_id = 0
        self._entry_id = 0
        self._ops: list[CacheOp] = []  # cache ops for the next plan
        self._wake = asyncio.Event()

    # ---- front-end interface -----------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.worker is not None

    def submit(self, req: GenerationRequest) -> RequestHandle:
        if not self.ready:
            raise EngineUnavailable("the model worker is not ready")
        if not req.prompt_ids:
            raise RequestRejected("the prompt is empty")
        bad_ids = vocab_error(req.prompt_ids, self.vocab_size)
        if bad_ids is not None:  # the worker would fail on it: refuse it here, whoever sent it
            raise RequestRejected(bad_ids)
        total = len(req.prompt_ids) + req.max_tokens
        if total > self.max_context:
            raise RequestRejected(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens "
                                  f"({req.max_tokens}) = {total} exceeds the context limit "
                                  f"{self.max_context}")
        if req.request_id in self.by_id:
            raise RequestRejected(f"request id {req.request_id!r} is already in use")
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"the queue holds {len(self.queue)} requests", retry_after=1.0)
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        handle = RequestHandle(req.request_id, self.cancel)
        seq = Sequence(req, handle, req.sampling.seed, detok, self.eos_ids, self._order)
        self._order += 1
        self.by_id[req.request_id] = seq
        heapq.heappush(self.queue, (-req.priority, seq.order, seq))
        progress.push_event(seq)  # "queued" first (a client that asked for progress events)
        self._changed()
        return handle

    def cancel(self, request_id: str) -> bool:
        seq = self.by_id.get(request_id)
        if seq is None or seq.finished:
            return False
        seq.cancel_requested = True
        self._wake.set()
        return True

    def snapshot(self) -> dict:
        """What every slot is doing and who waits for one, in admission order (GET /v1/slots)."""
        slots = [slot_status(i, seq) for i, seq in enumerate(self.slots)]
        now, waiting = time.monotonic(), sorted(self.queue, key=lambda e: e[:2])
        queued = [queue_status(i, e[2], now) for i, e in enumerate(waiting)]
        return {"ready": self.ready, "queue_depth": len(self.queue), "slots": slots,
                "queued": queued}

    # ---- the step loop -------------------------------------------------------------------
    def attach(self, worker: StepWorker) -> None:
        self.worker = worker
        self._wake.set()

    def detach(self, error: str) -> None:
        """The worker died: fail every request that had state there; keep the queue."""
        self.worker = None
        for i, seq in enumerate(self.slots):
            if seq is not None:
                self._finish(seq, "error", error)
                self.slots[i] = None
        for _, _, seq in list(self.queue):
            if seq.swapped_entry is not None:
                self.queue.remove((-seq.req.priority, seq.order, seq))
                self._finish(seq, "error", error)
        heapq.heapify(self.queue)
        self._ops.clear()
        self.prefix = self.prefix.emptied() if self.prefix else None
        self._changed()  # the gauges: nothing runs now

    async def run(self) -> None:
        """Plan, run, commit until cancelled; returns when the worker dies or is broken (any
        unexpected error of the worker link), for the supervisor to restart it. A fault in
        one request's data fails that request only; one of a whole step, its requests."""
        while self.worker is not None:
            t_plan = time.monotonic()
            try:
                plan = self.plan()
            except Exception:  # a bug of ours that no single request explains
                log.exception("planning failed")
                self._fail_plan(None, "internal error while planning the step")
                continue
            if not plan.slots and not plan.cache_ops:
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.monotonic()
            try:
                result = await overlapped(self.worker.step(plan), self.draft_plan.between_steps)
            except WorkerStepError as exc:
                log.error("step refused", step=plan.step_id, error=str(exc))
                self._fail_plan(plan, str(exc))
                continue
            except WorkerDied as exc:
                log.error("gpu worker died", error=str(exc))
                self.detach(f"the model worker died: {exc}")
                return
            except Exception as exc:
                log.exception("gpu worker link broken", step=plan.step_id)
                self.detach(f"the model worker failed: {type(exc).__name__}: {exc}")
                return
            try:
                self.commit(plan, result, time.monotonic() - t0, t_plan)
            except Exception:
                log.exception("commit failed", step=plan.step_id)
                self._fail_plan(plan, "internal error while committing the step")

    def plan(self) -> StepPlan:
        """The next step: cancellations, preemption, admission (cache ops), each slot's work."""
        for entry in [e for e in self.queue if e[2].cancel_requested]:
            self.queue.remove(entry)
            heapq.heapify(self.queue)
            self._finish(entry[2], "cancelled", drop_entry=True)
        for i, seq in enumerate(self.slots):
            if seq is not None and seq.cancel_requested:
                self._finish(seq, "cancelled")
                self._release(i)
        self._preempt_for_priority()
        self._admit()
        # NOTE: taken before the work is built: a checkpoint's evictions wait for the next
        # plan, after this plan's checkpoints (which they may name) exist on the worker
        ops, self._ops = self._ops, []
        after: list[CacheOp] = []
        work = []
        for slot, seq in enumerate(self.slots):
            if seq is None:
                continue
            try:
                work.append(self._work_for(slot, seq, after))
            except Exception as exc:  # this request's data is bad: it alone fails
                self._fail_request(slot, seq, exc)
        self._step_id += 1
        work, wide = self.draft_plan.fit(work)  # wide: one pass; narrow: one per drafted slot
        return StepPlan(step_id=self._step_id, slots=work, cache_ops=ops, cache_ops_after=after,
                        wide=wide, slot_routing=self.draft_plan.routes_wanted)

    def commit(self, plan: StepPlan, result: StepResult, seconds: float,
               t_plan: float | None = None) -> None:
        """Apply a step's results (daemon.step_commit: its arguments)."""
        commit_step(self, plan, result, seconds, t_plan)

    # ---- planning pieces -----------------------------------------------------------------
    def _work_for(self, slot: int, seq: Sequence, after: list[CacheOp]) -> SlotWork:
        sampling = dataclasses.replace(seq.req.sampling, seed=seq.seed)
        common = dict(slot=slot, request_id=seq.req.request_id, sampling=sampling,
                      prompt_len=len(seq.prompt), cached_len=seq.cached,
                      mtp_drafts=self._mtp_drafts if seq.req.speculation else 0,
                      route_key=seq.user_key)
        if not seq.in_prefill:
            drafts = self._drafts(seq)
            return SlotWork(kind=WorkKind.DECODE, start_pos=seq.processed, num_tokens=1,
                            input_ids=token_array([seq.token_at(seq.processed)]),
                            needs_logits=True, draft_ids=token_array(drafts),
                            draft_sources=np.full(len(drafts), seq.draft_source
                                                  or self._source, np.uint8),
                            **common)
        start, target = seq.processed, seq.prefill_len
        common["prompt_len"] = target
        end = min(start + self.prefill_chunk, target)
        if self.prefix is not None:  # chunks end on checkpoint boundaries
            boundary = (start // self.checkpoint_interval + 1) * self.checkpoint_interval
            end = min(end, boundary)
            turn = seq.req.history_len  # where the chat's next turn leaves this prompt
            end = turn if turn is not None and start < turn < end else end
            if (end % self.checkpoint_interval == 0 or end in (target, turn)) and \
                    self._shareable(slot, seq):
                # past a turn's end the prompt serves only its repeats: weak (never supersedes)
                self._checkpoint(slot, seq.tokens(0, end), after, self._space(slot, seq),
                                 weak=end == target and turn is not None)
        return SlotWork(kind=WorkKind.PREFILL, start_pos=start, num_tokens=end - start,
                        input_ids=token_array(seq.tokens(start, end)),
                        needs_logits=end == target, **common)

    def _drafts(self, seq: Sequence) -> list[int]:
        """Draft tokens to verify after ``seq``'s next decode row (tests swap in an oracle)."""
        return self.draft_plan.propose(seq, self.max_context)

    def _shareable(self, slot: int, seq: Sequence) -> bool:
        # NOTE: a synthetic model's request without a user, swapped back in to another slot,
        # holds states of two slots' routing: no space is theirs to share
        return not self.route_keyed or seq.user_key is not None or seq.state_slot == slot

    def _space(self, slot: int, seq: Sequence) -> int | None:
        """The prefix cache's space of ``seq`` in ``slot`` (daemon/prefix_cache.py)."""
        return seq.route_key(slot) if self.route_keyed else None

    def _checkpoint(self, slot: int, tokens: list[int], after: list[CacheOp],
                    space: int | None, weak: bool = False) -> None:
        if self.prefix.contains(tokens, space) or not self.prefix.admits(len(tokens), weak):
            return
        entry = self._new_entry()
        after.append(CacheOp(op=OP.CHECKPOINT, slot=slot, num_tokens=len(tokens),
                             entry_id=entry))
        dropped = self.prefix.add(tokens, entry, space, weak=weak)
        # entries moved to the host tier first: one dropped from it now was offloaded before
        self._ops += [CacheOp(op=OP.OFFLOAD, entry_id=e) for e in self.prefix.take_offloads()]
        self._ops += [CacheOp(op=OP.DROP_CHECKPOINT, entry_id=e) for e in dropped]

    def _admit(self) -> None:
        while self.queue and None in self.slots:
            _, _, seq = heapq.heappop(self.queue)
            if seq.cancel_requested:
                self._finish(seq, "cancelled", drop_entry=True)
                continue
            slot = self.slots.index(None)
            self.slots[slot] = seq
            seq.slot = slot
            if seq.swapped_entry is not None:
                self._ops.append(CacheOp(op=OP.SWAP_IN, slot=slot, entry_id=seq.swapped_entry))
                seq.swapped_entry = None
                progress.admitted(seq)
                continue
            self._ops.append(CacheOp(op=OP.ALLOCATE, slot=slot, num_tokens=len(seq.prompt)))
            seq.state_slot = slot
            hit = (self.prefix.lookup(seq.tokens(0, seq.prefill_len), self._space(slot, seq))
                   if self.prefix is not None else None)
            if hit is not None:
                entry, n = hit
                self._ops.append(CacheOp(op=OP.SHARE_PREFIX, slot=slot, entry_id=entry,
                                         num_tokens=n))
                seq.processed = n
                seq.cached = max(seq.cached, min(n, len(seq.prompt)))
            progress.admitted(seq)

    def _preempt_for_priority(self) -> None:
        """Swap out the lowest-priority running request when a higher one waits."""
        while self.queue and None not in self.slots:
            top = -self.queue[0][0]
            running = [(s.req.priority, -s.order, i) for i, s in enumerate(self.slots)]
            prio, _, victim_slot = min(running)
            if prio >= top:
                return
            victim = self.slots[victim_slot]
            if self.preemption == "swap":
                victim.swapped_entry = self._new_entry()
                self._ops.append(CacheOp(op=OP.SWAP_OUT, slot=victim_slot,
                                         entry_id=victim.swapped_entry))
            else:  # drop its caches; it re-prefills everything it has when readmitted
                victim.recompute, victim.processed = True, 0
                self._ops.append(CacheOp(op=OP.FREE, slot=victim_slot))
            self.slots[victim_slot] = None
            victim.slot = None
            heapq.heappush(self.queue, (-victim.req.priority, victim.order, victim))
            log.info("preempted", request_id=victim.req.request_id, slot=victim_slot,
                     mode=self.preemption)

    # ---- endings ---------------------------------------------------------------------------
    def _release(self, slot: int) -> None:
        self.slots[slot] = None
        self._ops.append(CacheOp(op=OP.FREE, slot=slot))
        self._changed()

    def _finish(self, seq: Sequence, reason: str, error: str | None = None,
                drop_entry: bool = False) -> None:
        if drop_entry and seq.swapped_entry is not None:
            self._ops.append(CacheOp(op=OP.DROP_CHECKPOINT, entry_id=seq.swapped_entry))
            seq.swapped_entry = None
        seq.handle.push(seq.finish(reason, error))
        self._done(seq)

    def _done(self, seq: Sequence) -> None:
        self.by_id.pop(seq.req.request_id, None)
        if self.recorder is not None:
            self.recorder.add(seq)
        self.metrics.request_finished(seq.finished, len(seq.prompt), len(seq.generated),
                                      seq.cached)

    def _fail_plan(self, plan: StepPlan | None, error: str) -> None:
        """Fail the plan's requests (None: every running request)."""
        for slot in [w.slot for w in plan.slots] if plan else range(self.max_slots):
            seq = self.slots[slot]
            if seq is not None:
                self._finish(seq, "error", error)
                self._release(slot)

    def _fail_request(self, slot: int, seq: Sequence, exc: Exception) -> None:
        log.error("request failed", request_id=seq.req.request_id, error=repr(exc),
                  exc_info=exc)
        self._finish(seq, "error", f"internal error: {type(exc).__name__}: {exc}")
        self._release(slot)

    def _new_entry(self) -> int:
        self._entry_id += 1
        return self._entry_id

    def _changed(self) -> None:
        self._wake.set()
        self.metrics.set_queue_depth(len(self.queue))
        waiting = [e[2] for e in self.queue]
        self.metrics.set_request_states(
            progress.counts([s for s in self.slots if s is not None] + waiting))
