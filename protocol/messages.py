"""Every message on Tandem's ZeroMQ wires (docs/architecture.md §7), as typed dataclasses.

The messages live in two modules, one per link: `protocol.worker_messages` (daemon <->
gpu_worker) and `protocol.client_messages` (client <-> daemon); kind bytes and directions in
`protocol.kinds`, `SamplingParams` in `protocol.sampling`. This module is their one import
point and the table the codec decodes by (`MESSAGE_TYPES`).
`protocol.codec` encodes them (msgpack body + out-of-band ndarray frames) and checks every
field's type on the way in; `__post_init__` checks values, so a bad message fails loudly at
construction on the sender and as a typed `ProtocolError` on the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from protocol.client_messages import (
    FINISH_REASONS,
    MAX_REQUEST_ID_LEN,
    CancelRequest,
    ChatMessage,
    ErrorCode,
    ErrorReply,
    SlotStatus,
    StatusReply,
    StatusRequest,
    SubmitRequest,
    TokenEvent,
    Usage,
)
from protocol.fields import array_field, token_array, vocab_error
from protocol.kinds import (
    CLIENT_TO_DAEMON,
    DAEMON_TO_CLIENT,
    DAEMON_TO_WORKER,
    PROTOCOL_VERSION,
    WORKER_TO_DAEMON,
    MsgKind,
)
from protocol.sampling import (
    MAX_SEED,
    PENALTIES_OFF,
    SamplingDefaults,
    SamplingParams,
    penalty_error,
)
from protocol.worker_messages import (
    CacheOp,
    CacheOpKind,
    DraftSource,
    Heartbeat,
    KvLayout,
    ModelInfo,
    Phase,
    PromptPhase,
    ReadyMsg,
    Shutdown,
    SlotResult,
    SlotWork,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerErrorCode,
    WorkKind,
)


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


Message = (Ping | Pong | StepPlan | StepResult | ReadyMsg | WorkerError | Heartbeat | Shutdown
           | SubmitRequest | TokenEvent | CancelRequest | StatusRequest | StatusReply | ErrorReply)
MESSAGE_TYPES: dict[MsgKind, type] = {
    cls.KIND: cls
    for cls in (Ping, Pong, StepPlan, StepResult, ReadyMsg, WorkerError, Heartbeat, Shutdown,
                SubmitRequest, TokenEvent, CancelRequest, StatusRequest, StatusReply, ErrorReply)
}
assert len(MESSAGE_TYPES) == len(MsgKind), "every MsgKind needs exactly one message type"

__all__ = [
    "CLIENT_TO_DAEMON", "DAEMON_TO_CLIENT", "DAEMON_TO_WORKER", "FINISH_REASONS", "MAX_SEED",
    "MAX_REQUEST_ID_LEN", "MESSAGE_TYPES", "PENALTIES_OFF", "PROTOCOL_VERSION",
    "WORKER_TO_DAEMON", "CacheOp", "CacheOpKind", "CancelRequest", "ChatMessage", "DraftSource",
    "ErrorCode", "ErrorReply", "Heartbeat", "KvLayout", "Message", "ModelInfo", "MsgKind",
    "Phase", "Ping", "Pong", "PromptPhase", "ReadyMsg", "SamplingDefaults", "SamplingParams",
    "Shutdown", "SlotResult", "SlotStatus", "SlotWork", "StatusReply", "StatusRequest",
    "StepPlan", "StepResult", "SubmitRequest", "TokenEvent", "Usage", "WorkKind", "WorkerError",
    "WorkerErrorCode", "array_field", "penalty_error", "token_array", "vocab_error",
]
