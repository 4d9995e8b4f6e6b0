"""Every message on Tandem's ZeroMQ wires (ARCHITECTURE.md §7), as typed dataclasses.

Four directions, each with its own range of kind bytes (`MsgKind`):
daemon -> gpu_worker 0x10, gpu_worker -> daemon 0x20, client -> daemon 0x30,
daemon -> client 0x40; Ping/Pong (0x01/0x02) are allowed on both links.
`protocol.codec` encodes them (msgpack body + out-of-band ndarray frames) and checks every
field's type on the way in; `__post_init__` checks values, so a bad message fails loudly at
construction on the sender and as a typed `ProtocolError` on the receiver.

NOTE: every field travels on every message (no omitted defaults); adding, removing or
retyping a field bumps PROTOCOL_VERSION. Feature probing goes through ReadyMsg.capabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

import numpy as np

PROTOCOL_VERSION = 1
CAP_PROMPT_PHASE_METADATA = "prompt_phase_metadata"
CAPABILITIES: tuple[str, ...] = (CAP_PROMPT_PHASE_METADATA,)
FINISH_REASONS = frozenset({"stop", "length", "cancelled", "error"})
MAX_REQUEST_ID_LEN = 128


class MsgKind(IntEnum):
    """The kind byte, frame 0 of every message."""

    PING = 0x01
    PONG = 0x02
    # daemon -> gpu_worker
    STEP_PLAN = 0x10
    SHUTDOWN = 0x11
    # gpu_worker -> daemon
    READY = 0x20
    STEP_RESULT = 0x21
    WORKER_ERROR = 0x22
    HEARTBEAT = 0x23
    # client -> daemon
    SUBMIT = 0x30
    CANCEL = 0x31
    STATUS_REQUEST = 0x32
    # daemon -> client
    TOKEN_EVENT = 0x40
    STATUS_REPLY = 0x41
    ERROR_REPLY = 0x42


K = MsgKind
DAEMON_TO_WORKER = frozenset({K.STEP_PLAN, K.SHUTDOWN, K.PING})
WORKER_TO_DAEMON = frozenset({K.READY, K.STEP_RESULT, K.WORKER_ERROR, K.HEARTBEAT, K.PONG})
CLIENT_TO_DAEMON = frozenset({K.SUBMIT, K.CANCEL, K.STATUS_REQUEST, K.PING})
DAEMON_TO_CLIENT = frozenset({K.TOKEN_EVENT, K.STATUS_REPLY, K.ERROR_REPLY, K.PONG})


class WorkKind(IntEnum):
    PREFILL = 1  # a chunk of the prompt
    DECODE = 2  # last committed token, then 0..k drafts


class DraftSource(IntEnum):
    MTP = 1
    SUFFIX = 2


class Phase(IntEnum):
    QUEUED = 0
    PREFILL = 1
    DECODE = 2


class CacheOpKind(IntEnum):
    ALLOCATE = 1  # slot; num_tokens = KV tokens to reserve
    FREE = 2  # slot
    SHARE_PREFIX = 3  # slot <- first num_tokens of src_slot or entry_id, copy-on-write
    CHECKPOINT = 4  # slot's recurrent state (+ KV block refs) at num_tokens -> entry_id
    RESTORE = 5  # entry_id's recurrent state -> slot (position num_tokens)
    SWAP_OUT = 6  # slot's KV blocks and states -> host memory as entry_id; slot freed
    SWAP_IN = 7  # entry_id -> slot; entry consumed
    DROP_CHECKPOINT = 8  # forget entry_id (checkpoint, prefix entry or swapped-out slot)


class WorkerErrorCode(IntEnum):
    INTERNAL = 1
    BAD_PLAN = 2
    OUT_OF_MEMORY = 3
    MODEL_LOAD = 4
    CPU_WORKER_DIED = 5
    PROTOCOL = 6
    VERSION_MISMATCH = 7
    CACHE = 8  # a CacheOp named an unknown slot or entry


class ErrorCode(IntEnum):
    BAD_REQUEST = 1
    TOO_LARGE = 2
    QUEUE_FULL = 3
    UNAUTHORIZED = 4
    INTERNAL = 5
    WORKER_DIED = 6
    PROTOCOL = 7


ERROR_HTTP_STATUS = {
    ErrorCode.BAD_REQUEST: 400, ErrorCode.TOO_LARGE: 413, ErrorCode.QUEUE_FULL: 503,
    ErrorCode.UNAUTHORIZED: 401, ErrorCode.INTERNAL: 500, ErrorCode.WORKER_DIED: 502,
    ErrorCode.PROTOCOL: 400,
}


def array_field(dtype: type, ndim: int, *, empty: bool = False, optional: bool = False):
    """A dataclass field holding an ndarray of exactly this dtype and rank (the codec checks);
    empty: defaults to an empty array; optional: defaults to None."""
    meta = {"dtype": np.dtype(dtype), "ndim": ndim}
    if optional:
        return field(default=None, metadata=meta)
    if empty:
        return field(default_factory=lambda: np.zeros((0,) * ndim, dtype), metadata=meta)
    return field(metadata=meta)


def token_array(ids) -> np.ndarray:
    """Token ids (any int sequence/array) as a contiguous int32 array; refuses out-of-range."""
    arr = np.asarray(ids)
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 2**31 - 1):
        raise ValueError("token ids must be integers in [0, 2**31)")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.int32)


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _check_request_id(rid: str) -> None:
    _check(0 < len(rid) <= MAX_REQUEST_ID_LEN, f"request_id must be 1..{MAX_REQUEST_ID_LEN} chars")


# ---------------------------------------------------------------- shared pieces


MAX_SEED = 2**63 - 1
# penalty -> its "off" value; any other value is refused by both APIs (not implemented yet)
PENALTIES_OFF = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How a request picks its tokens: the one type of the daemon, the wire and the worker
    (gpu_worker/sampling.py applies it)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # None: the daemon picks one (a StepPlan always carries one)
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        fin = math.isfinite
        _check(fin(self.temperature) and self.temperature >= 0, "temperature must be >= 0")
        _check(fin(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(self.top_k >= 0, "top_k must be >= 0 (0 = off)")
        _check(fin(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(self.seed is None or 0 <= self.seed <= MAX_SEED, "seed must be in [0, 2**63)")
        _check(fin(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(fin(v) and -2 <= v <= 2, f"{name} must be in [-2, 2]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def unsupported(self) -> str | None:
        """The first penalty set to anything but off, or None: the daemon refuses such a
        request with :func:`penalty_error` on HTTP and ZeroMQ alike."""
        for name, off in PENALTIES_OFF.items():
            if getattr(self, name) != off:
                return name
        return None


def penalty_error(name: str) -> str:
    """The one message for a penalty that is set (both APIs send it)."""
    return (f"{name} is not implemented yet: leave it out or send {PENALTIES_OFF[name]:g}")


@dataclass(slots=True, kw_only=True)
class PromptPhase:
    """Where a slot's prompt stands after a step (ARCHITECTURE.md §8)."""

    phase: Phase
    prompt_tokens_this_step: int  # 0 unless this step did prompt work for the slot
    prompt_len: int
    cached_len: int  # prompt tokens reused from the prefix cache, never prefilled

    def __post_init__(self) -> None:
        _check(0 <= self.cached_len <= self.prompt_len, "need 0 <= cached_len <= prompt_len")
        _check(0 <= self.prompt_tokens_this_step <= self.prompt_len,
               "prompt_tokens_this_step out of range")


