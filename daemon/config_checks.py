"""Value checks for the config sections: each raises ConfigError("<section>.<key>: ...")."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NoReturn


class ConfigError(ValueError):
    """A bad config file or value; the message names the key."""


def fail(key: str, message: str, value: Any) -> NoReturn:
    raise ConfigError(f"{key}: {message}, got {value!r}")


def check_int(key: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        fail(key, "must be an integer", value)
    if lo is not None and value < lo:
        fail(key, f"must be >= {lo}", value)
    if hi is not None and value > hi:
        fail(key, f"must be <= {hi}", value)


def check_num(key: str, value: Any, lo: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        fail(key, "must be a finite number", value)
    if value < lo:
        fail(key, f"must be >= {lo}", value)


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        fail(key, "must be true or false", value)


def check_str(key: str, value: Any, choices: tuple[str, ...] = (), empty: bool = False) -> None:
    if not isinstance(value, str):
        fail(key, "must be a string", value)
    if choices and value not in choices:
        fail(key, "must be one of " + ", ".join(repr(c) for c in choices), value)
    if not empty and not value:
        fail(key, "must not be empty", value)


def check_path(key: str, value: Any) -> None:
    if not isinstance(value, Path):
        fail(key, "must be a path", value)


def check_strs(key: str, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        fail(key, "must be a list of non-empty strings", value)
