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

from gpu_worker.graph_buckets import GRAPH_BUCKETS, bucket, shape_key
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.mtp_drafter import HeadWork, run_all
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
            verify.append(_spread(total, k) + (0,) * (n - k))
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
        _free_all(runner)
    return _counts(graphs.totals, before, "graph_", len(shapes), t0)


def _free_all(runner: Any) -> None:
    """Every slot the warm-up took, free again (its KV blocks back)."""
    for s in list(runner.lengths):
        runner.cache_ops.apply(CacheOp(op=CacheOpKind.FREE, slot=s))


def _counts(after: dict, before: dict, prefix: str, layouts: int, t0: float
            ) -> dict[str, float]:
    """A warm-up's result: graphs captured and layouts refused (``prefix``'s counters since
    ``before``), layouts tried, seconds since ``t0``."""
    return {"graphs": after[f"{prefix}captures"] - before[f"{prefix}captures"],
            "refused": after[f"{prefix}refused"] - before[f"{prefix}refused"],
            "layouts": layouts, "seconds": time.perf_counter() - t0}


def mtp_layouts(max_slots: int, drafts: int, mode: str, buckets: bool
                ) -> list[tuple[int, ...]]:
    """One head pass of each MTP drafting graph (gpu_worker/mtp_graph.py) the daemon's steps
    can make, as each slot's committed rows: a pass's slots commit 1 + its accepted drafts
    each; ``wide``: 1 to ``max_slots`` slots, every total of rows up to the largest bucket;
    ``narrow``: a drafted slot alone (1 to 1 + ``drafts`` rows) and the undrafted slots of
    one row each. With ``buckets`` one per capacity bucket (the first pass is padded to it)."""
    if drafts <= 0:
        return []
    top = GRAPH_BUCKETS[-1]
    wanted = [(n,) for n in range(1, min(drafts + 1, top) + 1)] + [
        (1,) * n for n in range(2, max_slots + 1)]
    if mode != "narrow":
        wanted += [_spread(total, n) for n in range(2, max_slots + 1)
                   for total in range(n + 1, min(n * (1 + drafts), top) + 1)]
    seen, out = set(), []
    for rows in wanted:
        key = (bucket(sum(rows)) if buckets else sum(rows), len(rows))
        if key not in seen:
            seen.add(key)
            out.append(rows)
    return out


def _spread(total: int, n: int) -> tuple[int, ...]:
    """``total`` spread as evenly as it goes over ``n`` slots, the larger parts first."""
    base, extra = divmod(total, n)
    return tuple([base + 1] * extra + [base] * (n - extra))


def warm_mtp(runner: Any, drafts: int) -> dict[str, float]:
    """Capture the MTP drafting graphs of :func:`mtp_layouts`: each head pass runs eagerly
    once (it compiles its kernels), then through its graph, on scratch slots 0..n-1 (their
    KV blocks freed after) from zero hidden rows. Returns what :func:`warm` returns."""
    graphs, t0 = runner.graphs, time.perf_counter()
    before = dict(graphs.totals)
    shapes = mtp_layouts(runner.max_slots, drafts, runner.speculation_mode,
                         graphs.scratch is not None)
    shapes = [s for s in shapes if 1 + max(s) + drafts < runner.max_context]
    xp, width = runner.model.xp, runner.model.cfg.hidden_size
    try:
        for rows in shapes:
            for s in range(len(rows)):
                runner.cache_ops.apply(CacheOp(op=CacheOpKind.ALLOCATE, slot=s))
            batch = RaggedBatch.build([(s, 1, np.zeros(r, np.int64)) for s, r in
                                       enumerate(rows)])
            last = {seg.slot: seg.row0 + seg.num - 1 for seg in batch.segments}
            head = HeadWork(batch, xp.zeros((batch.num_rows, width), np.float32),
                            np.array([last[s] for s in range(len(rows))], np.int64),
                            list(range(len(rows))), {s: drafts for s in range(len(rows))},
                            {s: r for s, r in enumerate(rows)}, {s: s for s in range(len(rows))})
            for _ in range(2):  # the first eager (seen), the second captured and replayed
                if graphs.mtp.run(head) is None:
                    run_all(runner.drafter.run(head))
    finally:
        _free_all(runner)
    return _counts(graphs.totals, before, "mtp_graph_", len(shapes), t0)
