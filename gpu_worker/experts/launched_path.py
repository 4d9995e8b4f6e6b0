"""The launched path of the CPU experts (CuPy float32, the default there): every MoE layer is
enqueued on the stream through the pinned ring and the host never waits per layer."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpu_worker.experts.counters import ExpertCounters
from gpu_worker.experts.pinned_ring import PinnedRing
from gpu_worker.model.model import Model
from gpu_worker.model.moe import expert_stacks, experts_local
from gpu_worker.routed_experts import Array, Quantized


class LaunchedPath:
    """Per layer: one kernel puts the quantized inputs into the pinned ring and rings the
    workers, the GPU computes its own experts and the caller's ``during`` work (the shared
    expert) meanwhile, then one kernel waits for the workers and one adds their partials to
    the GPU's output (gpu_worker/experts/pinned_ring.py). Rows beyond the ring's capacity
    (``pool.max_rows``) go in several loads, each summed onto its rows as the host path does.
    :meth:`end_step` ends the step."""

    def __init__(self, model: Model, pool, on_cpu: dict[int, np.ndarray],
                 counters: ExpertCounters) -> None:
        if model.ops.dtype != np.float32:
            raise ValueError("the launched path sums float32 partials onto float32 outputs")
        self.model, self.pool, self.on_cpu, self.counters = model, pool, on_cpu, counters
        self.ring = PinnedRing(pool, model.xp)
        self._mask_dev = {layer: model.xp.asarray(m) for layer, m in on_cpu.items()}

    def __call__(self, layer: int, x: Array, ids: Array, weights: Array,
                 quant: Quantized | None, during: Callable[[], None] | None = None) -> Array:
        if quant is None:
            raise ValueError("the launched path takes activations quantized on the GPU")
        xp = self.model.xp
        q, d16 = quant  # [R, H] int8, [R, H/32] fp16
        mask = self.on_cpu[layer]
        first_cpu = mask.size - int(mask.sum())
        on_cpu = self._mask_dev[layer]
        R, step = x.shape[0], self.pool.max_rows
        self.counters.moe_layers += 1
        if self.counters.tracking:  # slot_routing: to the host once the step is over
            self.counters.add_routes(layer, mask.size, ids.copy(), on_cpu[ids])
        if not R:
            if during is not None:
                during()
            return xp.zeros_like(x)
        chunks = [(r0, min(R, r0 + step)) for r0 in range(0, R, step)]

        def launch(r0: int, r1: int) -> None:
            self.ring.launch(layer, q[r0:r1], d16[r0:r1], ids[r0:r1], weights[r0:r1], on_cpu,
                             first_cpu, same_layer=r0 > 0)

        launch(*chunks[0])
        if during is not None:  # the caller's GPU work, while the workers run
            during()
        out = xp.zeros_like(x)  # [R, H] float32
        if first_cpu:  # the GPU's experts run while the CPU workers do theirs
            mlp = self.model.layers[layer].mlp
            # (an id -1, no expert: on_cpu[-1] wraps, and -1 stays -1 either way)
            out = experts_local(self.model.ops, *expert_stacks(mlp), x,
                                xp.where(on_cpu[ids], -1, ids), weights)
        parts = []
        for i, (r0, r1) in enumerate(chunks):
            if i:
                launch(r0, r1)
            parts.append(self.ring.gather(base=out[r0:r1]))  # out + (p_0 + p_1 + ...)
        return parts[0] if len(parts) == 1 else xp.concatenate(parts)

    def end_step(self) -> None:
        """Wait for the stream, end the workers' device session, raise what they reported."""
        self.ring.end_step()

    def count_step(self) -> None:
        """Add the step's distinct experts and worker time, counted on the device."""
        self.counters.add_distinct(*self.ring.take_distinct())

    def close(self) -> None:
        self.ring.close()
