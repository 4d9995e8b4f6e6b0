"""Expert placement: which routed experts run on the worker's backend and which on the
cpu_experts processes, and the per-layer split of (row, expert, weight) pairs between them.

One dispatch per MoE layer per step carries every CPU pair of every row; the CPU partial
sums come back and are added on the backend (ARCHITECTURE.md §5).
"""

from __future__ import annotations

import time

import numpy as np

from cpu_experts.quant import NonFiniteActivation
from gpu_worker.backend import to_numpy
from gpu_worker.expert_stats import hot_order, permute_experts
from gpu_worker.model.model import Model
from gpu_worker.model.moe import expert_stacks, experts_local

PLACEMENTS = ("gpu", "cpu", "split")
# Where the CPU experts' activations are quantized (CuPy backend only):
#   "fused": in the GPU kernel of the RMSNorm before the MoE block (QFUSE);
#   "standalone": the same GPU norm kernel without quantization, then the Numba quantizer.
# Both apply the one canonical rule, so they give the same tokens (tests/gpu).
QFUSE_MODES = ("fused", "standalone")
# How a CuPy step drives the CPU workers (gpu_worker/cpu_link.py): "launched" (the default:
# kernels ring the workers and wait for them on the stream, the host never waits per layer)
# or "sync" (the host rings and waits per layer). Same bits; launched is faster
# (docs/cpu_experts.md).
CPU_DISPATCH = ("launched", "sync")