@dataclass(slots=True, kw_only=True)
class Ping:
    """Either link, either way: liveness probe, answered by a Pong with the same nonce."""

    KIND: ClassVar[MsgKind] = MsgKind.PING
    nonce: int
    time_ns: int  # sender's time.monotonic_ns()


@dataclass(slots=True, kw_only=True)
class Pong:
    KIND: ClassVar[MsgKind] = MsgKind.PONG
    nonce: int
    time_ns: int  # copied from the Ping


# ---------------------------------------------------------------- daemon <-> gpu_worker


@dataclass(slots=True, kw_only=True)
class SlotWork:
    """One slot's rows in a step: input_ids, then draft_ids, at positions start_pos...

    Rows = num_tokens + len(draft_ids). For decode, input_ids is the last committed token.
    """

    slot: int
    request_id: str
    kind: WorkKind
    input_ids: np.ndarray = array_field(np.int32, 1)  # [num_tokens]
    start_pos: int  # absolute position of input_ids[0]
    num_tokens: int
    needs_logits: bool  # sample after the last row; False for a non-final prefill chunk
    sampling: SamplingParams = field(default_factory=SamplingParams)
    draft_ids: np.ndarray = array_field(np.int32, 1, empty=True)  # [k]
    draft_sources: np.ndarray = array_field(np.uint8, 1, empty=True)  # [k] DraftSource
    prompt_len: int
    cached_len: int = 0
    mtp_drafts: int = 0  # keep the slot's MTP state and propose this many drafts after it

    def __post_init__(self) -> None:
        _check(self.slot >= 0 and self.start_pos >= 0, "slot and start_pos must be >= 0")
        _check(0 <= self.mtp_drafts <= 64, "mtp_drafts must be in 0..64")
        _check(self.num_tokens == len(self.input_ids) > 0,
               "num_tokens must equal len(input_ids) > 0")
        _check(len(self.draft_ids) == len(self.draft_sources), "one draft source per draft")
        _check(self.kind == WorkKind.DECODE or len(self.draft_ids) == 0, "drafts only in decode")
        _check(0 <= self.cached_len <= self.prompt_len, "need 0 <= cached_len <= prompt_len")
        _check(self.sampling.seed is not None, "the daemon resolves the seed before planning")

    @property
    def num_rows(self) -> int:
        return self.num_tokens + len(self.draft_ids)


