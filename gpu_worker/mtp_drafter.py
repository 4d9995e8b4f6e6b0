"""The MTP head run after a pass: it keeps its own KV complete and proposes a slot's drafts.

Row t of the head holds token t+1 and the main model's final hidden state h_t, at position t.
After each pass the head runs over every committed position of the slots that asked
(``SlotWork.mtp_drafts``), so its KV (the last layer of the main cache) never has holes; then,
from each slot's last committed row, it drafts up to ``mtp_drafts`` argmax tokens, each
chained on the head's own previous output.

:meth:`MtpDrafter.steps` is that work as a generator that yields after issuing each head pass:
``[speculation] draft_overlap`` (gpu_worker/draft_overlap.py) runs those units while the CPU
experts of the step's next pass are in flight; :meth:`MtpDrafter.draft` runs them at once.
Either way the same head passes run on the same rows in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

import numpy as np

from gpu_worker.backend import to_numpy
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Caches, Model
from gpu_worker.model.ops import Array
from protocol.messages import SlotWork

# slot -> (rows of the pass committed, tokens sampled after them)
Committed = dict[int, tuple[int, list[int]]]
Drafts = dict[int, list[int]]  # slot -> its argmax drafts
# a drafter's work: yields after issuing each head pass, returns the drafts
DraftSteps = Generator[None, None, Drafts]


@dataclasses.dataclass(frozen=True)
class HeadWork:
    """One pass's drafting, prepared (:meth:`MtpDrafter.prepare`): the head's first pass over
    every committed row (``batch``, ``hidden``), logits at ``last_rows``, one per slot of
    ``want`` (the slots that draft, in ``batch`` order); then each of those slots chains
    drafts up to its ``limit`` from the position after ``last_pos``."""

    batch: RaggedBatch
    hidden: Array  # [R, H]: the main model's final hidden state of each row
    last_rows: np.ndarray  # int64 [len(want)]
    want: list[int]
    limit: dict[int, int]
    last_pos: dict[int, int]
    keys: dict[int, int | None]  # slot -> a synthetic model's routing key


def run_all(steps: DraftSteps) -> Drafts:
    """Every unit of ``steps`` now; its drafts."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


