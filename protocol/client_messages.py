"""The client <-> daemon link: submit, cancel and status requests in; token events, status
and error replies out."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

import numpy as np

from protocol.fields import array_field, check
from protocol.kinds import MsgKind
from protocol.sampling import SamplingParams
from protocol.worker_messages import Phase

FINISH_REASONS = frozenset({"stop", "length", "cancelled", "error"})
MAX_REQUEST_ID_LEN = 128
# SamplingParams fields a client may leave to the model's generation defaults (READY's
# ModelInfo.generation_defaults), as the HTTP API does for a field a request leaves out
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p")


class ErrorCode(IntEnum):
    BAD_REQUEST = 1
    QUEUE_FULL = 3
    INTERNAL = 5  # a fault of the daemon (logged there with a traceback)
    WORKER_DIED = 6
    PROTOCOL = 7


@dataclass(slots=True, kw_only=True)
class ChatMessage:
    role: str
    content: str


@dataclass(slots=True, kw_only=True)
class SubmitRequest:
    """client -> daemon. Exactly one of prompt, prompt_ids, messages."""

    KIND: ClassVar[MsgKind] = MsgKind.SUBMIT
    request_id: str  # chosen by the client, unique per connection
    prompt: str | None = None
    prompt_ids: np.ndarray | None = array_field(np.int32, 1, optional=True)  # [n]
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stream: bool = True  # False: one TokenEvent with everything at the end
    priority: int = 0  # higher may preempt lower; the daemon accepts -1000..1000
    include_usage: bool = False
    speculation: bool = True  # False: no speculative decoding for it (same tokens, no drafts)
    # OpenAI's `user`: who sent it. Only a synthetic model uses it (its routing key, so the
    # request's tokens do not depend on its slot: docs/synthetic.md); real models ignore it
    user: str | None = None
    # names of sampling's fields (of MODEL_DEFAULT_FIELDS) the client left out: the daemon
    # takes the model's generation defaults for them (the client library lists every one its
    # caller did not give); the fields named here are ignored in `sampling`
    sampling_from_model: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check(0 < len(self.request_id) <= MAX_REQUEST_ID_LEN,
              f"request_id must be 1..{MAX_REQUEST_ID_LEN} chars")
        given = [x is not None for x in (self.prompt, self.prompt_ids, self.messages)]
        check(sum(given) == 1, "give exactly one of prompt, prompt_ids, messages")
        check(self.max_tokens >= 1, "max_tokens must be >= 1")
        check(all(self.stop), "stop strings must be non-empty")
        check(set(self.sampling_from_model) <= set(MODEL_DEFAULT_FIELDS),
              f"sampling_from_model may name only {', '.join(MODEL_DEFAULT_FIELDS)}")


@dataclass(slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(slots=True, kw_only=True)
class TokenEvent:
    """daemon -> client. index counts this request's events from 0; the final event has a
    finish_reason (and usage when asked for)."""

    KIND: ClassVar[MsgKind] = MsgKind.TOKEN_EVENT
    request_id: str
    index: int
    token_ids: list[int]
    text: str  # detokenized delta
    finish_reason: str | None = None
    usage: Usage | None = None

    def __post_init__(self) -> None:
        check(self.finish_reason is None or self.finish_reason in FINISH_REASONS,
              f"finish_reason must be one of {sorted(FINISH_REASONS)} or None")


@dataclass(slots=True, kw_only=True)
class CancelRequest:
    """client -> daemon; the stream then ends with finish_reason "cancelled"."""

    KIND: ClassVar[MsgKind] = MsgKind.CANCEL
    request_id: str


@dataclass(slots=True, kw_only=True)
class StatusRequest:
    KIND: ClassVar[MsgKind] = MsgKind.STATUS_REQUEST
    query_id: str  # echoed in the StatusReply


@dataclass(slots=True, kw_only=True)
class SlotStatus:
    slot: int
    request_id: str | None  # None: idle
    phase: Phase | None
    prompt_done: int
    prompt_len: int
    num_generated: int


@dataclass(slots=True, kw_only=True)
class StatusReply:
    KIND: ClassVar[MsgKind] = MsgKind.STATUS_REPLY
    query_id: str
    model: str
    protocol_version: int
    max_slots: int
    queue_depth: int
    slots: list[SlotStatus] = field(default_factory=list)

    @property
    def active_slots(self) -> int:
        return sum(s.request_id is not None for s in self.slots)


@dataclass(slots=True, kw_only=True)
class ErrorReply:
    """daemon -> client; with a request_id it ends that request's stream."""

    KIND: ClassVar[MsgKind] = MsgKind.ERROR_REPLY
    code: ErrorCode
    message: str
    request_id: str | None = None
    retry_after_s: float | None = None  # QUEUE_FULL
