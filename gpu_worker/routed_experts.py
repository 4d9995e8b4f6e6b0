"""The seam between the model and its routed experts.

The model computes attention, routers, shared experts and dense MLPs itself. For the routed
experts of a MoE layer it asks one object, handed to ``Model.forward`` and to the ``Runner``:

    model (gpu_worker/model/model.py) -> RoutedExperts
        -> ExpertPlacement (gpu_worker/experts/placement.py)
            -> HostPath (CpuExpertPool.dispatch[_quantized], through host memory)
            -> LaunchedPath -> PinnedRing (GPU kernels ring the CPU workers)

``None`` in their place means "every expert is on the backend" (the model's own grouped or
looped kernels, gpu_worker/model/moe.py). ``expert_stats.RouterCounter`` is the other
implementation (all experts on the backend, counting the router's picks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

Array = Any  # a NumPy or CuPy array
# activations already quantized by the canonical QFUSE rule: (q [R, H] int8, d16 [R, H/32])
Quantized = tuple[Array, Array]
T = TypeVar("T")


class RoutedExperts(Protocol):
    """What the model and the runner need from the experts that are not all on the backend."""

    def moe_norm(self, x: Array, weight: Array, eps: float, zero_centered: bool
                 ) -> tuple[Array, Quantized | None]:
        """The RMSNorm before a MoE block ([R, H] -> [R, H]); also returns the activations
        quantized for the CPU experts where that is fused into the norm, else None."""
        ...

    def __call__(self, layer: int, x: Array, ids: Array, weights: Array,
                 quant: Quantized | None, during: Callable[[], None] | None = None) -> Array:
        """sum_k weights[r, k] * expert_{ids[r, k]}(x[r]) for every row: [R, H].
        ``during``: the caller's own backend work, enqueued while the CPU experts run (after
        the workers are rung, before the wait for them) so that it is off the step's
        critical path; called exactly once, before this returns."""
        ...

    def run_step(self, forward: Callable[[], T]) -> T:
        """Run one forward over these experts and end the step (wait for the CPU workers,
        raise what they reported); the forward's own error wins over the step's."""
        ...

    # with the Runner's slot_routing only (ExpertPlacement has them):
    def track_rows(self, row_slot: Any) -> None:
        """The coming pass's row -> slot map [R] (-1: untracked rows) for take_slot_experts."""
        ...

    def take_slot_experts(self, keep: bool = True) -> dict[int, tuple[Any, Any]]:
        """Per tracked slot: its distinct CPU experts (int32 [K]) and rows per expert
        (``keep=False``: none; the tracked routes are dropped unread)."""
        ...

    @property
    def cpu_experts_held(self) -> int:
        """CPU experts over all MoE layers."""
        ...

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call (one step): ``moe_layers``, ``gpu_experts``,
        ``cpu_experts``, ``cpu_expert_bytes``, ``cpu_experts_ms``."""
        ...
