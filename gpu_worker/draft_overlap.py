"""Draft overlap (``[speculation] draft_overlap``, docs/speculation.md "Draft overlap"): the MTP
drafter of one forward pass runs while the CPU experts of the step's next pass are in flight.

What the head needs. Its first row for a slot is (the token sampled after the last committed
row, that row's final hidden state), and the hidden state is the output of the pass's last
layer, whose MoE block waits for its CPU experts. So nothing of a pass's drafter can start
before that pass has ended and been sampled. Within a step of several passes (narrow
speculation: one pass per drafted slot, one for the others) the drafter of pass i reads only
pass i's hidden rows, its sampled tokens and the head's KV rows of pass i's slots; pass i+1
touches none of those (other slots, the main model's layers). So the Runner defers the
drafter of pass i (:meth:`DraftOverlap.defer`, a generator of head passes,
``MtpDrafter.steps``) and runs it during pass i+1:

    host path (NumPy, or CuPy without a mappable ring): per MoE layer, between ringing the
        CPU workers and awaiting them (``CpuExpertPool.while_waiting``), one head pass;
    launched path (CuPy): after the pass is enqueued (the GPU waits for the workers in its
        own kernels) and before its stream is awaited, every deferred head pass, on a second
        stream that first waits for the pass the drafter reads;

and whatever is left after the step's last pass (:meth:`DraftOverlap.drain`). The head passes
are the same ones, on the same rows, in the same order as without overlap, so the drafts and
the tokens are the same bits whatever the dtype. A step of one pass (wide, solo, plain
batching) has no later pass to hide its drafter under.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from gpu_worker.mtp_drafter import Drafts, DraftSteps

T = TypeVar("T")
# tests: record(event) in the order things happen: "draft_deferred", "draft_unit_overlapped"
# (a head pass issued while CPU experts were in flight), "draft_unit_exposed" (after them),
# "draft_done" (a drafter's drafts handed back)
Recorder = Callable[[str], None]


def overlap_status(enabled: bool, model, experts) -> tuple[bool, str]:
    """Whether draft overlap runs for this model and placement, and why (the start-up log)."""
    if not enabled:
        return False, "speculation.draft_overlap = false"
    if getattr(model, "mtp", None) is None:
        return False, "the model has no MTP head: no drafter to overlap"
    if experts is None or getattr(experts, "pool", None) is None:
        return False, "every routed expert is on the backend: no CPU experts to overlap with"
    path = "launched (a second CUDA stream)" if getattr(experts, "launched", False) else "host"
    return True, (f"{path} path: a pass's MTP drafter runs while the CPU experts of the step's "
                  "next pass are in flight (narrow steps of several passes); a one-pass step "
                  "(wide, solo, plain) has nothing to hide it under")


@dataclasses.dataclass
class _Job:
    steps: DraftSteps
    done: Callable[[Drafts], None]  # gets the drafts when the last unit has run
    ready: Any  # CuPy: an event after the pass the drafter reads; NumPy: None


class DraftOverlap:
    """The deferred drafters of the current step (FIFO) and the hooks that run them.
    ``experts``: an ExpertPlacement (its ``pool`` and ``launched``); ``xp``: the backend."""

    def __init__(self, experts, xp, record: Recorder | None = None) -> None:
        self.experts, self.xp, self.record = experts, xp, record
        self.jobs: collections.deque[_Job] = collections.deque()
        self._stream = None  # CuPy: the drafter's stream, made at first use
        self._stats = dict.fromkeys(("ms", "overlapped_ms", "units", "units_overlapped"), 0.0)

    @property
    def cupy(self) -> bool:
        return self.xp.__name__ == "cupy"

    def defer(self, steps: DraftSteps, done: Callable[[Drafts], None]) -> None:
        """Queue a pass's drafter, right after that pass was sampled."""
        ready = None
        if self.cupy:  # the drafter's stream starts after everything issued so far
            ready = self.xp.cuda.Event()
            ready.record()
        self.jobs.append(_Job(steps, done, ready))
        self._note("draft_deferred")

    def run_pass(self, forward: Callable[[], T]) -> T:
        """``experts.run_step(forward)`` with the deferred drafters' head passes running while
        this pass's CPU experts are in flight."""
        experts = self.experts
        if not self.jobs:
            return experts.run_step(forward)
        if experts.launched:
            def enqueue_then_draft() -> T:
                out = forward()  # every layer enqueued: the GPU rings the workers, waits
                self._run(overlapped=True)
                return out

            return experts.run_step(enqueue_then_draft)
        pool = experts.pool
        pool.while_waiting = lambda: self._run(overlapped=True, limit=1)
        try:
            return experts.run_step(forward)
        finally:
            pool.while_waiting = None

    def drain(self) -> None:
        """Run what is left (after the step's last pass: nothing to hide it under)."""
        self._run(overlapped=False)

    def discard(self) -> None:
        """Drop the queued drafters (a failed step: its results are void)."""
        self.jobs.clear()

    def take_stats(self) -> tuple[dict[str, float], dict[str, int]]:
        """Since the last call (one step): timings ``draft`` (ms of drafter work, host wall
        time) and ``draft_overlapped`` (the part run while CPU experts were in flight);
        counters ``draft_units`` and ``draft_units_overlapped`` (head passes issued)."""
        s = self._stats
        out = ({"draft": s["ms"], "draft_overlapped": s["overlapped_ms"]},
               {"draft_units": int(s["units"]),
                "draft_units_overlapped": int(s["units_overlapped"])})
        self._stats = dict.fromkeys(s, 0.0)
        return out

    # ------------------------------------------------------------------------------------

    def _run(self, overlapped: bool, limit: int | None = None) -> None:
        """Up to ``limit`` head passes (None: all) of the queued drafters, oldest first."""
        passes = 0
        while self.jobs and (limit is None or passes < limit):
            job = self.jobs[0]
            t0 = time.perf_counter()
            drafts = None
            with self._on_stream(job):
                try:
                    next(job.steps)  # issues one head pass, or finishes the drafts
                except StopIteration as stop:
                    drafts = stop.value
            s = self._stats
            ms = (time.perf_counter() - t0) * 1e3
            s["ms"] += ms
            s["overlapped_ms"] += ms if overlapped else 0.0
            if drafts is not None:
                self.jobs.popleft()
                self._note("draft_done")
                job.done(drafts)
                continue
            passes += 1
            s["units"] += 1
            s["units_overlapped"] += overlapped
            self._note("draft_unit_overlapped" if overlapped else "draft_unit_exposed")

    @contextlib.contextmanager
    def _on_stream(self, job: _Job) -> Iterator[None]:
        """CuPy: the unit on the drafter's own stream, after the pass it reads; the current
        stream then waits for it (later passes and steps see the head's KV rows)."""
        if not self.cupy:
            yield
            return
        cp = self.xp
        if self._stream is None:
            self._stream = cp.cuda.Stream(non_blocking=True)
        main = cp.cuda.get_current_stream()
        self._stream.wait_event(job.ready)
        with self._stream:
            yield
        done = cp.cuda.Event()
        done.record(self._stream)
        main.wait_event(done)

    def _note(self, event: str) -> None:
        if self.record is not None:
            self.record(event)
