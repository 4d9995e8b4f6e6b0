"""Per-slot recurrent state of the Gated DeltaNet layers: conv window and delta-rule state."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator


@dataclasses.dataclass
class RecurrentStates:
    """conv [layers, slots, K-1, C] (the last K-1 raw conv inputs) and
    rec [layers, slots, Hv, Dk, Dv] (the delta-rule state, at least float32)."""

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
        self._verify: dict[int, dict[int, tuple]] = {}  # slot -> layer -> (window, [S_t])
        xp = self.xp
        self.conv = xp.zeros((self.num_layers, self.max_slots, self.conv_kernel - 1,
                              self.conv_dim), dtype=self.dtype)
        self.rec = xp.zeros((self.num_layers, self.max_slots, self.value_heads, self.key_dim,
                             self.value_dim), dtype=self.dtype)

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

    # ---- speculative verify: keep every row's state, adopt the last accepted row's ---------
    # One forward's life: ``with states.verifying(slots):`` forward (gdn asks ``is_tracked``
    # and calls ``record``), then ``adopt`` per tracked slot; leaving the block forgets the
    # kept states, also when the forward raised.
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
        self._verify = {int(s): {} for s in slots}

    def is_tracked(self, slot: int) -> bool:
        return slot in self._verify

    def record(self, layer: int, slot: int, window, states: list) -> None:
        """gdn: ``window`` [K-1+n, C] (the conv inputs before and of the segment's n rows) and
        ``states`` (the delta-rule state after each row) of a tracked slot."""
        self._verify[slot][layer] = (window, states)

    def adopt(self, slot: int, rows: int) -> None:
        """Make the slot's state the one after its segment's first ``rows`` rows (the decode
        token and the accepted drafts); the later rows' updates are dropped."""
        for layer, (window, states) in self._verify.pop(slot).items():
            self.conv[layer, slot] = window[rows:rows + self.conv_kernel - 1]
            self.rec[layer, slot] = states[rows - 1]

    def end_verify(self) -> None:
        """Forget every kept state (the slots not adopted keep their last row's state)."""
        self._verify = {}

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[:, 0].nbytes + self.rec[:, 0].nbytes) if self.num_layers else 0
