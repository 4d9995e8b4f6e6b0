"""One request's bookkeeping in the daemon: tokens, progress, text and stop handling."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from daemon.proposers.suffix import SuffixProposer
from daemon.request import (
    GenerationRequest,
    RequestEvent,
    RequestHandle,
    Usage,
    user_route_key,
)
from protocol.messages import Phase

if TYPE_CHECKING:
    from daemon.config import SpeculationSection
    from daemon.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass(slots=True)
class PromptProgress:
    """A request's prompt as of the latest step that ran it (daemon.progress keeps it)."""

    phase: Phase | None = None  # the latest result's; None: no result since admission
    done: int = 0  # prompt tokens in the worker's cache (cached + prefilled)
    total: int = 0  # prompt tokens to prefill (after a recompute: + the generated ones)
    cached: int = 0  # of done, reused from the prefix cache
    rate: float | None = None  # prompt tokens/s of the latest step; None: it did none


@dataclasses.dataclass(eq=False)
class Sequence:
    req: GenerationRequest
    handle: RequestHandle
    seed: int
    detok: IncrementalDetokenizer | None  # None for a model without tokenizer
    eos_ids: frozenset[int]
    order: int  # admission order (FIFO within a priority)
    slot: int | None = None
    generated: list[int] = dataclasses.field(default_factory=list)
    processed: int = 0  # tokens in the worker's cache for this request
    cached: int = 0  # prompt tokens reused from the prefix cache
    swapped_entry: int | None = None  # preempted: its state lives in this worker entry
    recompute: bool = False  # preempted by dropping: re-prefill prompt + generated tokens
    text: str = ""
    sent: int = 0  # chars of ``text`` already emitted
    finished: str | None = None  # finish reason once done
    cancel_requested: bool = False
    t_submit: float = dataclasses.field(default_factory=time.monotonic)
    t_last: float | None = None
    proposer: SuffixProposer | None = None  # once speculation drafts suffixes for it
    mtp_drafts: list[int] = dataclasses.field(default_factory=list)  # the worker's, last step
    draft_source: int = 0  # DraftSource of its latest drafts (daemon.draft_plan; 0: none)
    progress: PromptProgress = dataclasses.field(default_factory=PromptProgress)
    progress_sent: dict | None = None  # the last progress event pushed (opt-in requests)
    user_key: int | None = dataclasses.field(init=False)  # user_route_key(req.user)
    state_slot: int | None = None  # the slot its worker states began in (a swap keeps them)

    def __post_init__(self) -> None:
        self.user_key = None if self.req.user is None else user_route_key(self.req.user)

    def route_key(self, slot: int) -> int:
        """What a synthetic model routes this request's rows by in ``slot``: its user's key,
        else the slot (the worker's default for SlotWork.route_key None)."""
        return slot if self.user_key is None else self.user_key

    @property
    def prompt(self) -> list[int]:
        return self.req.prompt_ids

    @property
    def prefill_len(self) -> int:
        """Tokens to prefill before decoding: the prompt, or after a recompute-preemption the
        prompt plus everything generated so far (the next token is sampled at its end)."""
        return len(self.prompt) + (len(self.generated) if self.recompute else 0)

    @property
    def in_prefill(self) -> bool:
        return self.processed < self.prefill_len

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt)
        return (self.prompt[start:end] if end <= n
                else (self.prompt + self.generated)[start:end])

    @property
    def phase(self) -> str:
        return "prefill" if self.in_prefill else "decode"

    def token_at(self, pos: int) -> int:
        n = len(self.prompt)
        return self.prompt[pos] if pos < n else self.generated[pos - n]

    def drafts(self, spec: SpeculationSection | None, max_context: int) -> list[int]:
        """Draft tokens to verify after the next decode row: at most num_drafts, and never
        more than the request may still emit after the row's own token or the context can
        hold."""
        if spec is None:
            return []
        room = min(spec.num_drafts, self.req.max_tokens - len(self.generated) - 1,
                   max_context - self.processed - 1)
        if spec.proposer == "mtp":  # the worker's MTP head proposed them with the last result
            return self.mtp_drafts[:max(room, 0)]
        if self.proposer is None:
            self.proposer = SuffixProposer(spec.min_match, spec.max_match)
        total = len(self.prompt) + len(self.generated)
        self.proposer.extend(self.tokens(len(self.proposer), total))
        return self.proposer.propose(room)

    def add_tokens(self, ids: list[int]) -> RequestEvent | None:
        """Append sampled tokens; returns the event to emit (None when nothing is new)."""
        new_ids: list[int] = []
        for token in ids:
            if self.req.eos and token in self.eos_ids:
                self.finished = "stop"
                break
            self.generated.append(token)
            new_ids.append(token)
            if self.detok is not None:
                self.text += self.detok.add(token)
            if self._hit_stop():
                self.finished = "stop"
                break
            if len(self.generated) >= self.req.max_tokens:
                self.finished = "length"
                break
        if self.finished and self.detok is not None and not self._stopped_by_string:
            self.text += self.detok.flush()
        delta = self._take_text()
        if not new_ids and not delta and not self.finished:
            return None
        return RequestEvent(new_ids, delta, self.finished,
                            usage=self.usage() if self.finished else None)

    def finish(self, reason: str, error: str | None = None) -> RequestEvent:
        self.finished = reason
        return RequestEvent([], self._take_text() if reason != "error" else "", reason,
                            error=error, usage=self.usage())

    def usage(self) -> Usage:
        return Usage(len(self.prompt), len(self.generated), self.cached)

    # ---- stop strings ------------------------------------------------------------------
    _stopped_by_string: bool = False

    def _hit_stop(self) -> bool:
        longest = max((len(s) for s in self.req.stop), default=0)
        start = max(0, self.sent - longest)
        hits = [i for i in (self.text.find(s, start) for s in self.req.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self._stopped_by_string = True
        return bool(hits)

    def _take_text(self) -> str:
        """Text that can be emitted: everything when finished; otherwise hold back a tail
        that could still grow into a stop string."""
        end = len(self.text)
        if not self.finished:
            for s in self.req.stop:
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta
