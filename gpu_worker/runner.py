"""Executes one StepPlan: cache commands, one ragged forward over every slot's rows (or, for
narrow speculation, one per drafted slot), sampling and draft verification, then the
after-step cache commands. Pure in-process; server.py wraps it."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from gpu_worker.backend import to_numpy
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from gpu_worker.sampling import sample
from protocol.messages import (
    CacheOp,
    CacheOpKind,
    Phase,
    PromptPhase,
    SamplingParams,
    SlotResult,
    SlotWork,
    StepPlan,
    StepResult,
    WorkKind,
)


class PlanError(ValueError):
    """A StepPlan that names an unknown slot or entry or breaks a cache invariant."""


@dataclasses.dataclass
class Entry:
    """A saved slot state: a prefix checkpoint (KV block refs on the device) or a swapped-out
    slot (KV copied to host memory, blocks freed)."""

    num_tokens: int
    blocks: list[int]  # device KV blocks held by reference (checkpoints)
    state: tuple | None  # recurrent-state snapshot at exactly num_tokens
    host_kv: tuple | None = None  # swapped-out pools (KVCache.gather), on the host


class Runner:
    def __init__(self, model: Model, *, max_slots: int, max_context: int, block_size: int = 16,
                 extra_blocks: int = 0, experts=None, expert_stats=None,
                 expert_step=None, kv_int8: bool = False) -> None:
        self.model = model
        self.max_slots = max_slots
        self.max_context = max_context
        # extra_blocks: room for prefix checkpoints beyond every slot's own blocks
        self.caches = model.new_caches(max_slots, max_context, block_size, extra_blocks,
                                       kv_int8=kv_int8)
        self.experts = experts
        self.expert_stats = expert_stats  # () -> counters of the CPU expert path, per step
        self.expert_step = expert_step  # (forward) -> its result, the CPU experts' step ended
        self.entries: dict[int, Entry] = {}
        self.lengths: dict[int, int] = {}  # tokens in each allocated slot's cache
        # MTP: a slot's last committed row whose next token was not known yet (a non-final
        # prefill chunk): (position, final hidden row); its MTP row runs in the next step
        self._mtp_pending: dict[int, tuple[int, object]] = {}

    @property
    def kv(self):
        return self.caches.kv

    # ---- the step ------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for op in plan.cache_ops:
            self._cache_op(op)
        results: list[SlotResult] = []
        t1 = time.perf_counter()
        if plan.slots:
            results = self._forward(plan.slots, plan.wide)
        t2 = time.perf_counter()
        for op in plan.cache_ops_after:
            self._cache_op(op)
        timings = {"cache_ops": (t1 - t0 + time.perf_counter() - t2) * 1e3,
                   "forward": (t2 - t1) * 1e3}
        counters = {"rows": plan.num_rows, "kv_free_blocks": self.kv.allocator.num_free,
                    "kv_total_blocks": self.kv.num_blocks}
        if self.expert_stats is not None:
            stats = self.expert_stats()
            timings["cpu_experts"] = stats.pop("cpu_experts_ms")
            counters.update(stats)
        return StepResult(step_id=plan.step_id, slots=results, timings_ms=timings,
                          counters=counters)

    def _forward(self, work: list[SlotWork], wide: bool = True) -> list[SlotResult]:
        """Check every slot's work, run the forward pass(es), sample, verify drafts. Drafted
        slots share one pass with the rest (``wide``) or get one pass each (narrow)."""
        for w in work:
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
        drafted = [w for w in work if len(w.draft_ids)]
        if wide or not drafted:
            groups = [work]
        else:
            plain = [w for w in work if not len(w.draft_ids)]
            groups = ([plain] if plain else []) + [[w] for w in drafted]
        results = {}
        for group in groups:
            for w, res in zip(group, self._pass(group), strict=True):
                results[w.slot] = res
        return [results[w.slot] for w in work]

    def _pass(self, work: list[SlotWork]) -> list[SlotResult]:
        """One forward pass over ``work``: each slot's input rows then its drafts; logits of
        every row of a drafted slot, of the last row of the others that need one."""
        batch = RaggedBatch.build([(w.slot, w.start_pos, np.concatenate(
            [w.input_ids, w.draft_ids]).astype(np.int64)) for w in work])
        rows, first = [], {}
        for w, seg in zip(work, batch.segments, strict=True):
            if len(w.draft_ids):
                first[w.slot] = len(rows)
                rows += range(seg.row0, seg.row0 + seg.num)
            elif w.needs_logits:
                first[w.slot] = len(rows)
                rows.append(seg.row0 + seg.num - 1)
        states = self.caches.states
        if states is not None:
            states.track([w.slot for w in work if len(w.draft_ids)])

        def forward():
            return self.model.forward(batch, self.caches, np.asarray(rows, dtype=np.int64),
                                      self.experts)

        try:
            out = forward() if self.expert_step is None else self.expert_step(forward)
        except BaseException:
            if states is not None:
                states.verify = {}
            raise
        logits = to_numpy(out.logits)
        results = []
        committed = {}
        for w in work:
            tokens, accepted = self._sample(w, logits, first.get(w.slot))
            committed[w.slot] = (w.num_tokens + accepted, tokens)
            self.lengths[w.slot] = w.start_pos + w.num_tokens + accepted
            if len(w.draft_ids) and states is not None:
                states.adopt(w.slot, w.num_tokens + accepted)
            prefill = w.kind == WorkKind.PREFILL
            done = w.start_pos + w.num_tokens >= w.prompt_len
            phase = Phase.DECODE if not prefill or done else Phase.PREFILL
            results.append(SlotResult(
                slot=w.slot, request_id=w.request_id, token_ids=tokens, num_accepted=accepted,
                prompt=PromptPhase(phase=phase,
                                   prompt_tokens_this_step=w.num_tokens if prefill else 0,
                                   prompt_len=w.prompt_len, cached_len=w.cached_len)))
        if states is not None:
            states.verify = {}
        if self.model.mtp is not None and any(w.mtp_drafts for w in work):
            drafts = self._mtp(work, batch, out.hidden, committed)
            for res in results:
                res.drafts = drafts.get(res.slot, [])
        return results

    def _mtp(self, work: list[SlotWork], batch: RaggedBatch, hidden, committed: dict
             ) -> dict[int, list[int]]:
        """The MTP head after a pass: its rows for every committed position of the slots
        that asked (``mtp_drafts``): row t holds token t+1 and the final hidden state h_t,
        which keeps the head's own KV complete; then, from the last committed row, up to
        ``mtp_drafts`` argmax drafts, each chained on the head's previous output."""
        xp = self.model.xp
        parts, rows_h, last_pos = [], [], {}
        for w, seg in zip(work, batch.segments, strict=True):
            if not w.mtp_drafts:
                self._mtp_pending.pop(w.slot, None)
                continue
            count, tokens = committed[w.slot]
            ids = [int(t) for t in np.concatenate([w.input_ids, w.draft_ids])]
            nxt = ids[1:count] + ([tokens[-1]] if tokens else [])  # token after each row
            start, known = w.start_pos, hidden[seg.row0:seg.row0 + len(nxt)]
            pending = self._mtp_pending.pop(w.slot, None)
            if pending is not None and pending[0] == w.start_pos - 1:
                start, nxt = w.start_pos - 1, [ids[0]] + nxt
                known = xp.concatenate([pending[1][None], known], axis=0)
            if not tokens:  # nothing sampled: the last row's next token comes next step
                self._mtp_pending[w.slot] = (w.start_pos + count - 1,
                                             hidden[seg.row0 + count - 1])
            if not nxt:
                continue
            parts.append((w.slot, start, nxt))
            rows_h.append(known)
            if tokens:
                last_pos[w.slot] = start + len(nxt) - 1
        if not parts:
            return {}
        mbatch = RaggedBatch.build(parts)
        ends = {seg.slot: seg.row0 + seg.num - 1 for seg in mbatch.segments}
        want = [s for s, _, _ in parts if s in last_pos]
        last_row = {s: ends[s] for s in want}
        out = self.model.mtp_forward(mbatch, xp.concatenate(rows_h, axis=0), self.caches,
                                     np.asarray([last_row[s] for s in want], dtype=np.int64))
        if not want:  # prompt chunks only: the head's KV is written, nothing to propose
            return {}
        k_of = {w.slot: w.mtp_drafts for w in work}
        drafts: dict[int, list[int]] = {s: [] for s in want}
        logits = to_numpy(out.logits)
        h = out.hidden[xp.asarray(np.asarray([last_row[s] for s in want], dtype=np.int64))]
        live = want
        while live:
            picks = logits.argmax(axis=-1)
            for s, d in zip(live, picks, strict=True):
                drafts[s].append(int(d))
            # chain: one more row per slot at the next position, on the head's own output
            keep = [i for i, s in enumerate(live) if len(drafts[s]) < min(
                k_of[s], self.max_context - 1 - last_pos[s])]
            if not keep:
                break
            live = [live[i] for i in keep]
            cbatch = RaggedBatch.build([(s, last_pos[s] + len(drafts[s]), [drafts[s][-1]])
                                        for s in live])
            out = self.model.mtp_forward(cbatch, h[xp.asarray(np.asarray(keep, np.int64))],
                                         self.caches)
            logits, h = to_numpy(out.logits), out.hidden
        return drafts

    @staticmethod
    def _sample(w: SlotWork, logits: np.ndarray, row: int | None) -> tuple[list[int], int]:
        """Sample-and-match (ARCHITECTURE.md section 4): row j picks the token at position
        start + num_tokens + j exactly as plain decoding would; draft j is accepted while it
        equals that pick. Returns (accepted drafts + one sampled token, drafts accepted)."""
        if row is None:
            return [], 0
        params = _sampling(w)
        pos = w.start_pos + w.num_tokens
        tokens: list[int] = []
        for j, draft in enumerate(w.draft_ids):
            token = sample(logits[row + j], params, pos + j)
            tokens.append(token)
            if token != int(draft):
                return tokens, j
        k = len(w.draft_ids)
        tokens.append(sample(logits[row + k], params, pos + k))
        return tokens, k

    # ---- cache commands ----------------------------------------------------------------
    def _cache_op(self, op: CacheOp) -> None:
        kind = op.op
        if op.slot is not None and not 0 <= op.slot < self.max_slots:
            raise PlanError(f"{kind.name}: slot {op.slot} out of range")
        if kind == CacheOpKind.ALLOCATE:
            self._release(op.slot)
            self.lengths[op.slot] = 0
        elif kind == CacheOpKind.FREE:
            self._release(op.slot)
        elif kind == CacheOpKind.CHECKPOINT:
            self.entries[op.entry_id] = self._checkpoint(op.slot, op.num_tokens)
        elif kind == CacheOpKind.SHARE_PREFIX:
            self._share(op)
        elif kind == CacheOpKind.RESTORE:
            entry = self._entry(op.entry_id)
            if entry.state is not None and self.caches.states is not None:
                self.caches.states.restore(op.slot, entry.state)
        elif kind == CacheOpKind.SWAP_OUT:
            self.entries[op.entry_id] = self._swap_out(op.slot)
        elif kind == CacheOpKind.SWAP_IN:
            self._swap_in(op.slot, self.entries.pop(self._check_entry(op.entry_id)))
        elif kind == CacheOpKind.DROP_CHECKPOINT:
            self.kv.allocator.free(self.entries.pop(self._check_entry(op.entry_id)).blocks)

    def _release(self, slot: int) -> None:
        self.caches.reset_slot(slot)
        self.lengths.pop(slot, None)
        self._mtp_pending.pop(slot, None)

    def _entry(self, entry_id: int) -> Entry:
        return self.entries[self._check_entry(entry_id)]

    def _check_entry(self, entry_id: int) -> int:
        if entry_id not in self.entries:
            raise PlanError(f"unknown cache entry {entry_id}")
        return entry_id

    def _checkpoint(self, slot: int, num_tokens: int) -> Entry:
        if self.lengths.get(slot) != num_tokens:
            raise PlanError(f"CHECKPOINT slot {slot} at {num_tokens} tokens, but it holds "
                            f"{self.lengths.get(slot)}")
        blocks = self.kv.tables.get(slot, [])[: self.kv.blocks_for(num_tokens)]
        self.kv.allocator.incref(blocks)
        state = self.caches.states.snapshot(slot) if self.caches.states is not None else None
        return Entry(num_tokens, list(blocks), state)

    def _share(self, op: CacheOp) -> None:
        """slot <- the first num_tokens of an entry (with its recurrent state) or a slot."""
        n = op.num_tokens
        if op.entry_id is not None:
            entry = self._entry(op.entry_id)
            if n > entry.num_tokens or (entry.state is not None and n != entry.num_tokens):
                raise PlanError(f"SHARE_PREFIX of {n} tokens from entry {op.entry_id} holding "
                                f"{entry.num_tokens}")
            blocks, state = entry.blocks, entry.state
        else:
            if self.caches.states is not None or self.lengths.get(op.src_slot, 0) < n:
                raise PlanError("SHARE_PREFIX from a slot needs an attention-only model and a "
                                "source slot holding the prefix")
            blocks, state = self.kv.tables[op.src_slot], None
        self._release(op.slot)
        self.kv.share(op.slot, blocks[: self.kv.blocks_for(n)])
        if state is not None:
            self.caches.states.restore(op.slot, state)
        self.lengths[op.slot] = n

    def _swap_out(self, slot: int) -> Entry:
        n = self.lengths.get(slot)
        if n is None:
            raise PlanError(f"SWAP_OUT of unallocated slot {slot}")
        # NOTE: only the blocks of the committed tokens: rejected drafts may have grown the
        # table past them (their rows are never read)
        blocks = self.kv.tables.get(slot, [])[: self.kv.blocks_for(n)]
        host = tuple(to_numpy(a).copy() for a in self.kv.gather(blocks))
        state = self.caches.states.snapshot(slot) if self.caches.states is not None else None
        if state is not None:
            state = tuple(to_numpy(s).copy() for s in state)
        self._release(slot)
        return Entry(n, [], state, host)

    def _swap_in(self, slot: int, entry: Entry) -> None:
        if entry.host_kv is None:
            raise PlanError("SWAP_IN of an entry that was not swapped out")
        self._release(slot)
        xp = self.model.xp
        self.kv.ensure(slot, entry.num_tokens)
        if entry.num_tokens:
            self.kv.scatter(self.kv.tables.get(slot, []), entry.host_kv)
        if entry.state is not None:
            self.caches.states.restore(slot, tuple(xp.asarray(s) for s in entry.state))
        self.lengths[slot] = entry.num_tokens


def _sampling(w: SlotWork) -> SamplingParams:
    s = w.sampling
    if s.seed is None:
        raise PlanError(f"slot {w.slot}: the daemon must fix a seed for every request")
    return s
