"""The kind byte of every wire message and which way each kind may travel.

Four directions, each with its own range of kind bytes: daemon -> gpu_worker 0x10,
gpu_worker -> daemon 0x20, client -> daemon 0x30, daemon -> client 0x40; Ping/Pong
(0x01/0x02) are allowed on both links. `protocol.sockets` checks every send and receive
against these sets.
"""

from __future__ import annotations

from enum import IntEnum

# NOTE: every field travels on every message (no omitted defaults); adding, removing or
# retyping a field bumps PROTOCOL_VERSION, and the daemon refuses a worker of another version.
PROTOCOL_VERSION = 8


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