class ExpertPlacement:
    def __init__(self, model: Model, on_cpu: dict[int, np.ndarray], pool) -> None:
        self.model = model
        self.on_cpu = on_cpu  # layer -> bool [E]
        self.pool = pool
        cfg = model.cfg
        # int8 weights plus one fp16 scale per 32 values, gate + up + down
        self.bytes_per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * (1 + 2 / 32)
        self._stats = self._zero_stats()
        self.link = None  # PinnedRing on CuPy (pin_ring): kernels write and read the ring
        self.launched = False  # the link's launched path (else its synchronous one)
        self._qerr = None  # install_gpu_norm("fused"): the step's non-finite flag (CuPy)
        # hot experts: per layer, the share of the calibration's router picks the GPU keeps
        self.hot_share: dict[int, float] = {}
        self._mask_dev: dict[int, object] = {}

    def pin_ring(self, dispatch: str = "launched") -> None:
        """CuPy backend: register the pool's ring as pinned host memory
        (gpu_worker/cpu_link.py). ``dispatch``: "sync" (a kernel stages the inputs, the host
        rings the workers and waits for them, a kernel adds the partials copied by DMA) or
        "launched" (kernels do it all on the stream; the host never waits per layer). Where
        the device cannot use registered host memory, the host path stays."""
        from gpu_worker.cpu_link import PinnedRing  # noqa: PLC0415 (cupy)

        if dispatch not in CPU_DISPATCH:
            raise ValueError(f"cpu dispatch must be one of {', '.join(CPU_DISPATCH)}, got "
                             f"{dispatch!r}")
        xp = self.model.xp
        launched = dispatch == "launched"
        link = PinnedRing(self.pool, xp, kernel_out=None if launched else False)
        if not link.kernel_in:  # no device access to registered memory: the host path
            link.close()
            return
        self.link, self.launched = link, launched
        self._mask_dev = {layer: xp.asarray(m) for layer, m in self.on_cpu.items()}

    @staticmethod
    def _zero_stats() -> dict:
        return {"moe_layers": 0, "gpu_experts": 0, "cpu_experts": 0, "cpu_expert_bytes": 0,
                "cpu_experts_ms": 0.0}

    def take_stats(self) -> dict:
        """Counters since the last call (one step): distinct experts per layer summed over
        MoE layers, CPU expert weight bytes read, CPU expert time (host path: wall time of the
        dispatches; pinned path: the slowest worker's kernel time)."""
        stats, self._stats = self._stats, self._zero_stats()
        if self.link is not None and self.launched:
            gpu, cpu, ms = self.link.take_distinct()
            stats["gpu_experts"] += gpu
            stats["cpu_experts"] += cpu
            stats["cpu_expert_bytes"] += int(cpu * self.bytes_per_expert)
            stats["cpu_experts_ms"] += ms
        return stats

    @classmethod
    def start(cls, model: Model, tensors: dict[str, np.ndarray], *, placement: str,
              cpu_per_layer: int = 0, num_workers: int | None = None,
              cores: list[list[int]] | None = None,
              qfuse: str | None = None, isa: str | None = None,
              cpu_dispatch: str = "launched",
              hot: dict[int, np.ndarray] | None = None) -> ExpertPlacement:
        """Quantize the CPU-resident experts and start their worker processes.

        ``split`` puts the last ``cpu_per_layer`` expert ids of each MoE layer on the CPU;
        with ``hot`` (router counts per MoE layer, gpu_worker/expert_stats.py) each layer's
        experts are first renumbered hottest first, so the GPU keeps the most-picked ones.
        """
        from cpu_experts.pool import CpuExpertPool  # noqa: PLC0415 (numba, only when used)

        if placement not in PLACEMENTS[1:]:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
        if qfuse is not None and model.xp.__name__ != "cupy":
            raise ValueError(f"qfuse={qfuse!r} needs the cupy backend (the quantizer runs in the "
                             "GPU's RMSNorm kernel); leave it unset on numpy")
        cfg = model.cfg
        E = cfg.num_experts
        n_cpu = E if placement == "cpu" else cpu_per_layer
        if not 0 < n_cpu <= E:
            raise ValueError(f"experts.cpu_experts_per_layer must be in 1..{E} for 'split'")
        if hot is not None and placement != "split":
            raise ValueError("hot experts need placement 'split'")
        hot_share = {}
        for i, counts in (hot or {}).items():
            order = hot_order(counts)
            permute_experts(tensors, order, f"model.layers.{i}.mlp.")
            permute_experts(model.layers[i].mlp, model.xp.asarray(order))
            hot_share[i] = float(counts[order[:E - n_cpu]].sum() / max(1, counts.sum()))
        on_cpu, layers = {}, {}
        for i in range(cfg.num_hidden_layers):
            if not cfg.is_sparse(i):
                continue
            mask = np.zeros(E, dtype=bool)
            mask[E - n_cpu:] = True
            on_cpu[i] = mask
            p = f"model.layers.{i}.mlp.experts."
            layers[i] = tuple(np.ascontiguousarray(tensors[p + k][E - n_cpu:], np.float32)
                              for k in ("gate_proj", "up_proj", "down_proj"))
        pool = CpuExpertPool(layers, num_workers=num_workers or None, cores=cores or None,
                             isa=isa)
        for i in on_cpu:  # the backend keeps only its own experts (ids below E - n_cpu)
            mlp = model.layers[i].mlp
            for k in ("gate_proj", "up_proj", "down_proj"):
                mlp["experts." + k] = mlp["experts." + k][: E - n_cpu].copy()
        placement_ = cls(model, on_cpu, pool)
        placement_.hot_share = hot_share
        if qfuse is None and model.xp.__name__ == "cupy" and model.ops.dtype == np.float32:
            qfuse = "fused"
        if qfuse is not None:
            placement_.install_gpu_norm(qfuse)
        if model.xp.__name__ == "cupy":
            placement_.pin_ring(cpu_dispatch)
        return placement_

    def install_gpu_norm(self, mode: str) -> None:
        """Route the pre-MoE RMSNorm through the CuPy kernel, quantizing in it or not."""
        from gpu_worker.kernels.qfuse import rmsnorm_qfuse  # noqa: PLC0415 (cupy)

        if mode not in QFUSE_MODES:
            raise ValueError(f"qfuse must be one of {', '.join(QFUSE_MODES)}, got {mode!r}")
        fused = mode == "fused"
        # non-finite activations flag this instead of a host sync per layer; end_step checks
        self._qerr = self.model.xp.zeros(1, self.model.xp.int32) if fused else None
        err = self._qerr

        def moe_norm(x, w, eps, zero_centered):
            y, q, d16 = rmsnorm_qfuse(x, w, eps, zero_centered=zero_centered, quantize=fused,
                                      err=err)
            return y, ((q, d16) if fused else None)

        self.model.moe_norm = moe_norm

    def experts(self, layer: int, x, ids, weights, quant=None):
        """sum_k w * expert_k(x) per row: backend experts here, CPU experts in the pool."""
        if self.link is not None and quant is not None and x.shape[0] <= self.pool.max_rows:
            if self.launched:
                return self._experts_launched(layer, x, ids, weights, quant)
            return self._experts_pinned(layer, x, ids, weights, quant)
        if self.link is not None:
            self.link.end_step()  # the host drives the pool now: no device session open
        xp, ops = self.model.xp, self.model.ops
        mask = self.on_cpu[layer]
        ids_host = to_numpy(ids)
        cpu = mask[ids_host]  # [R, k]
        E = mask.size
        first_cpu = E - int(mask.sum())
        cpu_ids = np.where(cpu, ids_host - first_cpu, -1)  # ids local to the pool's layer
        out = xp.zeros_like(x)
        self._count(ids_host, cpu)
        st = self._stats
        if (~cpu).any():
            out = self._local(layer, x, xp.asarray(np.where(cpu, -1, ids_host)), weights)
        if cpu.any():
            t0 = time.perf_counter()
            if quant is not None:  # activations already quantized on the GPU (QFUSE)
                part = self.pool.dispatch_quantized(layer, to_numpy(quant[0]),
                                                    to_numpy(quant[1]), cpu_ids,
                                                    to_numpy(weights))
            else:
                part = self.pool.dispatch(layer, to_numpy(x), cpu_ids, to_numpy(weights))
            st["cpu_experts_ms"] += (time.perf_counter() - t0) * 1e3
            out = out + xp.asarray(part, dtype=ops.dtype)
        return out

    def _experts_launched(self, layer: int, x, ids, weights, quant):
        """The launched CuPy path (gpu_worker/cpu_link.py), all on the stream: one kernel puts the
        inputs into the pinned ring and rings the workers, the GPU computes its own experts
        meanwhile, then one kernel waits for the workers and one adds their partials. The
        host never waits here; :meth:`end_step` ends the step."""
        xp, ops = self.model.xp, self.model.ops
        mask = self.on_cpu[layer]
        first_cpu = mask.size - int(mask.sum())
        on_cpu = self._mask_dev[layer]
        self.link.launch(layer, quant[0], quant[1], ids, weights, on_cpu, first_cpu)
        self._stats["moe_layers"] += 1
        out = xp.zeros_like(x)
        if first_cpu:  # the GPU's experts run while the CPU workers do theirs
            out = self._local(layer, x, xp.where(on_cpu[ids], -1, ids), weights)
        if out.dtype == np.float32:
            return self.link.gather(base=out)  # out + (p_0 + p_1 + ...), as the host path
        return out + self.link.gather().astype(ops.dtype)

    def _experts_pinned(self, layer: int, x, ids, weights, quant):
        """The synchronous CuPy path (gpu_worker/cpu_link.py): one kernel puts the inputs
        into the pinned ring, the workers start, the GPU computes its own experts meanwhile,
        then one kernel adds the workers' partials (copied by DMA) to them."""
        xp, ops = self.model.xp, self.model.ops
        mask = self.on_cpu[layer]
        first_cpu = mask.size - int(mask.sum())
        R, k = ids.shape
        gids, _ = self.link.stage(quant[0], quant[1], ids, weights, self._mask_dev[layer],
                                  first_cpu)
        cpu = mask[gids]  # [R, k]
        n_cpu = self._count(gids, cpu)
        t0 = time.perf_counter()
        if n_cpu:
            self.link.start(layer, R, k)
        out = xp.zeros_like(x)
        if not cpu.all():  # the GPU's experts run while the CPU workers do theirs
            out = self._local(layer, x, xp.where(self._mask_dev[layer][ids], -1, ids), weights)
        if n_cpu:
            if out.dtype == np.float32:
                out = self.link.collect(base=out)  # out + (p_0 + p_1 + ...), as below
            else:
                out = out + self.link.collect().astype(ops.dtype)
            self._stats["cpu_experts_ms"] += (time.perf_counter() - t0) * 1e3
        return out

    def step(self, forward):
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

    def end_step(self) -> None:
        """After a forward: wait for the stream, end the CPU workers' device session and
        raise what a worker reported (CpuExpertError, CpuWorkerDied), else
        NonFiniteActivation if the fused quantizer saw inf/nan in the step."""
        try:
            if self.link is not None:
                self.link.end_step()
        finally:
            flagged = self._qerr is not None and bool(int(self._qerr.get()[0]))
            if flagged:
                self._qerr[...] = 0
        if flagged:
            raise NonFiniteActivation("non-finite value in activations bound for the CPU "
                                      "experts (fused quantizer); the step's outputs are void")

    def _local(self, layer: int, x, gpu_ids, weights):
        """The backend's own experts of ``layer`` (ids -1: elsewhere)."""
        p = self.model.layers[layer].mlp
        return experts_local(self.model.ops, *expert_stacks(p), x, gpu_ids, weights)

    def _count(self, ids_host: np.ndarray, cpu: np.ndarray) -> int:
        """Add one MoE layer's distinct experts to the step counters; returns the CPU's."""
        st = self._stats
        n_cpu = len(np.unique(ids_host[cpu]))
        st["moe_layers"] += 1
        st["gpu_experts"] += len(np.unique(ids_host[~cpu]))
        st["cpu_experts"] += n_cpu
        st["cpu_expert_bytes"] += int(n_cpu * self.bytes_per_expert)
        return n_cpu

    def check_alive(self) -> None:
        self.pool.check_alive()

    def close(self) -> None:
        if self.link is not None:
            try:
                self.link.close()
            finally:
                self.link = None
        self.pool.close()