_OP_NEEDS = {  # op -> (needs slot, needs entry_id)
    CacheOpKind.ALLOCATE: (True, False), CacheOpKind.FREE: (True, False),
    CacheOpKind.CHECKPOINT: (True, True), CacheOpKind.RESTORE: (True, True),
    CacheOpKind.SWAP_OUT: (True, True), CacheOpKind.SWAP_IN: (True, True),
    CacheOpKind.DROP_CHECKPOINT: (False, True),
}


@dataclass(slots=True, kw_only=True)
class CacheOp:
    """A cache command; entry ids (checkpoints, prefix entries, swap handles) are the daemon's."""

    op: CacheOpKind
    slot: int | None = None
    num_tokens: int = 0
    src_slot: int | None = None
    entry_id: int | None = None

    def __post_init__(self) -> None:
        _check(self.num_tokens >= 0, "num_tokens must be >= 0")
        if self.op == CacheOpKind.SHARE_PREFIX:
            _check(self.slot is not None and self.num_tokens > 0,
                   "SHARE_PREFIX needs slot and num_tokens > 0")
            _check((self.src_slot is None) != (self.entry_id is None),
                   "SHARE_PREFIX needs exactly one of src_slot, entry_id")
            return
        need_slot, need_entry = _OP_NEEDS[self.op]
        _check((self.slot is not None) == need_slot, f"{self.op.name}: slot {need_slot=}")
        _check((self.entry_id is not None) == need_entry, f"{self.op.name}: entry_id {need_entry=}")
        _check(self.src_slot is None, f"{self.op.name} takes no src_slot")


@dataclass(slots=True, kw_only=True)
class StepPlan:
    """daemon -> worker: run cache_ops, one forward over all slots' rows (narrow speculation:
    one more per drafted slot), then cache_ops_after."""

    KIND: ClassVar[MsgKind] = MsgKind.STEP_PLAN
    step_id: int
    slots: list[SlotWork] = field(default_factory=list)
    cache_ops: list[CacheOp] = field(default_factory=list)
    cache_ops_after: list[CacheOp] = field(default_factory=list)  # e.g. end-of-prompt checkpoint
    wide: bool = True  # drafted slots in the one forward pass; False: one pass each (narrow)

    def __post_init__(self) -> None:
        ids = [s.slot for s in self.slots]
        _check(len(ids) == len(set(ids)), "a slot appears twice in one StepPlan")

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.slots)


