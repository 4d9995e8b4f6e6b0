"""The host path of the CPU experts (the reference, and the only path on NumPy): the CPU's
(row, expert) pairs go to the pool through host memory, one dispatch per MoE layer."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from gpu_worker.backend import to_numpy
from gpu_worker.experts.counters import ExpertCounters
from gpu_worker.model.model import Model
from gpu_worker.model.moe import expert_stacks, experts_local
from gpu_worker.routed_experts import Array, Quantized


class HostPath:
    """``pool.dispatch`` (activations quantized on the CPU by the Numba quantizer) or, with
    activations already quantized on the GPU (QFUSE), ``pool.dispatch_quantized``; the
    backend's own experts run first, the CPU's partial sum is added to theirs."""

    def __init__(self, model: Model, pool, on_cpu: dict[int, np.ndarray],
                 counters: ExpertCounters) -> None:
        self.model, self.pool, self.on_cpu, self.counters = model, pool, on_cpu, counters

    def __call__(self, layer: int, x: Array, ids: Array, weights: Array,
                 quant: Quantized | None, during: Callable[[], None] | None = None) -> Array:
        xp, ops = self.model.xp, self.model.ops
        mask = self.on_cpu[layer]
        ids_host = to_numpy(ids)
        cpu = mask[ids_host]  # [R, k]
        first_cpu = mask.size - int(mask.sum())
        cpu_ids = np.where(cpu, ids_host - first_cpu, -1)  # ids local to the pool's layer
        out = xp.zeros_like(x)  # [R, H]
        self.counters.add_layer(ids_host, cpu)
        self.counters.add_routes(layer, mask.size, ids_host, cpu)
        if (~cpu).any():
            mlp = self.model.layers[layer].mlp
            out = experts_local(ops, *expert_stacks(mlp), x,
                                xp.asarray(np.where(cpu, -1, ids_host)), weights)
        if during is not None:  # enqueued before the host waits for the workers
            during()
        if cpu.any():
            t0 = time.perf_counter()
            if quant is not None:  # activations already quantized on the GPU (QFUSE)
                part = self.pool.dispatch_quantized(layer, to_numpy(quant[0]),
                                                    to_numpy(quant[1]), cpu_ids,
                                                    to_numpy(weights))
            else:
                part = self.pool.dispatch(layer, to_numpy(x), cpu_ids, to_numpy(weights))
            self.counters.cpu_experts_ms += (time.perf_counter() - t0) * 1e3
            out = out + xp.asarray(part, dtype=ops.dtype)  # [R, H]
        return out

    def end_step(self) -> None:
        """Nothing outlives a layer on this path."""

    def close(self) -> None:
        """Nothing of its own to release (the placement closes the pool)."""
