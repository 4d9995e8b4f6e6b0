"""Serving helper for the speculation tests: concurrent requests through the scheduler and the
real Runner, with the scheduler's own drafts or *oracle* drafts (the plain run's true
continuation, made wrong at one position in some steps, so verification meets hits and
misses)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from daemon.config import SpeculationSection
from daemon.request import GenerationRequest
from daemon.scheduler import Scheduler
from gpu_worker.runner import Runner
from protocol.messages import SamplingParams
from tests.harness import InProcessWorker, drain

Outputs = list[tuple[list[int], str | None]]


def oracle(plain: Outputs, vocab: int, length: Callable) -> Callable:
    """A ``Scheduler._drafts`` stand-in: ``length(seq)`` tokens of the plain continuation
    (never past max_tokens), one of them wrong when the generated count is 1 mod 3."""
    def drafts(seq) -> list[int]:
        i, g = int(seq.req.request_id[1:]), len(seq.generated)
        k = min(length(seq), seq.req.max_tokens - g - 1)
        d = list(plain[i][0][g:g + max(k, 0)])
        if d and g % 3 == 1:
            d[g % len(d)] = (d[g % len(d)] + 1) % vocab
        return d
    return drafts


def serve(model, prompts: list[list[int]], *, n: int | list[int], mode: str = "off",
          temperature: float = 0.0, slots: int | None = None, context: int = 256,
          drafts: Callable | None = None, metrics=None, speculation: list[bool] | None = None,
          setup: Callable | None = None, **spec) -> tuple[Outputs, InProcessWorker, Scheduler]:
    """Every prompt as one request (``n`` tokens each, or per request), all submitted at once;
    ``drafts`` replaces the scheduler's proposals; ``setup(sched)`` runs before serving."""
    slots = slots or len(prompts)
    runner = Runner(model, max_slots=slots, max_context=context, block_size=4, extra_blocks=64)
    sched = Scheduler(max_slots=slots, max_context=context, max_queue=16, prefill_chunk=16,
                      block_size=4, checkpoint_interval=8, prefix_blocks=64, metrics=metrics,
                      speculation=SpeculationSection(mode=mode, **spec))
    if drafts is not None:
        sched._drafts = drafts
    if setup is not None:
        setup(sched)
    worker = InProcessWorker(runner)
    sched.attach(worker)
    counts = n if isinstance(n, list) else [n] * len(prompts)
    allowed = speculation or [True] * len(prompts)
    handles = [sched.submit(GenerationRequest(
        f"r{i}", p, SamplingParams(temperature=temperature, seed=11 + i), counts[i], eos=False,
        speculation=allowed[i])) for i, p in enumerate(prompts)]
    return asyncio.run(drain(sched, handles)), worker, sched


def drafted(plan) -> list[int]:
    """Draft counts of a plan's slots, in plan order."""
    return [len(w.draft_ids) for w in plan.slots]


def passes(worker) -> list[int]:
    """Forward passes the Runner ran for each step that had work (not cache ops alone)."""
    return [r.counters["passes"] for p, r in zip(worker.plans, worker.results, strict=True)
            if p.slots]
