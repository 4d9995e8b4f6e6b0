"""Converters between message dataclasses and plain msgpack values, compiled once per type
from the dataclass type hints: exact types, no unknown or missing fields, `X | None`,
list[X], dict[str, X], IntEnum, nested dataclasses and ndarrays (see protocol.arrays)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import numpy as np

from protocol.arrays import ArraySpec, array_from_wire, array_to_wire, wrong_type
from protocol.errors import ProtocolError
from protocol.errors import ProtocolErrorCode as E

Conv = Callable[[Any, Any], Any]  # (value, context) -> converted value


def _array_spec(meta: Any) -> ArraySpec:
    return (meta["dtype"].str if "dtype" in meta else None, meta.get("ndim"))


def _optional_arg(tp: Any) -> Any | None:
    """X for `X | None`, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"only `X | None` unions are supported, not {tp}")
        return args[0]
    return None


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any, ArraySpec], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name], _array_spec(f.metadata))
                 for f in dataclasses.fields(cls))


# Converters are compiled once per (type, array spec) from the dataclass type hints. The
# same shapes serve both directions; `_compile(tp, spec, to_wire)` returns a function of
# (value, ctx) where ctx is an EncodeCtx (frames being built) or a DecodeCtx.
# Errors climb out through ProtocolError.at(), which records the field path.


@functools.cache
def _compile(tp: Any, spec: ArraySpec, to_wire: bool) -> Conv:
    inner = _optional_arg(tp)
    if inner is not None:
        conv = _compile(inner, spec, to_wire)
        return lambda v, ctx: None if v is None else conv(v, ctx)
    if tp is np.ndarray:
        if to_wire:
            return lambda v, ctx: array_to_wire(v, spec, ctx)
        return lambda v, ctx: array_from_wire(v, spec, ctx)
    if dataclasses.is_dataclass(tp):
        return _compile_dataclass(tp, to_wire)
    origin = typing.get_origin(tp)
    if origin is list:
        return _compile_list(_compile(typing.get_args(tp)[0], (None, None), to_wire), to_wire)
    if origin is dict:
        return _compile_dict(_compile(typing.get_args(tp)[1], (None, None), to_wire), to_wire)
    if tp in (int, float, str, bool) or (isinstance(tp, type) and issubclass(tp, IntEnum)):
        return _compile_scalar(tp, to_wire)
    raise TypeError(f"no wire form for {tp}")


def _compile_dataclass(cls: type, to_wire: bool) -> Conv:
    fields = [(name, _compile(ftp, spec, to_wire)) for name, ftp, spec in _fields(cls)]
    names = frozenset(name for name, _ in fields)

    def encode_dc(value: Any, ctx: Any) -> dict:
        if type(value) is not cls:
            raise wrong_type(cls, value)
        out = {}
        for name, conv in fields:
            try:
                out[name] = conv(getattr(value, name), ctx)
            except ProtocolError as exc:
                raise exc.at(f".{name}") from None
        return out

    def decode_dc(value: Any, ctx: Any) -> Any:
        if type(value) is not dict:
            raise ProtocolError(E.WRONG_TYPE, f"expected a {cls.__name__} map, "
                                f"got {type(value).__name__}")
        if value.keys() != names:
            unknown = [k for k in value if k not in names]
            if unknown:
                raise ProtocolError(E.UNKNOWN_FIELD, f"unknown field(s) {unknown}")
            missing = sorted(names - value.keys())
            raise ProtocolError(E.MISSING_FIELD, f"missing field(s) {missing}")
        kwargs = {}
        for name, conv in fields:
            try:
                kwargs[name] = conv(value[name], ctx)
            except ProtocolError as exc:
                raise exc.at(f".{name}") from None
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:
            raise ProtocolError(E.BAD_VALUE, str(exc)) from None

    return encode_dc if to_wire else decode_dc


def _compile_list(item: Conv, to_wire: bool) -> Conv:
    kinds = (list, tuple) if to_wire else (list,)

    def conv_list(value: Any, ctx: Any) -> list:
        if type(value) not in kinds:
            raise ProtocolError(E.WRONG_TYPE, f"expected a list, got {type(value).__name__}")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(item(v, ctx))
            except ProtocolError as exc:
                raise exc.at(f"[{i}]") from None
        return out

    return conv_list


def _compile_dict(item: Conv, to_wire: bool) -> Conv:
    def conv_dict(value: Any, ctx: Any) -> dict:
        if type(value) is not dict:
            raise ProtocolError(E.WRONG_TYPE, f"expected a map, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise ProtocolError(E.WRONG_TYPE, f"map key {k!r} is not a str")
            try:
                out[k] = item(v, ctx)
            except ProtocolError as exc:
                raise exc.at(f"[{k!r}]") from None
        return out

    return conv_dict


def _compile_scalar(tp: Any, to_wire: bool) -> Conv:
    """Exact Python types on the wire; the encoder also takes numpy scalars. A bool is
    never an int here, an int is a fine float."""
    is_enum = tp not in (int, float, str, bool)

    def conv(value: Any, ctx: Any) -> Any:
        t = type(value)
        if to_wire and isinstance(value, np.generic):
            value = value.item()  # numpy scalar -> bool / int / float / ...
            t = type(value)
        if is_enum:
            if t is int or isinstance(value, tp):
                try:
                    member = tp(value)
                except ValueError:
                    raise ProtocolError(E.BAD_VALUE, f"{value} is not a {tp.__name__}") from None
                return int(member) if to_wire else member
        elif t is tp:
            return value
        elif tp is float and t is int:
            return float(value)
        raise wrong_type(tp, value)

    return conv


def converter(cls: type, to_wire: bool) -> Conv:
    """The compiled converter of message type `cls`, for encoding (to_wire) or decoding."""
    return _compile(cls, (None, None), to_wire)
