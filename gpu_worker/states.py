"""Per-slot recurrent state of the Gated DeltaNet layers: conv window and delta-rule state."""

from __future__ import annotations

import dataclasses


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

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[:, 0].nbytes + self.rec[:, 0].nbytes) if self.num_layers else 0
