"""Messages <-> ZeroMQ frames: `[kind byte, msgpack body, raw array buffers...]`.

The body is a msgpack map of every field of the message (nested dataclasses are maps too).
An ndarray is a msgpack ext value `[dtype str, shape, frame index]` whose buffer is its own
frame (sent with copy=False), or, below `inline_threshold` bytes, `[dtype, shape, bytes]`
inside the body. Decoding walks the dataclass type hints, so unknown kinds, unknown or
missing fields, wrong types, bad dtypes/shapes and oversized frames all become a typed
`ProtocolError`. No pickle, no import-by-name: only the types in `MESSAGE_TYPES` exist.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np

from protocol.errors import ProtocolError
from protocol.errors import ProtocolErrorCode as E
from protocol.messages import MESSAGE_TYPES, Message, MsgKind

_EXT_FRAME = 1  # [dtype, shape, frame index]
_EXT_INLINE = 2  # [dtype, shape, raw bytes]
INLINE_THRESHOLD = 256  # bytes; smaller arrays ride inside the body
ALLOWED_DTYPES = frozenset(
    np.dtype(t).str
    for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
              np.int64, np.uint64, np.float16, np.float32, np.float64)
)

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


@dataclass(slots=True)
class _ArrayRef:
    ext: int
    dtype: object
    shape: object
    data: object  # frame index (int) or raw bytes


@functools.cache
def _schema(cls: type) -> dict[str, tuple[Any, dict]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], dict(f.metadata)) for f in dataclasses.fields(cls)}


def _optional_arg(tp: Any) -> Any | None:
    """X for `X | None`, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"only `X | None` unions are supported, not {tp}")
        return args[0]
    return None


def _fail(code: E, path: str, what: str) -> typing.NoReturn:
    raise ProtocolError(code, f"{path}: {what}")


# ---------------------------------------------------------------- encode


def encode(msg: Message, *, inline_threshold: int = INLINE_THRESHOLD) -> list[Frame]:
    """Frames for `msg`. NOTE: array frames are views of the message's arrays (zero copy):
    do not mutate those arrays until the frames have been sent."""
    cls = type(msg)
    kind = getattr(cls, "KIND", None)
    if MESSAGE_TYPES.get(kind) is not cls:
        raise ProtocolError(E.UNKNOWN_KIND, f"{cls.__name__} is not a wire message")
    frames: list[Frame] = [bytes([kind]), b""]
    body = _to_wire(msg, cls, cls.__name__, {}, frames, inline_threshold)
    frames[1] = msgpack.packb(body, use_bin_type=True)
    return frames


