"""Building blocks of the message dataclasses: value checks, ndarray fields, token ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any

import numpy as np


def check(cond: bool, what: str) -> None:
    """A message's value check (in ``__post_init__``): ValueError, which the codec turns
    into ``ProtocolError(BAD_VALUE)`` on the receiver."""
    if not cond:
        raise ValueError(what)


def array_field(dtype: type, ndim: int, *, empty: bool = False, optional: bool = False) -> Any:
    """A dataclass field holding an ndarray of exactly this dtype and rank (the codec checks);
    empty: defaults to an empty array; optional: defaults to None."""
    meta = {"dtype": np.dtype(dtype), "ndim": ndim}
    if optional:
        return field(default=None, metadata=meta)
    if empty:
        return field(default_factory=lambda: np.zeros((0,) * ndim, dtype), metadata=meta)
    return field(metadata=meta)


def token_array(ids: Any) -> np.ndarray:
    """Token ids (any int sequence/array) as a contiguous int32 array; refuses out-of-range."""
    arr = np.asarray(ids)
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 2**31 - 1):
        raise ValueError("token ids must be integers in [0, 2**31)")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.int32)


def vocab_error(ids: Sequence[int], vocab_size: int | None) -> str | None:
    """The one message for prompt ids the model cannot embed (both APIs send it), or None:
    a negative id, or one >= vocab_size (when known). The worker would fail on such an id,
    so the daemon refuses it at admission."""
    if not len(ids):
        return None
    low, top = min(int(i) for i in ids), max(int(i) for i in ids)
    if low < 0:
        return f"token id {low} is out of range: token ids must be >= 0"
    if vocab_size is not None and top >= vocab_size:
        return f"token id {top} is out of range: the vocabulary has {vocab_size} tokens"
    return None
