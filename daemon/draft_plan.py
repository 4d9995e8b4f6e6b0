"""Which drafts a step verifies and how the worker groups its passes (docs/speculation.md).

The scheduler proposes drafts slot by slot (``propose``: the request's own suffix index, the
global one, or the worker's MTP head); ``fit`` then fits the step's drafts, in this order:

1. ``prefer = "admission"``: a step that prefills a prompt chunk verifies no drafts.
2. Wide: at most ``MAX_WIDE_SLOTS`` (4) drafted slots per pass. With more, the ones whose
   drafts were verified longest ago (then the longest drafts, then the lowest slot) keep
   theirs; the others run a plain row this step, so over steps every slot gets its turn.
3. A budget of draft rows: ``max_drafts_per_step`` (0: none), and in wide mode the pass's
   capacity: its decode rows (one per decoding slot plus the drafts) at most 16.
   ``trim_fair`` meets it by taking one draft at a time from the slot holding the most (the
   later slot on a tie), so the longest drafts shrink first and the rest keep theirs.
4. ``draft_budget = "adaptive"``: each slot keeps the count of its fitted drafts that
   maximises expected tokens per ms of the predicted step (daemon/draft_budget.py), which
   knows what a draft row costs in distinct CPU experts (daemon/draft_stats.py).
5. The pass runs at the smallest capacity of 8, 12, 16 that holds its decode rows (the
   future CUDA-graph buckets; prompt rows of the same pass are outside them).

Passes: wide runs every slot's rows in ONE pass whatever the number of drafted slots (a lone
drafted slot too: its rows and the others' single rows together; alone, it decodes solo);
narrow verifies each drafted slot in its own pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import structlog

from daemon.draft_adaptive import DraftBudget
from daemon.proposers.global_suffix import GlobalSuffixIndex
from daemon.proposers.replay import ReplayProposer
from protocol.messages import DraftSource, SlotWork, StepPlan, StepResult, WorkKind
from protocol.worker_config import (  # the worker's too
    GRAPH_BUCKETS,
    MAX_WIDE_SLOTS,
    WIDE_CAPACITIES,
)

if TYPE_CHECKING:
    from daemon.config import SpeculationSection
    from daemon.sequence import Sequence

log = structlog.get_logger("tandem.speculation")
T = TypeVar("T")
WIDE_BACKENDS = ("numpy", "cupy", "auto")  # run a verify pass over several slots' rows
WIDE_PLACEMENTS = ("gpu", "cpu", "split")  # the routed experts see the pass's union of rows


async def overlapped(step: Awaitable[T], meanwhile: Callable[[], None]) -> T:
    """``step``'s result, ``meanwhile`` run once the step is under way (its plan sent:
    the step's first turn of the loop) and before its result is awaited: host work off the
    step's critical path. An error of ``meanwhile`` is logged, never the step's; a
    cancellation cancels the step too."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.sleep(0)
        try:
            meanwhile()
        except Exception:  # a bug of ours: the step's result still counts
            log.exception("work between steps failed")
        return await task
    finally:
        if not task.done():
            task.cancel()


def capacity_for(rows: int) -> int | None:
    """The smallest wide capacity that holds ``rows`` decode rows (None: none does)."""
    return next((c for c in WIDE_CAPACITIES if rows <= c), None)


def trim_fair(lengths: list[int], budget: int) -> list[int]:
    """Draft counts summing to at most ``budget``: one draft at a time comes off the longest
    (the last of equals), e.g. [4, 4, 1] with budget 6 -> [3, 2, 1]."""
    out = list(lengths)
    while sum(out) > max(budget, 0):
        top = max(out)
        out[max(i for i, n in enumerate(out) if n == top)] -= 1
    return out


@dataclasses.dataclass(frozen=True)
class Eligibility:
    """How a configuration batches drafted slots, and why."""

    batching: str  # "plain" (no drafts), "solo", "narrow" or "wide"
    reason: str


