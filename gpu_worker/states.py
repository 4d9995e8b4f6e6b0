"""Per-slot recurrent state of the Gated DeltaNet layers: conv window and delta-rule state."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import numpy as np


@dataclasses.dataclass
class RecurrentStates:
    """conv [layers, slots, K-1, C] (the last K-1 raw conv inputs) and
    rec [layers, slots, Hv, Dk, Dv] (the delta-rule state, at least float32).

    During a verifying forward (``verifying``) the state after every row of a tracked slot's
    segment is kept in two device buffers shared by all layers: ``track_conv``
    [layers, T, K-1, C] and ``track_rec`` [layers, T, Hv, Dk, Dv], T the tracked rows of the
    forward; a tracked segment's rows are T-rows first..first+num-1 (``track_row``)."""

    xp: object
    num_layers: int
    max_slots: int
    conv_dim: int
    conv_kernel: int
    value_heads: int
    key_dim: int
    value_dim: int
    dtype: object

    def __post_init__(self) -> None:
        xp = self.xp
        self.conv = xp.zeros((self.num_layers, self.max_slots, self.conv_kernel - 1,
                              self.conv_dim), dtype=self.dtype)
        self.rec = xp.zeros((self.num_layers, self.max_slots, self.value_heads, self.key_dim,
                             self.value_dim), dtype=self.dtype)
        self.end_verify()

    def reset(self, slot: int) -> None:
        self.conv[:, slot] = 0
        self.rec[:, slot] = 0

    def snapshot(self, slot: int) -> tuple:
        """A copy of the slot's state across all layers (for checkpoints and swap-out)."""
        return self.conv[:, slot].copy(), self.rec[:, slot].copy()

    def restore(self, slot: int, snap: tuple) -> None:
        conv, rec = snap
        self.conv[:, slot] = conv
        self.rec[:, slot] = rec

    # ---- the segment table the GDN kernels read (one upload per forward) -------------------
    def segment_table(self, segments: Sequence) -> object:
        """int32 [segments, 4] on the backend: slot, row0, num, first T-row of the per-row
        buffers (-1: not tracked). Built once per forward (cached on the identity of the batch's
        ``segments`` tuple, which every layer passes); in a verifying forward the first call
        also allocates ``track_conv`` / ``track_rec`` for the tracked segments' rows."""
        if self._table is not None and self._table[0] is segments:
            return self._table[1]
        return self.install_table(segments, self.xp.asarray(self.table_host(segments)))

    def table_host(self, segments: Sequence, buffers: tuple | None = None) -> np.ndarray:
        """The host side of :meth:`segment_table`: the table as a NumPy array; in a verifying
        forward also the per-row buffers, allocated, or the first rows of ``buffers``
        (track_conv, track_rec) where they have enough (CUDA graphs share one pair, so every
        replay finds them at the address it was captured with)."""
        rows, total = {}, 0
        for seg in segments:
            if seg.slot in self._tracked:
                rows[seg.slot] = (total, seg.num)
                total += seg.num
        if rows:
            xp, L = self.xp, self.num_layers
            self._rows = rows
            if buffers is not None and buffers[0] is not None and buffers[0].shape[1] >= total:
                self.track_conv, self.track_rec = (b[:, :total] for b in buffers)
            else:
                self.track_conv = xp.empty((L, total, self.conv_kernel - 1, self.conv_dim),
                                           self.dtype)
                self.track_rec = xp.empty((L, total, self.value_heads, self.key_dim,
                                           self.value_dim), self.dtype)
        return np.array([(s.slot if self.has_state(s.slot) else -1, s.row0, s.num,
                           rows.get(s.slot, (-1, 0))[0])
                         for s in segments], dtype=np.int32).reshape(-1, 4)

    def has_state(self, slot: int) -> bool:
        """Whether ``slot`` has a state here. A slot past them (the capacity buckets' scratch
        slot, gpu_worker/graph_buckets.py) starts each segment from a zero state and keeps
        nothing: the kernels read and write no state memory for it (table slot -1)."""
        return slot < self.max_slots

    def install_table(self, segments: Sequence, table: object) -> object:
        """Make ``table`` (:meth:`table_host` on the backend) the one every layer of the
        forward over ``segments`` reads."""
        self._table = (segments, table)
        return table

    def track_row(self, slot: int) -> int | None:
        """The first T-row of a tracked slot's segment in this forward; None: not tracked."""
        entry = self._rows.get(slot)
        return None if entry is None else entry[0]

    # ---- speculative verify: keep every row's state, adopt the last accepted row's ---------
    # One forward's life: ``with states.verifying(slots):`` forward (gdn asks
    # ``segment_table`` and writes every tracked row's state into track_conv / track_rec),
    # then ``adopt`` per tracked slot; leaving the block forgets the kept states, also when
    # the forward raised.
    @contextlib.contextmanager
    def verifying(self, slots: Iterable[int]) -> Iterator[RecurrentStates]:
        self.track(slots)
        try:
            yield self
        finally:
            self.end_verify()

    def track(self, slots: Iterable[int]) -> None:
        """During the next forward, keep the state after every row of these slots' segments
        (their rows are a decode token plus drafts)."""
        self.end_verify()
        self._tracked = frozenset(int(s) for s in slots)

    def tracked_rows(self, segments: Sequence) -> int:
        """Rows of ``segments`` whose per-row states the next forward keeps."""
        return sum(s.num for s in segments if s.slot in self._tracked)

    def track_buffers(self, rows: int) -> tuple:
        """A new (track_conv, track_rec) pair of ``rows`` rows (:meth:`table_host` takes the
        first rows it needs)."""
        xp, L = self.xp, self.num_layers
        return (xp.empty((L, rows, self.conv_kernel - 1, self.conv_dim), self.dtype),
                xp.empty((L, rows, self.value_heads, self.key_dim, self.value_dim), self.dtype))

    def is_tracked(self, slot: int) -> bool:
        return slot in self._tracked

    def adopt(self, slot: int, rows: int) -> None:
        """Make the slot's state the one after its segment's first ``rows`` rows (the decode
        token and the accepted drafts); the later rows' updates are dropped. Two copies over
        all layers; a slot that had no segment in the forward keeps its state."""
        entry = self._rows.get(slot)
        if entry is None:
            return
        first, num = entry
        if not 1 <= rows <= num:
            raise ValueError(f"slot {slot}: adopt {rows} rows of a {num}-row segment")
        del self._rows[slot]
        self.conv[:, slot] = self.track_conv[:, first + rows - 1]
        self.rec[:, slot] = self.track_rec[:, first + rows - 1]

    def end_verify(self) -> None:
        """Forget every kept state (the slots not adopted keep their last row's state)."""
        self._tracked: frozenset[int] = frozenset()
        self._rows: dict[int, tuple[int, int]] = {}  # tracked slot -> (first T-row, rows)
        self._table: tuple | None = None  # (segments, table)
        self.track_conv = self.track_rec = None

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[:, 0].nbytes + self.rec[:, 0].nbytes) if self.num_layers else 0
