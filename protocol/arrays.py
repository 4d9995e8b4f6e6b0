"""ndarrays on the wire: allowed dtypes, the msgpack ext header `[dtype, shape, where]`,
and the zero-copy conversion to and from ZeroMQ frames."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from protocol.errors import ProtocolError
from protocol.errors import ProtocolErrorCode as E

_EXT_FRAME = 1  # [dtype, shape, frame index]
_EXT_INLINE = 2  # [dtype, shape, raw bytes]
ALLOWED_DTYPES = frozenset(
    np.dtype(t).str
    for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
              np.int64, np.uint64, np.float16, np.float32, np.float64)
)
_DTYPES = {s: np.dtype(s) for s in ALLOWED_DTYPES}

ArraySpec = tuple[str | None, int | None]  # a field's fixed (dtype str, ndim), None = any


@dataclass(slots=True)
class ArrayRef:
    ext: int
    dtype: object
    shape: object
    data: object  # frame index (int) or raw bytes


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def wrong_type(tp: Any, value: Any) -> ProtocolError:
    return ProtocolError(E.WRONG_TYPE, f"expected {type_name(tp)}, got {type(value).__name__}")


@dataclass(slots=True)
class EncodeCtx:
    frames: list[bytes | memoryview]  # kind, body, then one per out-of-band array
    inline_threshold: int


def array_to_wire(arr: Any, spec: ArraySpec, ctx: EncodeCtx) -> msgpack.ExtType:
    if not isinstance(arr, np.ndarray):
        raise wrong_type(np.ndarray, arr)
    check_array_spec(arr.dtype.str, arr.ndim, spec)
    arr = np.ascontiguousarray(arr)  # no-op (no copy) for C-contiguous arrays
    head = [arr.dtype.str, list(arr.shape)]
    if arr.nbytes < ctx.inline_threshold:
        return msgpack.ExtType(_EXT_INLINE, msgpack.packb(head + [arr.tobytes()]))
    ctx.frames.append(memoryview(arr.reshape(-1)).cast("B"))
    return msgpack.ExtType(_EXT_FRAME, msgpack.packb(head + [len(ctx.frames) - 1]))


def check_array_spec(dtype: str, ndim: int, spec: ArraySpec) -> None:
    if dtype not in ALLOWED_DTYPES:
        raise ProtocolError(E.BAD_DTYPE, f"dtype {dtype!r} not allowed")
    if spec[0] is not None and spec[0] != dtype:
        raise ProtocolError(E.BAD_DTYPE, f"dtype {dtype!r}, expected {spec[0]!r}")
    if spec[1] is not None and spec[1] != ndim:
        raise ProtocolError(E.BAD_SHAPE, f"{ndim}-d array, expected {spec[1]}-d")


@dataclass(slots=True)
class DecodeCtx:
    views: list[memoryview]
    max_ndim: int
    used: set[int]


def ext_hook(code: int, data: bytes) -> ArrayRef:
    if code not in (_EXT_FRAME, _EXT_INLINE):
        raise ProtocolError(E.MALFORMED, f"unknown msgpack ext type {code}")
    head = msgpack.unpackb(data, raw=False)
    if type(head) is not list or len(head) != 3:
        raise ProtocolError(E.MALFORMED, "array header is not [dtype, shape, data]")
    return ArrayRef(code, *head)


def array_from_wire(ref: Any, spec: ArraySpec, ctx: DecodeCtx) -> np.ndarray:
    if type(ref) is not ArrayRef:
        raise wrong_type(np.ndarray, ref)
    if type(ref.dtype) is not str:
        raise ProtocolError(E.BAD_DTYPE, "dtype is not a string")
    shape = ref.shape
    if (type(shape) is not list or len(shape) > ctx.max_ndim
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise ProtocolError(E.BAD_SHAPE, f"bad shape {shape!r}")
    check_array_spec(ref.dtype, len(shape), spec)
    if ref.ext == _EXT_FRAME:
        i = ref.data
        if type(i) is not int or not 2 <= i < len(ctx.views) or i in ctx.used:
            raise ProtocolError(E.BAD_FRAME_REF, f"bad or reused frame index {i!r}")
        ctx.used.add(i)
        buf = ctx.views[i]
    elif type(ref.data) is bytes:
        buf = memoryview(ref.data)
    else:
        raise ProtocolError(E.WRONG_TYPE, "inline array data is not bytes")
    dtype = _DTYPES[ref.dtype]
    if math.prod(shape) * dtype.itemsize != buf.nbytes:
        raise ProtocolError(E.BAD_SHAPE, f"shape {shape} of {dtype} needs "
                            f"{math.prod(shape) * dtype.itemsize} bytes, buffer has {buf.nbytes}")
    arr = np.frombuffer(buf, dtype=dtype)
    if len(shape) != 1:
        arr = arr.reshape(shape)
    arr.flags.writeable = False
    return arr