@dataclass(slots=True, kw_only=True)
class SlotResult:
    slot: int
    request_id: str
    token_ids: list[int]  # accepted drafts + one sampled token; [] if nothing was sampled
    num_accepted: int  # drafts accepted
    prompt: PromptPhase | None  # None only from a worker without prompt_phase_metadata
    logprobs: list[float] | None = None  # one per token_ids entry
    drafts: list[int] = field(default_factory=list)  # MTP drafts for the slot's next step

    def __post_init__(self) -> None:
        _check(0 <= self.num_accepted <= max(len(self.token_ids) - 1, 0), "num_accepted too big")
        _check(self.logprobs is None or len(self.logprobs) == len(self.token_ids),
               "one logprob per token")


@dataclass(slots=True, kw_only=True)
class StepResult:
    """worker -> daemon, one per StepPlan."""

    KIND: ClassVar[MsgKind] = MsgKind.STEP_RESULT
    step_id: int
    slots: list[SlotResult] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)  # "forward", "cpu_experts", ...
    counters: dict[str, int] = field(default_factory=dict)  # "rows", "gpu_experts", ...


@dataclass(slots=True, kw_only=True)
class ModelInfo:
    name: str
    vocab_size: int
    max_slots: int
    kv_capacity_tokens: int
    max_seq_len: int
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class ReadyMsg:
    """worker -> daemon once, after the model is loaded and the CPU expert workers are up."""

    KIND: ClassVar[MsgKind] = MsgKind.READY
    protocol_version: int
    capabilities: list[str]
    model: ModelInfo
    pid: int

    def supports(self, capability: str) -> bool:
        """Whether the worker has `capability`; the daemon falls back when it lacks one."""
        return capability in self.capabilities


@dataclass(slots=True, kw_only=True)
class WorkerError:
    """worker -> daemon. fatal: the worker exits after sending it."""

    KIND: ClassVar[MsgKind] = MsgKind.WORKER_ERROR
    code: WorkerErrorCode
    message: str
    fatal: bool = False
    step_id: int | None = None
    request_id: str | None = None
    slot: int | None = None


@dataclass(slots=True, kw_only=True)
class Heartbeat:
    """worker -> daemon every heartbeat interval, also while a step runs."""

    KIND: ClassVar[MsgKind] = MsgKind.HEARTBEAT
    seq: int
    time_ns: int
    busy_step_id: int | None = None


@dataclass(slots=True, kw_only=True)
class Shutdown:
    """daemon -> worker. graceful: finish the current step, then exit."""

    KIND: ClassVar[MsgKind] = MsgKind.SHUTDOWN
    reason: str = ""
    graceful: bool = True


# ---------------------------------------------------------------- client <-> daemon


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
    priority: int = 0  # higher may preempt lower
    include_usage: bool = False

    def __post_init__(self) -> None:
        _check_request_id(self.request_id)
        given = [x is not None for x in (self.prompt, self.prompt_ids, self.messages)]
        _check(sum(given) == 1, "give exactly one of prompt, prompt_ids, messages")
        _check(self.max_tokens >= 1, "max_tokens must be >= 1")
        _check(all(self.stop), "stop strings must be non-empty")


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
        _check(self.finish_reason is None or self.finish_reason in FINISH_REASONS,
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


Message = (Ping | Pong | StepPlan | StepResult | ReadyMsg | WorkerError | Heartbeat | Shutdown
           | SubmitRequest | TokenEvent | CancelRequest | StatusRequest | StatusReply | ErrorReply)
MESSAGE_TYPES: dict[MsgKind, type] = {
    cls.KIND: cls
    for cls in (Ping, Pong, StepPlan, StepResult, ReadyMsg, WorkerError, Heartbeat, Shutdown,
                SubmitRequest, TokenEvent, CancelRequest, StatusRequest, StatusReply, ErrorReply)
}
assert len(MESSAGE_TYPES) == len(MsgKind), "every MsgKind needs exactly one message type"
