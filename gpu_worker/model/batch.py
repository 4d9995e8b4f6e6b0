"""A ragged batch: rows of several slots, each slot a contiguous run of positions."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """``num`` consecutive tokens of ``slot`` at absolute positions start..start+num-1,
    occupying batch rows row0..row0+num-1. ``route_key``: what a synthetic model routes the
    rows by (SlotWork.route_key; the slot by default)."""

    slot: int
    start: int
    num: int
    row0: int
    route_key: int

    @property
    def rows(self) -> slice:
        return slice(self.row0, self.row0 + self.num)

    @property
    def end(self) -> int:
        return self.start + self.num


@dataclasses.dataclass(frozen=True, slots=True)
class RaggedBatch:
    tokens: np.ndarray  # [R] int64
    positions: np.ndarray  # [R] int64
    segments: tuple[Segment, ...]

    @classmethod
    def build(cls, parts: list[tuple[int, int, list[int] | np.ndarray]],
              route_keys: Mapping[int, int | None] | None = None) -> RaggedBatch:
        """``parts``: (slot, start position, token ids) per slot; one segment per slot.
        ``route_keys``: slot -> its rows' routing key (absent or None: the slot)."""
        route_keys = route_keys or {}
        segments, tokens, positions, row0 = [], [], [], 0
        seen = set()
        for slot, start, ids in parts:
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
            if slot in seen:
                raise ValueError(f"slot {slot} appears twice in one batch")
            if ids.size == 0:
                raise ValueError(f"slot {slot}: empty segment")
            seen.add(slot)
            key = route_keys.get(slot)
            segments.append(Segment(slot, start, int(ids.size), row0,
                                    slot if key is None else key))
            tokens.append(ids)
            positions.append(np.arange(start, start + ids.size, dtype=np.int64))
            row0 += ids.size
        return cls(np.concatenate(tokens), np.concatenate(positions), tuple(segments))

    @property
    def num_rows(self) -> int:
        return int(self.tokens.size)

    def last_rows(self) -> np.ndarray:
        """Row index of each segment's last token."""
        return np.array([s.row0 + s.num - 1 for s in self.segments], dtype=np.int64)