def eligibility(spec: SpeculationSection | None, *, max_slots: int, backend: str = "numpy",
                placement: str = "gpu") -> Eligibility:
    """The batching a configuration gets (logged once at start-up by ``DraftPlanner``)."""
    if spec is None or spec.mode == "off":
        return Eligibility("plain", "speculation.mode = off")
    if max_slots == 1:
        return Eligibility("solo", "max_slots = 1: the one slot verifies its drafts alone")
    if spec.mode == "narrow":
        return Eligibility("narrow", "speculation.mode = narrow: one pass per drafted slot")
    if backend not in WIDE_BACKENDS or placement not in WIDE_PLACEMENTS:
        return Eligibility("narrow", f"backend {backend} / placement {placement} has no wide "
                           f"verify pass")
    room = WIDE_CAPACITIES[-1] - max_slots
    return Eligibility("wide", (
        f"up to {MAX_WIDE_SLOTS} drafted slots share one pass with the other slots' rows, "
        f"<= {WIDE_CAPACITIES[-1]} decode rows (capacities {WIDE_CAPACITIES}); more drafted "
        f"slots take turns; one drafted slot: one pass"
        + ("" if room > 0 else f"; max_slots = {max_slots} leaves no room for drafts when "
           f"every slot decodes")))


class DraftPlanner:
    """The scheduler's speculation policy: proposals (with the global suffix index) and the
    fitting of each step's drafts. ``spec`` None: speculation off."""

    def __init__(self, spec: SpeculationSection | None, *, max_slots: int,
                 backend: str = "numpy", placement: str = "gpu") -> None:
        self.spec = spec
        self.eligibility = eligibility(spec, max_slots=max_slots, backend=backend,
                                       placement=placement)
        self.wide = self.eligibility.batching in ("wide", "solo", "plain")  # one pass
        suffix = spec is not None and spec.proposer == "suffix"
        self.replay = (ReplayProposer.load(spec.replay_file)
                       if spec is not None and spec.proposer == "replay" else None)
        self.index = (GlobalSuffixIndex(spec.global_index_tokens, spec.min_match,
                                        spec.max_match)
                      if suffix and spec.global_index_tokens else None)
        # a request's segment in the index and how many of its tokens it holds
        self._fed: weakref.WeakKeyDictionary[Sequence, list[int]] = \
            weakref.WeakKeyDictionary()
        self._last_verified: dict[str, int] = {}  # request id -> fit() call that verified
        self._fits = 0
        self.last_capacity: int | None = None  # of the latest wide pass with drafts
        self.budget = (DraftBudget(spec) if spec is not None
                       and spec.draft_budget == "adaptive" else None)
        # whether the step just fitted asks the worker for its slots' CPU experts
        # (StepPlan.slot_routing; the adaptive budget's, daemon/draft_adaptive.py)
        self.routes_wanted = True
        log.info("speculation eligibility", batching=self.eligibility.batching,
                 reason=self.eligibility.reason, mode=spec.mode if spec else "off",
                 max_slots=max_slots, backend=backend, placement=placement,
                 prefer=spec.prefer if spec else None,
                 max_drafts_per_step=spec.max_drafts_per_step if spec else None,
                 global_index_tokens=self.index.max_tokens if self.index else 0,
                 draft_budget=spec.draft_budget if spec else None)

    def worker_pads(self, padded: bool) -> None:
        """READY's ``ModelInfo.padded_passes``: whether the worker runs a decode-only pass
        padded up to its graph bucket (protocol.worker_config.GRAPH_BUCKETS), which the
        adaptive budget's step cost then counts (a pass costs the rows it runs)."""
        if self.budget is not None:
            self.budget.pad_to = GRAPH_BUCKETS if padded else ()

    # ---- proposals -----------------------------------------------------------------------
    def propose(self, seq: Sequence, max_context: int) -> list[int]:
        """Drafts for ``seq``'s next decode row; sets ``seq.draft_source``. Its own history
        (or the MTP head) first; the global index when that finds nothing."""
        spec = self.spec
        seq.draft_source = 0
        if spec is None or not seq.req.speculation:
            return []
        if self.replay is not None:  # benchmarks only (daemon/proposers/replay.py)
            seq.draft_source = self.replay.source
            return self.replay.propose(seq, min(
                spec.num_drafts, seq.req.max_tokens - len(seq.generated) - 1,
                max_context - seq.processed - 1))
        drafts = seq.drafts(spec, max_context)  # feeds the request's own suffix index
        seq.draft_source = DraftSource.MTP if spec.proposer == "mtp" else DraftSource.SUFFIX
        if self.index is None:
            return drafts
        fed = self._fed.get(seq)
        if fed is None:  # its prompt, less what the prefix cache reused (already indexed)
            fed = self._fed[seq] = [self.index.new_segment(), seq.cached]
        total = len(seq.prompt) + len(seq.generated)
        self.index.extend(fed[0], seq.tokens(fed[1], total))
        fed[1] = total
        if drafts:
            return drafts
        room = min(spec.num_drafts, seq.req.max_tokens - len(seq.generated) - 1,
                   max_context - seq.processed - 1)
        drafts = self.index.propose(seq.proposer.history[-spec.max_match:], room,
                                    exclude=fed[0])
        if drafts:
            seq.draft_source = DraftSource.GLOBAL_SUFFIX
        return drafts

    # ---- fitting a step ------------------------------------------------------------------
    def fit(self, work: list[SlotWork]) -> tuple[list[SlotWork], bool]:
        """The step's work with its drafts fitted (module docstring) and whether the worker
        runs it as one pass (``StepPlan.wide``)."""
        spec = self.spec
        if spec is None:
            return work, True
        self._fits += 1
        live = {w.request_id for w in work}
        self._last_verified = {r: s for r, s in self._last_verified.items() if r in live}
        counts = [len(w.draft_ids) for w in work]
        if spec.prefer == "admission" and any(w.kind == WorkKind.PREFILL for w in work):
            counts = [0] * len(work)
        drafted = [i for i, n in enumerate(counts) if n]
        if self.wide and len(drafted) > MAX_WIDE_SLOTS:
            turn = sorted(drafted, key=lambda i: (self._last_verified.get(work[i].request_id,
                                                                          0),
                                                  -counts[i], work[i].slot))
            for i in turn[MAX_WIDE_SLOTS:]:
                counts[i] = 0
        budget = spec.max_drafts_per_step or sum(counts)
        decode_rows = sum(1 for w in work if w.kind == WorkKind.DECODE)
        if self.wide:
            budget = min(budget, WIDE_CAPACITIES[-1] - decode_rows)
        counts = trim_fair(counts, budget)
        if self.budget is not None:
            counts = self.budget.choose(work, counts, self.wide)
            self.routes_wanted = self.budget.wants_routes()
        self.last_capacity = (capacity_for(decode_rows + sum(counts))
                              if self.wide and any(counts) else None)
        out = []
        for w, n in zip(work, counts, strict=True):
            if n:
                self._last_verified[w.request_id] = self._fits
            if n != len(w.draft_ids):
                w = dataclasses.replace(w, draft_ids=w.draft_ids[:n],
                                        draft_sources=w.draft_sources[:n])
            out.append(w)
        return out, self.wide

    def budget_step(self) -> dict | None:
        """The adaptive budget's choice for the step last fitted (DraftBudget.last; None
        without the budget or a choice)."""
        return None if self.budget is None else self.budget.last

    def observe(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        """A step's outcome (daemon/step_commit.py): the adaptive budget's estimates."""
        if self.budget is not None:
            self.budget.observe(plan, result, seconds)

    def between_steps(self) -> None:
        """While a step runs (daemon/scheduler.py, :func:`overlapped`): the adaptive
        budget's work that can wait for it (DraftBudget.between_steps)."""
        if self.budget is not None:
            self.budget.between_steps()
