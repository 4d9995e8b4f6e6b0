"""ExpertPlacement: the model's routed experts when some of them run on cpu_experts processes.

It implements :class:`gpu_worker.routed_experts.RoutedExperts`: ``Model.forward`` asks it for
the norm before each MoE block and for each MoE layer's routed experts; the runner (or the
engine) wraps each forward in :meth:`run_step`. One dispatch per MoE layer per step carries
every CPU pair of every row; the CPU partial sums come back and are added on the backend
(docs/architecture.md §5). Two paths, chosen once at start (gpu_worker/experts/__init__.py):
the launched path on CuPy float32 where the device can map the ring, else the host path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from cpu_experts.errors import NonFiniteActivation
from gpu_worker.experts.counters import ExpertCounters
from gpu_worker.experts.host_path import HostPath
from gpu_worker.experts.split import ExpertSplit, cpu_expert_bytes
from gpu_worker.model.model import Model
from gpu_worker.routed_experts import Array, Quantized

T = TypeVar("T")


class ExpertPlacement:
    """Routed experts split between the backend and a :class:`cpu_experts.pool.CpuExpertPool`.

    ``on_cpu``: per MoE layer, the bool mask [E] of the expert ids the pool holds (the last
    ones; the backend's stacks hold the others). On CuPy float32 the norm before each MoE
    block quantizes for the CPU in the same kernel (QFUSE, gpu_worker/kernels/qfuse.py) and
    the launched path drives the pool where the device can map its ring; otherwise the norm
    is the model's own and the host path is used.
    """

    def __init__(self, model: Model, on_cpu: dict[int, np.ndarray], pool, *,
                 hot_share: dict[int, float] | None = None) -> None:
        self.model, self.on_cpu, self.pool = model, on_cpu, pool
        # (read every step with slot routing: counted once, the split is fixed; summing the
        # masks took 0.2 ms of an H100 machine's four-stream steps, session 28's traces)
        self._held = sum(int(m.sum()) for m in on_cpu.values())
        # hot experts: per layer, the share of the calibration's router picks the GPU keeps
        self.hot_share = hot_share or {}
        self.counters = ExpertCounters(cpu_expert_bytes(model, getattr(pool, "weight_format",
                                                                       "int8")))
        xp = model.xp
        self.norm = None  # FusedMoeNorm on CuPy float32
        self.path = HostPath(model, pool, on_cpu, self.counters)
        if xp.__name__ == "cupy" and model.ops.dtype == np.float32:
            from gpu_worker.experts.launched_path import LaunchedPath  # noqa: PLC0415 (cupy)
            from gpu_worker.experts.pinned_ring import device_can_map  # noqa: PLC0415
            from gpu_worker.kernels.qfuse import FusedMoeNorm  # noqa: PLC0415

            self.norm = FusedMoeNorm()
            if device_can_map(xp):
                self.path = LaunchedPath(model, pool, on_cpu, self.counters)

    @classmethod
    def start(cls, model: Model, split: ExpertSplit, pool) -> ExpertPlacement:
        """The placement over a started ``pool`` (:class:`cpu_experts.pool.CpuExpertPool`)
        that holds, per MoE layer, the experts ``split`` puts on the CPU (renumbered hottest
        first with router counts, gpu_worker/experts/split.py) while ``model`` holds the
        others: gpu_worker/weights/stream.py reads each expert straight to its side. Closes
        the pool if the placement cannot be made."""
        try:
            return cls(model, split.on_cpu, pool, hot_share=split.hot_share)
        except BaseException:
            pool.close()
            raise

    @property
    def launched(self) -> bool:
        """Whether MoE layers take the launched path (else the host path)."""
        return not isinstance(self.path, HostPath)

    def use_host_path(self) -> None:
        """From now on every layer takes the host path (tests and diagnostics compare the
        two); the fused norm stays, so the CPU gets the same quantized activations."""
        if self.launched:
            self.path.close()
            self.path = HostPath(self.model, self.pool, self.on_cpu, self.counters)

    # -- RoutedExperts --------------------------------------------------------------------

    def moe_norm(self, x: Array, weight: Array, eps: float, zero_centered: bool
                 ) -> tuple[Array, Quantized | None]:
        """The RMSNorm before a MoE block, ``[R, H] -> [R, H]``, plus the activations
        quantized for the CPU where the norm does that (QFUSE), else None."""
        if self.norm is not None:
            return self.norm(x, weight, eps, zero_centered)
        return self.model.ops.rms_norm(x, weight, eps, zero_centered=zero_centered), None

    def __call__(self, layer: int, x: Array, ids: Array, weights: Array,
                 quant: Quantized | None, during: Callable[[], None] | None = None) -> Array:
        """sum_k w * expert_k(x) per row: backend experts here, CPU experts in the pool;
        ``during`` as RoutedExperts.__call__."""
        return self.path(layer, x, ids, weights, quant, during)

    def run_step(self, forward: Callable[[], T]) -> T:
        """``forward()`` (one model forward over this placement), then :meth:`end_step`; an
        error of the forward itself wins over the step's."""
        try:
            out = forward()
        except BaseException:
            try:
                self.end_step()
            except Exception:  # noqa: BLE001,S110 -- the forward's error is the one to raise
                pass
            raise
        self.end_step()
        return out

    # -- CUDA graphs (gpu_worker/step_graph.py) ------------------------------------------

    def graph_reason(self) -> str | None:
        """Why passes over this placement cannot be captured (None: they can)."""
        if not self.launched:
            return "CPU experts on the host path (the device cannot map their ring)"
        return None

    def begin_capture(self) -> None:
        """The next forward is captured (launched path only): its ring launches take their
        sequence numbers from the replay's base; its host counters are noted."""
        self._layers0 = self.counters.moe_layers
        self._routes0 = self.counters.begin_capture()
        self.path.ring.begin_capture()

    def end_capture(self) -> tuple:
        """The captured forward's token for :meth:`before_replay`; ends the capture's device
        session (nothing ran)."""
        counts = self.path.ring.end_capture()
        token = (counts, self.counters.moe_layers - self._layers0,
                 self.counters.end_capture(self._routes0))
        self.counters.moe_layers = self._layers0
        self.end_step()
        return token

    def before_replay(self, token: tuple, stream) -> None:
        """Before a replay on ``stream``: the ring's session and bases, the host counters a
        forward adds, and the per-slot routes it will write (when rows are tracked).
        :meth:`end_step` after it, as after an eager forward."""
        counts, layers, routes = token
        self.path.ring.before_replay(counts, stream)
        self.counters.moe_layers += layers
        self.counters.replay_routes(routes)

    def track_rows(self, row_slot: np.ndarray | None) -> None:
        """Record the coming pass's CPU experts per slot (ExpertCounters.track_rows)."""
        self.counters.track_rows(row_slot)

    def track_padding(self, rows: int) -> None:
        """The coming pass has ``rows`` rows, the ones past the tracked rows a padded pass's
        padding (gpu_worker/graph_buckets.py): no slot's."""
        self.counters.pad_rows(rows)

    def take_slot_experts(self, keep: bool = True) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per tracked slot: its CPU experts and rows per expert since the last call
        (``keep=False``: none, the routes dropped unread)."""
        return self.counters.take_slot_experts(keep)

    @property
    def cpu_experts_held(self) -> int:
        """CPU experts over all MoE layers."""
        return self._held

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call (one step), see gpu_worker/experts/counters.py."""
        if self.launched:
            self.path.count_step()
        return self.counters.take()

    # ------------------------------------------------------------------------------------

    def end_step(self) -> None:
        """After a forward: wait for the stream, end the CPU workers' device session and
        raise what a worker reported (CpuExpertError, CpuWorkerDied), else
        NonFiniteActivation if the fused quantizer saw inf/nan in the step."""
        try:
            self.path.end_step()
        finally:
            flagged = self.norm is not None and self.norm.take_flag()
        if flagged:
            raise NonFiniteActivation("non-finite value in activations bound for the CPU "
                                      "experts (fused quantizer); the step's outputs are void")

    def check_alive(self) -> None:
        self.pool.check_alive()

    def close(self) -> None:
        try:
            self.path.close()
        finally:
            self.pool.close()
