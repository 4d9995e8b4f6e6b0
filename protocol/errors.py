"""Typed errors of the wire: codec failures (`ProtocolError`) and the client library's
exceptions (`TandemError` and subclasses, one per `ErrorCode` of an `ErrorReply`)."""

from __future__ import annotations

from enum import IntEnum

from protocol.client_messages import ErrorCode, ErrorReply


class ProtocolErrorCode(IntEnum):
    """Why a message could not be encoded or decoded."""

    MALFORMED = 1  # no kind/body frame, kind frame not one byte, body not a msgpack map
    UNKNOWN_KIND = 2  # kind byte names no message
    UNEXPECTED_KIND = 3  # a known kind that this socket role must not receive
    UNKNOWN_FIELD = 4
    MISSING_FIELD = 5
    WRONG_TYPE = 6
    BAD_VALUE = 7  # typed correctly but out of range (enum value, __post_init__ check)
    TOO_LARGE = 8  # body, array frame or whole message over its `Limits`
    TOO_MANY_FRAMES = 9
    BAD_DTYPE = 10  # array dtype not in the allow-list or not the field's dtype
    BAD_SHAPE = 11  # array shape invalid or inconsistent with its buffer's size
    BAD_FRAME_REF = 12  # array frame index out of range, reused, or a frame left unreferenced


class ProtocolError(Exception):
    """A message that breaks the wire contract, with the path of the offending field
    (e.g. `StepPlan.slots[1].input_ids`). `peer` is the ROUTER routing id of the sender
    when a socket wrapper knows it (so the daemon can answer with an ErrorReply), and
    `request_id` the failed message's request id when its body named one."""

    def __init__(self, code: ProtocolErrorCode, detail: str, *, peer: bytes | None = None):
        super().__init__(code, detail)
        self.code = code
        self.detail = detail
        self.path: list[str] = []
        self.peer = peer
        self.request_id: str | None = None

    def at(self, segment: str) -> ProtocolError:
        """Prefix the field path (codec use, while the error climbs out of nested fields)."""
        self.path.insert(0, segment)
        return self

    @property
    def message(self) -> str:
        return f"{''.join(self.path)}: {self.detail}" if self.path else self.detail

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class TandemError(Exception):
    """Base of the client library's errors; `code` is the daemon's `ErrorCode` (None for
    errors raised locally, e.g. timeouts)."""

    code: ErrorCode | None = None

    def __init__(self, message: str, *, request_id: str | None = None):
        super().__init__(message if request_id is None else f"{message} (request {request_id})")
        self.message = message
        self.request_id = request_id


class BadRequestError(TandemError):
    code = ErrorCode.BAD_REQUEST


class QueueFullError(TandemError):
    """The daemon's admission queue is full; retry after `retry_after_s` seconds."""

    code = ErrorCode.QUEUE_FULL

    def __init__(self, message: str, *, request_id: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message, request_id=request_id)
        self.retry_after_s = retry_after_s


class InternalServerError(TandemError):
    """A fault of the daemon (it logged the traceback); also any code this client does not
    know."""

    code = ErrorCode.INTERNAL


class WorkerDiedError(TandemError):
    """The GPU or a CPU worker died while the request was in flight; it may be resubmitted."""

    code = ErrorCode.WORKER_DIED


class ProtocolViolationError(TandemError):
    """The daemon could not decode what this client sent (version skew or a bug)."""

    code = ErrorCode.PROTOCOL


class TandemTimeoutError(TandemError, TimeoutError):
    """No reply or event arrived within the client's timeout."""


_BY_CODE: dict[ErrorCode, type[TandemError]] = {
    cls.code: cls
    for cls in (BadRequestError, QueueFullError, InternalServerError, WorkerDiedError,
                ProtocolViolationError)
    if cls.code is not None
}


def error_from_reply(reply: ErrorReply) -> TandemError:
    """The exception a client raises for an `ErrorReply`."""
    cls = _BY_CODE.get(reply.code, InternalServerError)
    if cls is QueueFullError:
        return QueueFullError(reply.message, request_id=reply.request_id,
                              retry_after_s=reply.retry_after_s)
    return cls(reply.message, request_id=reply.request_id)
