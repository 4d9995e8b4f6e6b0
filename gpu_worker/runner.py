"""Executes one StepPlan: cache commands, one ragged forward over every slot's rows (or, for
narrow speculation, one per drafted slot and one for the rest), sampling and draft
verification, the MTP head's drafts, then the after-step cache commands. Pure in-process;
server.py wraps it.

    Runner.execute -> CacheOps.apply (cache_ops.py) -> passes: Model.forward (with the
        RoutedExperts, routed_experts.py) -> sample_and_match_all (verify.py) -> RecurrentStates
        adopt (states.py) -> MtpDrafter.draft (mtp_drafter.py; with draft overlap, under the
        next pass's CPU experts: draft_overlap.py)
"""

from __future__ import annotations

import contextlib
import functools
import time

import numpy as np

from gpu_worker import graph_warm
from gpu_worker.cache_ops import CacheOps, PlanError
from gpu_worker.draft_overlap import DraftOverlap, overlap_status
from gpu_worker.graph_buckets import MAX_PAD
from gpu_worker.graph_warm import MAX_WARM_LAYOUTS
from gpu_worker.kv_cache import KVCache
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Caches, Model
from gpu_worker.mtp_drafter import MtpDrafter, run_all
from gpu_worker.routed_experts import RoutedExperts
from gpu_worker.step_graph import MAX_GRAPHS, StepGraphs, graphs_status
from gpu_worker.step_graph import takes as graph_takes
from gpu_worker.verify import sample_and_match_all
from protocol.messages import (
    Phase,
    PromptPhase,
    SlotResult,
    SlotWork,
    StepPlan,
    StepResult,
    WorkKind,
)

__all__ = ["PlanError", "Runner"]
_NO_ROUTES = (np.zeros(0, np.int32), np.zeros(0, np.uint16))


class Runner:
    """The model, its caches and the interpreter of their commands, behind ``execute``.
    ``max_drafts`` and ``speculation_mode``: what the daemon's verify passes can hold
    (the graphs' shared buffers are made that big once; ``graph_warm_up`` "all" captures
    their layouts in :meth:`warm_graphs`).
    ``experts``: the routed experts that are not all on the backend (None: all are);
    ``slot_routing``: report each decode slot's CPU experts (SlotResult.cpu_experts);
    ``draft_overlap``: run a pass's MTP drafter under the next pass's CPU experts where it
    can (``overlap_reason`` says whether and why, draft_overlap.py); ``cuda_graphs``: decode
    and verify passes through CUDA graphs where they can (``graphs_reason``, step_graph.py)."""

    def __init__(self, model: Model, *, max_slots: int, max_context: int, block_size: int = 16,
                 extra_blocks: int = 0, kv_int8: bool = False,
                 experts: RoutedExperts | None = None, slot_routing: bool = False,
                 draft_overlap: bool = False, cuda_graphs: bool = False, max_drafts: int = 0,
                 speculation_mode: str = "off", graph_warm_up: str = "all",
                 graph_buckets: bool = True, mtp_drafts: int = 0,
                 graph_mtp: bool = True) -> None:
        self.model = model
        self.slot_routing = slot_routing and experts is not None
        self.max_slots = max_slots
        self.max_context = max_context
        self.max_drafts = max_drafts
        self.speculation_mode = speculation_mode
        self.graph_warm_up = graph_warm_up
        self.mtp_drafts = mtp_drafts  # the daemon's MTP drafts per slot (0: none asked)
        self.experts = experts
        overlap, self.overlap_reason = overlap_status(draft_overlap, model, experts)
        self.overlap = DraftOverlap(experts, model.xp) if overlap else None
        active, self.graphs_reason = graphs_status(cuda_graphs, model, experts)
        if active and self.overlap is not None:
            active, self.graphs_reason = False, "draft overlap keeps the passes eager"
        # capacity buckets: the padding rows' scratch slot, after the daemon's (KV blocks
        # of its own, no GDN state: gpu_worker/graph_buckets.py)
        scratch = max_slots if active and graph_buckets else None
        # extra_blocks: room for prefix checkpoints beyond every slot's own blocks
        caches = model.new_caches(
            max_slots, max_context, block_size,
            extra_blocks + (0 if scratch is None else -(-MAX_PAD // block_size)),
            kv_int8=kv_int8)
        self.drafter = MtpDrafter(model, caches, max_context)
        self.cache_ops = CacheOps(caches, max_slots, on_release=self.drafter.forget)
        self.num_passes = 0  # forward passes run so far (tests count them)
        self.graphs = (StepGraphs(model, self.caches, max_slots=max_slots,
                                  max_context=max_context, experts=experts,
                                  max_drafts=max_drafts, wide=speculation_mode != "narrow",
                                  max_graphs=max(MAX_GRAPHS, max_slots + MAX_WARM_LAYOUTS),
                                  scratch=scratch)
                       if active else None)
        if self.graphs is not None:  # the MTP head's drafting as one graph (mtp_graph.py)
            self.graphs.mtp.enabled = graph_mtp

    @property
    def caches(self) -> Caches:
        return self.cache_ops.caches

    @property
    def kv(self) -> KVCache:
        return self.cache_ops.kv

    @property
    def lengths(self) -> dict[int, int]:
        """Tokens in each allocated slot's cache."""
        return self.cache_ops.lengths

    def warm_graphs(self) -> dict[str, float]:
        """Before serving: capture the layouts the daemon's passes can have
        (graph_warm.layouts: the decode layouts, 1 to ``max_slots`` slots of one row, and with
        ``graph_warm_up = "all"`` every verify layout of the speculation settings), so that
        serving never runs a layout's eager first pass or its capture while requests wait.
        Each layout runs twice on scratch slots, freed after; with ``mtp_drafts`` (and
        "all") also the MTP drafting graphs (graph_warm.warm_mtp). Returns the graphs
        captured, the layouts refused and tried, and the seconds it took."""
        if self.graphs is None or self.lengths:
            return {"graphs": 0, "refused": 0, "layouts": 0, "seconds": 0.0}
        drafts = self.max_drafts if self.graph_warm_up == "all" else 0
        shapes = graph_warm.layouts(self.max_slots, drafts, self.speculation_mode)
        if self.graphs.scratch is not None:  # one pass of each capacity bucket
            shapes = graph_warm.one_per_bucket(shapes)
        # a scratch slot holds one prompt token, then a pass's rows
        out = graph_warm.warm(self, [s for s in shapes if 2 + max(s) <= self.max_context])
        if drafts and self.mtp_drafts and self.model.mtp is not None and self.graphs.mtp.enabled:
            more = graph_warm.warm_mtp(self, self.mtp_drafts)
            out = {k: out[k] + more[k] for k in out}
        return out

    # ---- the step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for op in plan.cache_ops:
            self.cache_ops.apply(op)
        results: list[SlotResult] = []
        t1 = time.perf_counter()
        passes = self.num_passes
        if plan.slots:
            results = self._forward(plan.slots, plan.wide)
        t2 = time.perf_counter()
        for op in plan.cache_ops_after:
            self.cache_ops.apply(op)
        timings = {"cache_ops": (t1 - t0 + time.perf_counter() - t2) * 1e3,
                   "forward": (t2 - t1) * 1e3}
        counters = {"rows": plan.num_rows, "passes": self.num_passes - passes,
                    "kv_free_blocks": self.kv.allocator.num_free,
                    "kv_total_blocks": self.kv.num_blocks}
        if self.slot_routing:  # for the daemon's adaptive draft budget
            t3 = time.perf_counter()
            routes = self.experts.take_slot_experts(keep=plan.slot_routing)
            for res in results:
                res.cpu_experts, res.cpu_expert_rows = routes.get(res.slot, _NO_ROUTES)
            counters["cpu_experts_held"] = self.experts.cpu_experts_held
            timings["slot_routing"] = (time.perf_counter() - t3) * 1e3
        if self.overlap is not None:
            draft_ms, draft_counts = self.overlap.take_stats()
            timings.update(draft_ms)
            counters.update(draft_counts)
        if self.graphs is not None:
            counts, ms = self.graphs.take_counts()
            counters.update(counts)
            timings.update(ms)
        if self.experts is not None:
            stats = self.experts.take_stats()
            timings["cpu_experts"] = stats.pop("cpu_experts_ms")
            counters.update(stats)
        return StepResult(step_id=plan.step_id, slots=results, timings_ms=timings,
                          counters=counters)

    def _forward(self, work: list[SlotWork], wide: bool = True) -> list[SlotResult]:
        """Check every slot's work, run the forward pass(es), sample, verify drafts. Wide:
        every slot's rows in one pass, however many carry drafts (the daemon bounds them,
        daemon/draft_plan.py); narrow: one pass per drafted slot, one for the others."""
        for w in work:
            self._check(w)
        drafted = [w for w in work if len(w.draft_ids)]
        if wide or not drafted:
            groups = [work]
        else:
            plain = [w for w in work if not len(w.draft_ids)]
            groups = ([plain] if plain else []) + [[w] for w in drafted]
        results = {}
        if self.overlap is not None:
            self.overlap.discard()  # a failed step's leftovers
        for group in groups:
            ordered = sorted(group, key=layout_order)
            for w, res in zip(ordered, self._pass(ordered), strict=True):
                results[w.slot] = res
        if self.overlap is not None:
            self.overlap.drain()  # the last pass's drafter: nothing left to hide it under
        return [results[w.slot] for w in work]

    def _check(self, w: SlotWork) -> None:
        if self.lengths.get(w.slot) is None:
            raise PlanError(f"slot {w.slot} is not allocated")
        if w.start_pos != self.lengths[w.slot]:
            raise PlanError(f"slot {w.slot}: start_pos {w.start_pos} but the cache holds "
                            f"{self.lengths[w.slot]} tokens")
        if w.start_pos + w.num_rows > self.max_context:
            raise PlanError(f"slot {w.slot}: position {w.start_pos + w.num_rows} is past "
                            f"the context limit {self.max_context}")
        if len(w.draft_ids) and not w.needs_logits:
            raise PlanError(f"slot {w.slot}: drafts need logits")
        if w.needs_logits and w.sampling.seed is None:
            raise PlanError(f"slot {w.slot}: the daemon must fix a seed for every request")

    def _pass(self, work: list[SlotWork]) -> list[SlotResult]:
        """One forward pass over ``work``: each slot's input rows then its drafts; logits of
        every row of a drafted slot, of the last row of the others that need one."""
        batch = RaggedBatch.build([(w.slot, w.start_pos, np.concatenate(
            [w.input_ids, w.draft_ids]).astype(np.int64)) for w in work],
            {w.slot: w.route_key for w in work})
        rows, first = logit_rows(work, batch)
        states = self.caches.states
        verifying = (contextlib.nullcontext() if states is None else
                     states.verifying(w.slot for w in work if len(w.draft_ids)))

        def forward():
            return self.model.forward(batch, self.caches, np.asarray(rows, dtype=np.int64),
                                      self.experts)

        if self.slot_routing:  # row -> slot of the decode rows; -1: prompt rows
            row_slot = np.full(batch.num_rows, -1, np.int64)
            for w, seg in zip(work, batch.segments, strict=True):
                if w.kind == WorkKind.DECODE:
                    row_slot[seg.rows] = w.slot
            self.experts.track_rows(row_slot)
        results, committed = [], {}
        self.num_passes += 1
        with verifying:
            ran = None
            if (self.graphs is not None and self.experts is self.graphs.experts
                    and graph_takes(work, batch)):
                ran = self.graphs.run(work, batch, np.asarray(rows, dtype=np.int64), first)
            if ran is not None:
                out, picks = ran
            else:
                out = (forward() if self.experts is None else self.experts.run_step(forward)
                       if self.overlap is None else self.overlap.run_pass(forward))
                picks = sample_and_match_all(work, out.logits, first)
            for w, (tokens, accepted) in zip(work, picks, strict=True):
                committed[w.slot] = (w.num_tokens + accepted, tokens)
                self.lengths[w.slot] = w.start_pos + w.num_tokens + accepted
                if len(w.draft_ids) and states is not None:
                    states.adopt(w.slot, w.num_tokens + accepted)
                results.append(_result(w, tokens, accepted))
        if self.model.mtp is not None and any(w.mtp_drafts for w in work):
            if self.overlap is None:
                head = self.drafter.prepare(work, batch, out.hidden, committed)
                drafts = {}
                if head is not None:  # one CUDA graph (gpu_worker/mtp_graph.py), or eager
                    drafts = self.graphs.mtp.run(head) if self.graphs is not None else None
                    if drafts is None:
                        drafts = run_all(self.drafter.run(head))
                _attach(results, drafts)
            else:  # under the next pass's CPU experts, or at the end of the step
                steps = self.drafter.steps(work, batch, out.hidden, committed)
                self.overlap.defer(steps, functools.partial(_attach, results))
        return results


def _attach(results: list[SlotResult], drafts: dict[int, list[int]]) -> None:
    for res in results:
        res.drafts = drafts.get(res.slot, [])


def layout_order(w: SlotWork) -> tuple:
    """The order of a pass's slots: larger segments first, a slot that samples before one
    that does not. The pass's CUDA-graph key (step_graph.layout_key) names which slots
    sample in pass order, so passes that differ only in which slot is which share a graph.
    Rows are batch-invariant, so no bits change."""
    return (-w.num_rows, -len(w.draft_ids), not w.needs_logits, w.slot)


def logit_rows(work: list[SlotWork], batch: RaggedBatch) -> tuple[list[int], dict[int, int]]:
    """The rows whose logits a pass samples (every row of a drafted slot, the last row of the
    others that need one), and each such slot's first index among them."""
    rows: list[int] = []
    first: dict[int, int] = {}
    for w, seg in zip(work, batch.segments, strict=True):
        if len(w.draft_ids):
            first[w.slot] = len(rows)
            rows += range(seg.row0, seg.row0 + seg.num)
        elif w.needs_logits:
            first[w.slot] = len(rows)
            rows.append(seg.row0 + seg.num - 1)
    return rows, first


def _result(w: SlotWork, tokens: list[int], accepted: int) -> SlotResult:
    prefill = w.kind == WorkKind.PREFILL
    done = w.start_pos + w.num_tokens >= w.prompt_len
    phase = Phase.DECODE if not prefill or done else Phase.PREFILL
    return SlotResult(
        slot=w.slot, request_id=w.request_id, token_ids=tokens, num_accepted=accepted,
        prompt=PromptPhase(phase=phase, prompt_tokens_this_step=w.num_tokens if prefill else 0,
                           prompt_len=w.prompt_len, cached_len=w.cached_len))