def _to_wire(value: Any, tp: Any, path: str, meta: dict, frames: list[Frame], inline: int) -> Any:
    inner = _optional_arg(tp)
    if inner is not None:
        return None if value is None else _to_wire(value, inner, path, meta, frames, inline)
    if tp is np.ndarray:
        return _array_to_wire(value, path, meta, frames, inline)
    if dataclasses.is_dataclass(tp):
        if type(value) is not tp:
            _fail(E.WRONG_TYPE, path, f"expected {tp.__name__}, got {type(value).__name__}")
        return {name: _to_wire(getattr(value, name), ftp, f"{path}.{name}", fmeta, frames, inline)
                for name, (ftp, fmeta) in _schema(tp).items()}
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list | tuple):
            _fail(E.WRONG_TYPE, path, f"expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_to_wire(v, item, f"{path}[{i}]", {}, frames, inline) for i, v in enumerate(value)]
    if origin is dict:
        _, vt = typing.get_args(tp)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            _fail(E.WRONG_TYPE, path, "expected a dict with str keys")
        return {k: _to_wire(v, vt, f"{path}[{k!r}]", {}, frames, inline) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, IntEnum):
        return int(_scalar(value, tp, path))
    return _scalar(value, tp, path)


def _array_to_wire(arr: Any, path: str, meta: dict, frames: list[Frame], inline: int) -> Any:
    if not isinstance(arr, np.ndarray):
        _fail(E.WRONG_TYPE, path, f"expected an ndarray, got {type(arr).__name__}")
    _check_array_meta(arr.dtype.str, arr.ndim, path, meta)
    arr = np.ascontiguousarray(arr)  # no-op (no copy) for C-contiguous arrays
    head = [arr.dtype.str, list(arr.shape)]
    if arr.nbytes < inline:
        return msgpack.ExtType(_EXT_INLINE, msgpack.packb(head + [arr.tobytes()]))
    frames.append(memoryview(arr.reshape(-1)).cast("B"))
    return msgpack.ExtType(_EXT_FRAME, msgpack.packb(head + [len(frames) - 1]))


def _check_array_meta(dtype: str, ndim: int, path: str, meta: dict) -> None:
    if dtype not in ALLOWED_DTYPES:
        _fail(E.BAD_DTYPE, path, f"dtype {dtype!r} not allowed")
    if "dtype" in meta and meta["dtype"].str != dtype:
        _fail(E.BAD_DTYPE, path, f"dtype {dtype!r}, expected {meta['dtype'].str!r}")
    if "ndim" in meta and meta["ndim"] != ndim:
        _fail(E.BAD_SHAPE, path, f"{ndim}-d array, expected {meta['ndim']}-d")


def _scalar(value: Any, tp: Any, path: str) -> Any:
    """A Python scalar of type tp; accepts numpy scalars; bool is never an int here."""
    if tp is bool and isinstance(value, bool | np.bool_):
        return bool(value)
    if tp is str and isinstance(value, str):
        return value
    if isinstance(value, bool | np.bool_):
        pass
    elif tp is int and isinstance(value, int | np.integer):
        return int(value)
    elif tp is float and isinstance(value, float | int | np.floating | np.integer):
        return float(value)
    elif isinstance(tp, type) and issubclass(tp, IntEnum) and isinstance(value, int | np.integer):
        try:
            return tp(int(value))
        except ValueError:
            _fail(E.BAD_VALUE, path, f"{value} is not a {tp.__name__}")
    name = getattr(tp, "__name__", str(tp))
    _fail(E.WRONG_TYPE, path, f"expected {name}, got {type(value).__name__}")


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
    if allowed is not None and kind not in allowed:
        raise ProtocolError(E.UNEXPECTED_KIND, f"{cls.__name__} is not accepted here")
    _check_sizes(views, limits, cls.__name__)
    try:
        body = msgpack.unpackb(views[1], raw=False, strict_map_key=True, ext_hook=_ext_hook)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises a zoo of ValueError/TypeError subclasses
        raise ProtocolError(E.MALFORMED, f"{cls.__name__}: body is not msgpack ({exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError(E.MALFORMED, f"{cls.__name__}: body is not a msgpack map")
    used: set[int] = set()
    msg = _from_wire(body, cls, cls.__name__, {}, _DecodeCtx(views, limits, used))
    if len(used) != len(views) - 2:
        unused = sorted(set(range(2, len(views))) - used)
        raise ProtocolError(E.BAD_FRAME_REF, f"{cls.__name__}: frames {unused} not referenced")
    return msg


@dataclass(slots=True)
class _DecodeCtx:
    views: list[memoryview]
    limits: Limits
    used: set[int]


def _bytes_view(frame: Any) -> memoryview:
    view = memoryview(frame)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _check_sizes(views: list[memoryview], limits: Limits, name: str) -> None:
    if views[1].nbytes > limits.max_body_bytes:
        raise ProtocolError(E.TOO_LARGE, f"{name}: body {views[1].nbytes} bytes "
                            f"> {limits.max_body_bytes}")
    for i, v in enumerate(views[2:], start=2):
        if v.nbytes > limits.max_frame_bytes:
            raise ProtocolError(E.TOO_LARGE, f"{name}: frame {i} is {v.nbytes} bytes "
                                f"> {limits.max_frame_bytes}")
    total = sum(v.nbytes for v in views)
    if total > limits.max_total_bytes:
        raise ProtocolError(E.TOO_LARGE, f"{name}: {total} bytes > {limits.max_total_bytes}")


def _ext_hook(code: int, data: bytes) -> _ArrayRef:
    if code not in (_EXT_FRAME, _EXT_INLINE):
        raise ProtocolError(E.MALFORMED, f"unknown msgpack ext type {code}")
    head = msgpack.unpackb(data, raw=False)
    if not isinstance(head, list) or len(head) != 3:
        raise ProtocolError(E.MALFORMED, "array header is not [dtype, shape, data]")
    return _ArrayRef(code, *head)


def _from_wire(value: Any, tp: Any, path: str, meta: dict, ctx: _DecodeCtx) -> Any:
    inner = _optional_arg(tp)
    if inner is not None:
        return None if value is None else _from_wire(value, inner, path, meta, ctx)
    if isinstance(value, _ArrayRef) and tp is not np.ndarray:
        _fail(E.WRONG_TYPE, path, "unexpected array")
    if tp is np.ndarray:
        return _array_from_wire(value, path, meta, ctx)
    if dataclasses.is_dataclass(tp):
        return _dataclass_from_wire(value, tp, path, ctx)
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            _fail(E.WRONG_TYPE, path, f"expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_from_wire(v, item, f"{path}[{i}]", {}, ctx) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            _fail(E.WRONG_TYPE, path, "expected a map with str keys")
        _, vt = typing.get_args(tp)
        return {k: _from_wire(v, vt, f"{path}[{k!r}]", {}, ctx) for k, v in value.items()}
    return _scalar(value, tp, path)


def _dataclass_from_wire(value: Any, cls: type, path: str, ctx: _DecodeCtx) -> Any:
    if not isinstance(value, dict):
        _fail(E.WRONG_TYPE, path, f"expected a {cls.__name__} map, got {type(value).__name__}")
    schema = _schema(cls)
    unknown = [k for k in value if k not in schema]
    if unknown:
        _fail(E.UNKNOWN_FIELD, path, f"unknown field(s) {unknown}")
    missing = [k for k in schema if k not in value]
    if missing:
        _fail(E.MISSING_FIELD, path, f"missing field(s) {missing}")
    kwargs = {name: _from_wire(value[name], ftp, f"{path}.{name}", fmeta, ctx)
              for name, (ftp, fmeta) in schema.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        _fail(E.BAD_VALUE, path, str(exc))


def _array_from_wire(ref: Any, path: str, meta: dict, ctx: _DecodeCtx) -> np.ndarray:
    if not isinstance(ref, _ArrayRef):
        _fail(E.WRONG_TYPE, path, f"expected an array, got {type(ref).__name__}")
    if not isinstance(ref.dtype, str):
        _fail(E.BAD_DTYPE, path, "dtype is not a string")
    shape = ref.shape
    if (not isinstance(shape, list) or len(shape) > ctx.limits.max_ndim
            or not all(type(d) is int and d >= 0 for d in shape)):
        _fail(E.BAD_SHAPE, path, f"bad shape {shape!r}")
    _check_array_meta(ref.dtype, len(shape), path, meta)
    if ref.ext == _EXT_FRAME:
        i = ref.data
        if type(i) is not int or not 2 <= i < len(ctx.views) or i in ctx.used:
            _fail(E.BAD_FRAME_REF, path, f"bad or reused frame index {i!r}")
        ctx.used.add(i)
        buf = ctx.views[i]
    elif isinstance(ref.data, bytes):
        buf = memoryview(ref.data)
    else:
        _fail(E.WRONG_TYPE, path, "inline array data is not bytes")
    dtype = np.dtype(ref.dtype)
    if math.prod(shape) * dtype.itemsize != buf.nbytes:
        _fail(E.BAD_SHAPE, path, f"shape {shape} of {dtype} needs "
              f"{math.prod(shape) * dtype.itemsize} bytes, buffer has {buf.nbytes}")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    arr.flags.writeable = False
    return arr
