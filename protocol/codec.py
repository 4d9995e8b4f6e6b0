"""Messages <-> ZeroMQ frames: `[kind byte, msgpack body, raw array buffers...]`.

The body is a msgpack map of every field of the message (nested dataclasses are maps too).
An ndarray is a msgpack ext value `[dtype str, shape, frame index]` whose buffer is its own
frame (sent with copy=False), or, below `inline_threshold` bytes, `[dtype, shape, bytes]`
inside the body. Decoding walks the dataclass type hints (protocol.schema), so unknown
kinds, unknown or missing fields, wrong types, bad dtypes/shapes and oversized frames all
become a typed `ProtocolError`. No pickle, no import-by-name: only `MESSAGE_TYPES` exist.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.arrays import ALLOWED_DTYPES, DecodeCtx, EncodeCtx, ext_hook
from protocol.errors import ProtocolError
from protocol.errors import ProtocolErrorCode as E
from protocol.messages import MESSAGE_TYPES, Message, MsgKind
from protocol.schema import converter

__all__ = ["ALLOWED_DTYPES", "DEFAULT_LIMITS", "INLINE_THRESHOLD", "Limits", "decode", "encode"]

INLINE_THRESHOLD = 256  # bytes; smaller arrays ride inside the body
Frame = bytes | memoryview


@dataclass(frozen=True, slots=True)
class Limits:
    """What a receiver accepts. A socket's zmq.MAXMSGSIZE is `max_part_bytes`: bigger parts
    make libzmq drop the connection before the codec ever sees them."""

    max_frames: int = 1024
    max_body_bytes: int = 16 << 20
    max_frame_bytes: int = 64 << 20  # one array buffer
    max_total_bytes: int = 256 << 20
    max_ndim: int = 8

    @property
    def max_part_bytes(self) -> int:
        return max(self.max_body_bytes, self.max_frame_bytes)


DEFAULT_LIMITS = Limits()


# ---------------------------------------------------------------- encode


def encode(msg: Message, *, inline_threshold: int = INLINE_THRESHOLD) -> list[Frame]:
    """Frames for `msg`. NOTE: array frames are views of the message's arrays (zero copy):
    do not mutate those arrays until the frames have been sent."""
    cls = type(msg)
    kind = getattr(cls, "KIND", None)
    if MESSAGE_TYPES.get(kind) is not cls:
        raise ProtocolError(E.UNKNOWN_KIND, f"{cls.__name__} is not a wire message")
    ctx = EncodeCtx([bytes([kind]), b""], inline_threshold)
    try:
        body = converter(cls, True)(msg, ctx)
    except ProtocolError as exc:
        raise exc.at(cls.__name__) from None
    ctx.frames[1] = msgpack.packb(body, use_bin_type=True)
    return ctx.frames


# ---------------------------------------------------------------- decode


def decode(frames: Sequence[Any], *, limits: Limits = DEFAULT_LIMITS,
           allowed: Collection[MsgKind] | None = None) -> Message:
    """The message in `frames` (bytes, memoryviews or zmq.Frame objects), fully checked.

    NOTE: decoded arrays are read-only views of the received frames (np.frombuffer, no
    copy). Each keeps its frame alive through `.base`, so it stays valid as long as it is
    referenced; treat it as borrowed for the handling of this message and np.array() what
    you keep or want to mutate.
    """
    if len(frames) < 2:
        raise ProtocolError(E.MALFORMED, f"{len(frames)} frames; need kind and body")
    if len(frames) > limits.max_frames:
        raise ProtocolError(E.TOO_MANY_FRAMES, f"{len(frames)} frames > {limits.max_frames}")
    views = [_bytes_view(f) for f in frames]
    if views[0].nbytes != 1:
        raise ProtocolError(E.MALFORMED, f"kind frame is {views[0].nbytes} bytes, expected 1")
    try:
        kind = MsgKind(views[0][0])
    except ValueError:
        raise ProtocolError(E.UNKNOWN_KIND, f"unknown kind byte 0x{views[0][0]:02x}") from None
    cls = MESSAGE_TYPES[kind]
    try:
        if allowed is not None and kind not in allowed:
            raise ProtocolError(E.UNEXPECTED_KIND, "not accepted on this socket")
        _check_sizes(views, limits)
        try:
            body = msgpack.unpackb(views[1], raw=False, strict_map_key=True,
                                   ext_hook=ext_hook)
        except ProtocolError:
            raise
        except Exception as exc:  # msgpack raises a zoo of ValueError/TypeError subclasses
            raise ProtocolError(E.MALFORMED, f"body is not msgpack ({exc})") from None
        if type(body) is not dict:
            raise ProtocolError(E.MALFORMED, "body is not a msgpack map")
        ctx = DecodeCtx(views, limits.max_ndim, set())
        msg = converter(cls, False)(body, ctx)
        if len(ctx.used) != len(views) - 2:
            unused = sorted(set(range(2, len(views))) - ctx.used)
            raise ProtocolError(E.BAD_FRAME_REF, f"frames {unused} not referenced")
    except ProtocolError as exc:
        raise exc.at(cls.__name__) from None
    return msg


def _bytes_view(frame: Any) -> memoryview:
    view = memoryview(frame)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _check_sizes(views: list[memoryview], limits: Limits) -> None:
    if views[1].nbytes > limits.max_body_bytes:
        raise ProtocolError(E.TOO_LARGE, f"body {views[1].nbytes} bytes "
                            f"> {limits.max_body_bytes}")
    for i, v in enumerate(views[2:], start=2):
        if v.nbytes > limits.max_frame_bytes:
            raise ProtocolError(E.TOO_LARGE, f"frame {i} is {v.nbytes} bytes "
                                f"> {limits.max_frame_bytes}")
    total = sum(v.nbytes for v in views)
    if total > limits.max_total_bytes:
        raise ProtocolError(E.TOO_LARGE, f"{total} bytes > {limits.max_total_bytes}")
