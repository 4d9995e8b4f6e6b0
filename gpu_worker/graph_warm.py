"""Start-up capture of the CUDA graphs a server replays (``Runner.warm_graphs``).

A graph is kept per layout (step_graph.layout_key): a pass's rows and slots (and so its
drafts in all), whatever the split of the rows among the slots. :func:`layouts` gives one
pass of each layout the daemon's passes can have for the speculation settings, as each
slot's drafts; :func:`warm` runs each twice on scratch slots (the first pass eager, which
compiles its kernels; the second captured and replayed), so that serving never waits for
a layout's first pass or its capture.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from gpu_worker.graph_buckets import shape_key
from protocol.messages import (
    CacheOp,
    CacheOpKind,
    DraftSource,
    SamplingParams,
    SlotWork,
    StepPlan,
    WorkKind,
)
from protocol.worker_config import MAX_WIDE_SLOTS, WIDE_CAPACITIES

MAX_WARM_LAYOUTS = 160  # verify layouts captured at start-up at most (fewer slots first)


def layouts(max_slots: int, max_drafts: int, mode: str, *,
            limit: int = MAX_WARM_LAYOUTS) -> list[tuple[int, ...]]:
    """One pass of each layout a server's decode and verify passes can have, as each slot's
    drafts, more first: the decode layouts (1 to ``max_slots`` slots without drafts), then

    * ``wide`` (or one slot): for 1 to ``max_slots`` slots every total of drafts that 1 to
      ``MAX_WIDE_SLOTS`` drafted slots of at most ``max_drafts`` each can make within
      ``WIDE_CAPACITIES[-1]`` rows (daemon/draft_plan.py fits every wide pass so), spread
      evenly over the drafted slots;
    * ``narrow``: a drafted slot alone (its own pass; the other slots' pass is a decode
      layout);

    at most ``limit`` verify layouts (fewer slots first)."""
    out = [(0,) * n for n in range(1, max_slots + 1)]
    if mode == "off" or max_drafts <= 0:
        return out
    if mode == "narrow" or max_slots == 1:
        return out + [(d,) for d in range(max_drafts, 0, -1)][:limit]
    verify = []
    for n in range(1, max_slots + 1):
        k = min(n, MAX_WIDE_SLOTS)  # drafted slots at most
        for total in range(1, min(k * max_drafts, WIDE_CAPACITIES[-1] - n) + 1):
            base, extra = divmod(total, k)
            verify.append(tuple([base + 1] * extra + [base] * (k - extra) + [0] * (n - k)))
    return out + verify[:limit]


def one_per_bucket(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The first of ``shapes`` (:func:`layouts`) of each graph with capacity buckets
    (graph_buckets.shape_key: a bucket's passes share one)."""
    seen, out = set(), []
    for shape in shapes:
        key = shape_key(len(shape) + sum(shape), len(shape))
        if key not in seen:
            seen.add(key)
            out.append(shape)
    return out


def warm(runner: Any, shapes: list[tuple[int, ...]]) -> dict[str, float]:
    """Run each layout of ``shapes`` (:func:`layouts`) twice on scratch slots 0..n-1 of
    ``runner`` (a gpu_worker.runner.Runner with graphs, holding no slot): one prompt token
    each, then decode passes with zero-valued drafts, greedy; a slot whose next pass would
    pass the context limit starts again. The slots are freed after. Returns the graphs
    captured, the layouts refused (they stay eager), the layouts tried and the seconds it
    took."""
    graphs = runner.graphs
    t0, step = time.perf_counter(), 0
    greedy = SamplingParams(temperature=0.0, seed=0)
    before = dict(graphs.totals)
    need = max((len(s) for s in shapes), default=0)
    longest = 1 + max((max(s) for s in shapes), default=0)

    def run(slots: list[SlotWork], ops: list[CacheOp] | None = None) -> None:
        nonlocal step
        step -= 1  # negative ids: never a daemon's
        runner.execute(StepPlan(step_id=step, slots=slots, cache_ops=ops or []))

    def start(s: int) -> None:
        ops = [CacheOp(op=CacheOpKind.FREE, slot=s)] if s in runner.lengths else []
        run([SlotWork(slot=s, request_id="warm-up", kind=WorkKind.PREFILL,
                      input_ids=np.zeros(1, np.int32), start_pos=0, num_tokens=1,
                      prompt_len=1, needs_logits=True, sampling=greedy)],
            ops + [CacheOp(op=CacheOpKind.ALLOCATE, slot=s)])

    def work(s: int, drafts: int) -> SlotWork:
        return SlotWork(slot=s, request_id="warm-up", kind=WorkKind.DECODE,
                        input_ids=np.zeros(1, np.int32), start_pos=runner.lengths[s],
                        num_tokens=1, prompt_len=1, needs_logits=True, sampling=greedy,
                        draft_ids=np.zeros(drafts, np.int32),
                        draft_sources=np.full(drafts, DraftSource.MTP, np.uint8))

    try:
        for s in range(need):
            start(s)
        for shape in shapes:
            for _ in range(2):
                for s in range(len(shape)):
                    if runner.lengths[s] + longest > runner.max_context:
                        start(s)
                run([work(s, d) for s, d in enumerate(shape)])
    finally:
        for s in list(runner.lengths):
            runner.cache_ops.apply(CacheOp(op=CacheOpKind.FREE, slot=s))
    after = graphs.totals
    return {"graphs": after["graph_captures"] - before["graph_captures"],
            "refused": after["graph_refused"] - before["graph_refused"],
            "layouts": len(shapes), "seconds": time.perf_counter() - t0}