class MtpDrafter:
    def __init__(self, model: Model, caches: Caches, max_context: int) -> None:
        self.model = model
        self.caches = caches
        self.max_context = max_context
        # a slot's last committed row whose next token was not known yet (a non-final
        # prefill chunk): (position, final hidden row [H]); its head row runs next step
        self.pending: dict[int, tuple[int, Array]] = {}

    def forget(self, slot: int) -> None:
        """The slot's cache was emptied or replaced: its pending row is stale."""
        self.pending.pop(slot, None)

    def draft(self, work: list[SlotWork], batch: RaggedBatch, hidden: Array,
              committed: Committed) -> Drafts:
        """After the pass over ``batch`` (``hidden`` [R, H] its final-normed rows): the
        head's rows for every committed position, then each slot's drafts."""
        return run_all(self.steps(work, batch, hidden, committed))

    def steps(self, work: list[SlotWork], batch: RaggedBatch, hidden: Array,
              committed: Committed) -> DraftSteps:
        """:meth:`draft` as a generator: it yields after issuing each head pass (the first
        over every committed row, then one per chained draft) and returns the drafts. It
        reads only this pass's ``hidden`` and ``committed`` and the head's KV rows of these
        slots, so it may run while the step's next pass runs (other slots)."""
        head = self.prepare(work, batch, hidden, committed)
        if head is None:
            return {}
        return (yield from self.run(head))

    def prepare(self, work: list[SlotWork], batch: RaggedBatch, hidden: Array,
                committed: Committed) -> HeadWork | None:
        """What the head runs after the pass over ``batch`` (None: nothing); takes each
        slot's pending row, so one of :meth:`run` or a CUDA graph of it
        (gpu_worker/mtp_graph.py) must follow."""
        xp = self.model.xp
        parts, rows_h, last_pos = self._head_rows(work, batch, hidden, committed)
        if not parts:
            return None
        keys = {w.slot: w.route_key for w in work}  # a synthetic model routes by them
        mbatch = RaggedBatch.build(parts, keys)
        ends = {seg.slot: seg.row0 + seg.num - 1 for seg in mbatch.segments}
        want = [s for s, _, _ in parts if s in last_pos]
        k_of = {w.slot: w.mtp_drafts for w in work}
        return HeadWork(mbatch, xp.concatenate(rows_h, axis=0),
                        np.asarray([ends[s] for s in want], dtype=np.int64), want,
                        {s: min(k_of[s], self.max_context - 1 - last_pos[s]) for s in want},
                        last_pos, keys)

    def run(self, head: HeadWork) -> DraftSteps:
        """The head's passes of ``head`` (a yield after each), eagerly; the drafts."""
        xp = self.model.xp
        out = self.model.mtp_forward(head.batch, head.hidden, self.caches, head.last_rows)
        yield
        if not head.want:  # prompt chunks only: the head's KV is written, nothing to propose
            return {}
        return (yield from self._chain(head.want, head.limit, head.last_pos, out.logits,
                                       out.hidden[xp.asarray(head.last_rows)], head.keys))

    def _head_rows(self, work: list[SlotWork], batch: RaggedBatch, hidden: Array,
                   committed: Committed
                   ) -> tuple[list[tuple[int, int, list[int]]], list[Array], dict[int, int]]:
        """Per slot that asked: (slot, start, next token of each row) and its hidden rows
        [n, H] (a pending row of the last step first); the position of its last committed
        row where a token was sampled (so drafting starts there)."""
        xp = self.model.xp
        parts, rows_h, last_pos = [], [], {}
        for w, seg in zip(work, batch.segments, strict=True):
            if not w.mtp_drafts:
                self.pending.pop(w.slot, None)
                continue
            count, tokens = committed[w.slot]
            ids = [int(t) for t in np.concatenate([w.input_ids, w.draft_ids])]
            nxt = ids[1:count] + ([tokens[-1]] if tokens else [])  # token after each row
            start, known = w.start_pos, hidden[seg.row0:seg.row0 + len(nxt)]
            pending = self.pending.pop(w.slot, None)
            if pending is not None and pending[0] == w.start_pos - 1:
                start, nxt = w.start_pos - 1, [ids[0]] + nxt
                known = xp.concatenate([pending[1][None], known], axis=0)
            if not tokens:  # nothing sampled: the last row's next token comes next step
                # a copy: a CUDA graph's hidden rows are rewritten by its next replay
                self.pending[w.slot] = (w.start_pos + count - 1,
                                        hidden[seg.row0 + count - 1].copy())
            if not nxt:
                continue
            parts.append((w.slot, start, nxt))
            rows_h.append(known)
            if tokens:
                last_pos[w.slot] = start + len(nxt) - 1
        return parts, rows_h, last_pos

    def _chain(self, live: list[int], limit: dict[int, int], last_pos: dict[int, int],
               logits: Array, h: Array, keys: dict[int, int | None]) -> DraftSteps:
        """Argmax drafts from the head's output rows (``logits`` [n, V], ``h`` [n, H], one per
        slot of ``live``); each further draft is one more head row at the next position, on
        the head's own output, until the slot has ``limit`` drafts (a yield after each). The
        argmax runs on the backend: only the n ids cross to the host, not n x V logits."""
        xp = self.model.xp
        drafts: dict[int, list[int]] = {s: [] for s in live}
        while live:
            picks = to_numpy(logits.argmax(axis=-1))
            for s, d in zip(live, picks, strict=True):
                drafts[s].append(int(d))
            keep = [i for i, s in enumerate(live) if len(drafts[s]) < limit[s]]
            if not keep:
                break
            live = [live[i] for i in keep]
            cbatch = RaggedBatch.build([(s, last_pos[s] + len(drafts[s]), [drafts[s][-1]])
                                        for s in live], keys)
            out = self.model.mtp_forward(cbatch, h[xp.asarray(np.asarray(keep, np.int64))],
                                         self.caches)
            yield
            logits, h = out.logits, out.hidden
        return drafts
