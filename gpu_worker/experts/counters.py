"""Per-step counters of the routed experts, as the runner reports them (``take_stats``)."""

from __future__ import annotations

import numpy as np


class ExpertCounters:
    """Distinct experts per MoE layer summed over layers (the backend's and the CPU's), CPU
    expert weight bytes read and CPU expert time (host path: wall time of the dispatches;
    launched path: the slowest worker's kernel time)."""

    def __init__(self, bytes_per_expert: float) -> None:
        self.bytes_per_expert = bytes_per_expert
        self._reset()

    def _reset(self) -> None:
        self.moe_layers = self.gpu_experts = self.cpu_experts = 0
        self.cpu_experts_ms = 0.0

    def add_layer(self, ids: np.ndarray, cpu: np.ndarray) -> None:
        """One layer on the host: ``ids [R, k]`` global expert ids, ``cpu [R, k]`` bool."""
        self.moe_layers += 1
        self.gpu_experts += len(np.unique(ids[~cpu]))
        self.cpu_experts += len(np.unique(ids[cpu]))

    def add_distinct(self, gpu: int, cpu: int, ms: float) -> None:
        """Counts the launched path's kernels kept on the device (PinnedRing.take_distinct)."""
        self.gpu_experts += gpu
        self.cpu_experts += cpu
        self.cpu_experts_ms += ms

    def take(self) -> dict[str, float]:
        """The counters since the last call, then zero."""
        stats = {"moe_layers": self.moe_layers, "gpu_experts": self.gpu_experts,
                 "cpu_experts": self.cpu_experts,
                 "cpu_expert_bytes": int(self.cpu_experts * self.bytes_per_expert),
                 "cpu_experts_ms": self.cpu_experts_ms}
        self._reset()
        return stats
