"""The GPU memory budget and the plan made from it before any weight is read.

:func:`plan_memory` turns a model config and the serving settings into a :class:`MemoryPlan`:
the bytes of every dense part on the GPU, the KV cache, the GDN states, a work-space
allowance (gpu_worker/memory_parts.py counts them), then as many routed experts per MoE layer
as fit the budget, the hottest by router counts when given, else the lowest ids; the rest go
to the CPU workers as int8 blocks of 32. A plan over the GPU budget or the host's RAM raises
:class:`PlanError` saying by how much. docs/memory.md states every formula.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from cpu_experts.cores import numa_core_groups
from cpu_experts.rings import Ring
from cpu_experts.shard_cache import reclaimable_bytes
from gpu_worker import memory_parts as mp
from gpu_worker.graph_buckets import MAX_PAD
from gpu_worker.kv_cache import block_bytes
from gpu_worker.model_config import ModelConfig
from gpu_worker.weights_spec import expected_tensors
from protocol.worker_config import GIB, MAX_PREFIX_ENTRIES, WorkerConfig, prefix_blocks

PLACEMENTS = ("gpu", "cpu", "split")
RING_ROWS, RING_K = 256, 16  # CpuExpertPool's ring capacity (its max_rows, max_k defaults)
ALLOCATOR_SLACK = 0.05  # CuPy's pool rounds blocks up and fragments: 5% of the arrays
CUDA_CONTEXT = 512 * 2**20  # CUDA context and cuBLAS workspace, outside CuPy's pool
HOST_PROCESS = 2 * GIB  # the GPU worker process (Python, NumPy, Numba, CUDA runtime)
HOST_PER_CPU_WORKER = 256 * 2**20  # each cpu_experts process, beyond its shared weights
LOAD_WORKING_SET = 2 * GIB  # the streaming load's host buffer (one shard or 2 GiB)


class PlanError(ValueError):
    """A plan over the GPU budget or the host's RAM; ``plan`` is the refused plan."""

    def __init__(self, message: str, plan: MemoryPlan | None = None) -> None:
        super().__init__(message)
        self.plan = plan


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Where every byte goes. Parts are ``(name, bytes)`` pairs in a fixed order."""

    dtype: str  # weights on the GPU: bfloat16 | float32 | float64
    backend: str  # "cupy" | "numpy" (NumPy: the "GPU" side lives in host RAM)
    placement: str  # effective: "gpu" (no CPU experts), "cpu" (none on the GPU) or "split"
    gpu_budget_bytes: int | None  # None: no limit
    dense_parts: tuple[tuple[str, int], ...]  # memory_parts.DENSE_PARTS, in that order
    kv_block_bytes: int
    kv_blocks: int  # max_slots * ceil(max_context / block) + kv_prefix_blocks
    kv_prefix_blocks: int
    gdn_state_bytes_per_slot: int  # conv windows + delta-rule states of all GDN layers
    max_slots: int
    prefix_snapshots: int  # GDN state copies the prefix cache may hold on the device
    speculation_bytes: int  # verify keeps every draft row's delta-rule state
    work_parts: tuple[tuple[str, int], ...]  # activations, attention scores, logits, ...
    moe_layers: tuple[int, ...]
    num_experts: int  # routed experts per MoE layer
    gpu_bytes_per_expert: int  # gate + up + down in the GPU format (dtype, or int8 blocks)
    cpu_bytes_per_expert: float  # the same in the CPU format (int8, f32 scale per 32)
    experts_gpu_per_layer: int
    expert_order: tuple[tuple[int, tuple[int, ...]], ...]  # (layer, ids hottest first)
    cpu_expert_bytes: int  # the CPU workers' shared memory
    cpu_ring_bytes: int  # activations in, partial sums out (shared memory)
    cuda_context_bytes: int
    host_fixed_bytes: int  # processes and the load's working set
    host_available_bytes: int | None  # None: unknown, not checked
    cpu_format: str = "int8"  # the CPU experts' weights: int8 or int4 (cpu_experts/formats.py)
    gpu_format: str = "model"  # the GPU's routed experts: the model dtype or int8 blocks

    @property
    def experts_cpu_per_layer(self) -> int:
        return self.num_experts - self.experts_gpu_per_layer

    @property
    def dense_bytes(self) -> int:
        return sum(b for _, b in self.dense_parts)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes

    @property
    def gdn_state_bytes(self) -> int:
        return self.max_slots * self.gdn_state_bytes_per_slot

    @property
    def prefix_snapshot_bytes(self) -> int:
        return self.prefix_snapshots * self.gdn_state_bytes_per_slot

    @property
    def work_bytes(self) -> int:
        return sum(b for _, b in self.work_parts)

    @property
    def gpu_fixed_bytes(self) -> int:
        """GPU arrays other than routed experts."""
        return (self.dense_bytes + self.kv_cache_bytes + self.gdn_state_bytes
                + self.prefix_snapshot_bytes + self.speculation_bytes + self.work_bytes)

    @property
    def gpu_expert_bytes(self) -> int:
        return len(self.moe_layers) * self.experts_gpu_per_layer * self.gpu_bytes_per_expert

    @property
    def allocator_slack_bytes(self) -> int:
        if self.backend != "cupy":
            return 0
        return math.ceil(ALLOCATOR_SLACK * (self.gpu_fixed_bytes + self.gpu_expert_bytes))

    @property
    def gpu_total_bytes(self) -> int:
        """Everything the plan puts on the GPU, allowances included."""
        return (self.gpu_fixed_bytes + self.gpu_expert_bytes + self.allocator_slack_bytes
                + self.cuda_context_bytes)

    @property
    def cpu_resident_bytes(self) -> int:
        """Host bytes that stay after loading: CPU experts plus the ring."""
        return self.cpu_expert_bytes + self.cpu_ring_bytes

    @property
    def host_needed_bytes(self) -> int:
        """Peak host RAM: resident bytes, processes, the load's working set (NumPy: plus
        every "GPU" array)."""
        gpu_side = self.gpu_fixed_bytes + self.gpu_expert_bytes if self.backend == "numpy" else 0
        return self.cpu_resident_bytes + self.host_fixed_bytes + gpu_side

    def gpu_expert_ids(self, layer: int) -> tuple[int, ...]:
        """Expert ids of MoE layer ``layer`` kept on the GPU, hottest first."""
        return dict(self.expert_order)[layer][: self.experts_gpu_per_layer]

    def cpu_expert_ids(self, layer: int) -> tuple[int, ...]:
        """Expert ids of MoE layer ``layer`` computed by the CPU workers."""
        return dict(self.expert_order)[layer][self.experts_gpu_per_layer:]


def plan_memory(config: ModelConfig, *, dtype: str = "bfloat16", backend: str = "cupy",
                gpu_budget_bytes: int | None = None, max_slots: int = 4,
                max_context: int = 4096, kv_block_size: int = 64,
                kv_cache_dtype: str = "model", prefill_chunk: int = 512,
                prefix_cache: bool = True, prefix_cache_mb: int = 1024, max_drafts: int = 0,
                prefix_cache_host_mb: int = 0,
                placement: str = "split", cpu_experts_per_layer: int = 0,
                hot_counts: Mapping[int, np.ndarray] | None = None, cpu_workers: int = 1,
                include_mtp: bool = True,
                host_available_bytes: int | None = -1, cpu_format: str = "int8",
                cuda_graphs: bool = False, gpu_format: str = "model",
                graph_buckets: bool = False) -> MemoryPlan:
    """The plan for ``config`` served with these settings, or :class:`PlanError`.

    ``gpu_budget_bytes`` None: no GPU limit (pass the device's size for "the whole device").
    ``placement`` "split" with ``cpu_experts_per_layer`` 0 puts as many experts on the GPU as
    fit; a count > 0 is kept and only checked. ``host_available_bytes`` -1: MemAvailable of
    /proc/meminfo; None: no host check. ``gpu_format`` "int8": the backend's routed experts as
    int8 blocks of 32 (1.0625 bytes a weight). ``prefix_cache_host_mb``: the prefix cache's host
    tier, counted in the host's fixed bytes. Pure apart from that one read.
    """
    if dtype not in mp.WEIGHT_ITEMSIZE:
        raise ValueError(f"dtype must be one of {', '.join(mp.WEIGHT_ITEMSIZE)}, got {dtype!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if host_available_bytes == -1:
        host_available_bytes = mp.mem_available()
    shapes = expected_tensors(config, include_mtp=include_mtp)
    moe_layers = tuple(i for i in range(config.num_hidden_layers) if config.is_sparse(i))
    E = config.num_experts if moe_layers else 0
    weights = 3 * config.moe_intermediate_size * config.hidden_size  # per expert
    H, I = config.hidden_size, config.moe_intermediate_size
    if gpu_format == "int8" and E and (H % 32 or I % 32):
        raise PlanError(f"gpu_format 'int8' stores the experts in blocks of 32, which need "
                        f"hidden_size and moe_intermediate_size to be multiples of 32; this "
                        f"model has {H} and {I}: use gpu_format 'model'")
    if placement != "gpu" and E and (H % 32 or I % 32):  # the CPU experts' blocks of 32
        raise PlanError(f"placement {placement!r} puts experts on the CPU, whose int8/int4 "
                        f"blocks of 32 need hidden_size and moe_intermediate_size to be "
                        f"multiples of 32; this model has {H} and {I}: use placement 'gpu'")

    # KV blocks: every slot's max_context plus the prefix cache's (gpu_worker/server.py)
    mtp_kv = 1 if include_mtp and config.num_mtp_layers else 0
    kv_block = block_bytes(len(config.full_attention_layers) + mtp_kv, kv_block_size,
                           config.num_key_value_heads, config.head_dim,
                           mp.compute_itemsize(dtype), quant=kv_cache_dtype == "int8")
    per_slot = -(-max_context // kv_block_size)
    extra = prefix_blocks(prefix_cache, prefix_cache_mb, kv_block, per_slot, max_slots)
    rec, gdn_slot = mp.gdn_state_bytes(config, dtype)
    workers = max(1, cpu_workers)
    plan = MemoryPlan(
        dtype=dtype, backend=backend, placement=placement, gpu_budget_bytes=gpu_budget_bytes,
        dense_parts=mp.dense_parts(shapes, dtype, tied=config.tie_word_embeddings),
        kv_block_bytes=kv_block,
        kv_blocks=max_slots * per_slot + extra, kv_prefix_blocks=extra,
        gdn_state_bytes_per_slot=gdn_slot, max_slots=max_slots,
        prefix_snapshots=_prefix_snapshots(extra, prefix_cache_mb, kv_block, gdn_slot),
        speculation_bytes=max_slots * (max_drafts + 1) * rec if max_drafts else 0,
        work_parts=mp.work_parts(config, shapes, dtype, max_slots=max_slots,
                                 max_context=max_context, prefill_chunk=prefill_chunk,
                                 max_drafts=max_drafts)
        + ((("CUDA graphs", mp.graph_bytes(
            config, max_slots=max_slots, max_drafts=max_drafts, buckets=graph_buckets,
            scratch_bytes=kv_block * -(-MAX_PAD // kv_block_size))),)
           if cuda_graphs and backend == "cupy" else ()),
        moe_layers=moe_layers, num_experts=E,
        gpu_bytes_per_expert=(weights * 17 // 16 if gpu_format == "int8"  # + fp16 per 32
                              else weights * mp.WEIGHT_ITEMSIZE[dtype]),
        gpu_format=gpu_format,
        cpu_bytes_per_expert=weights * mp.CPU_BYTES_PER_WEIGHT_BY_FORMAT[cpu_format],
        cpu_format=cpu_format, experts_gpu_per_layer=E,
        expert_order=mp.expert_order(moe_layers, E, hot_counts), cpu_expert_bytes=0,
        cpu_ring_bytes=0, cuda_context_bytes=CUDA_CONTEXT if backend == "cupy" else 0,
        host_fixed_bytes=HOST_PROCESS + LOAD_WORKING_SET
        + (prefix_cache_host_mb * 2**20 if prefix_cache else 0),
        host_available_bytes=host_available_bytes)
    n_gpu = _experts_that_fit(plan, placement, cpu_experts_per_layer)
    n_cpu = E - max(n_gpu, 0)
    if n_cpu:  # each layer's share of every worker: two tensors, each 64-aligned
        plan = dataclasses.replace(
            plan, experts_gpu_per_layer=E - n_cpu,
            cpu_expert_bytes=math.ceil(len(moe_layers) * (n_cpu * plan.cpu_bytes_per_expert
                                                          + 2 * workers * mp.CPU_ALIGN)),
            cpu_ring_bytes=Ring.size(workers, RING_ROWS, config.hidden_size, RING_K),
            host_fixed_bytes=plan.host_fixed_bytes + workers * HOST_PER_CPU_WORKER)
    plan = dataclasses.replace(plan, placement=("gpu" if not n_cpu else
                                                "cpu" if n_cpu == E else "split"))
    _check(plan, placement, cpu_experts_per_layer)
    return plan


def _prefix_snapshots(prefix_blocks: int, max_mb: int, block: int, state: int) -> int:
    """GDN state copies the prefix cache may hold: one per entry, at most MAX_PREFIX_ENTRIES
    entries, each pinning a block or more, and entries' blocks plus copies within max_mb
    (daemon/prefix_cache.py)."""
    if not state or not prefix_blocks:
        return 0
    return min(MAX_PREFIX_ENTRIES, prefix_blocks, max_mb * 2**20 // (block + state))


def plan_for_worker(cfg: WorkerConfig, model: ModelConfig, *, backend: str,
                    hot_counts: Mapping[int, np.ndarray] | None = None, include_mtp: bool = True,
                    host_available_bytes: int | None = -1) -> MemoryPlan:
    """:func:`plan_memory` with the settings of the worker's config: the one mapping, used by
    the worker's load and by `tandem check-config` alike. ``backend``: "cupy" or "numpy" (an
    "auto" config resolved by the caller). On CuPy without ``gpu_memory_gb`` the budget is the
    whole device (none where no device is visible)."""
    budget = cfg.gpu_budget_bytes
    if budget is None and backend == "cupy":
        budget = mp.device_memory_bytes()
    if host_available_bytes == -1 and cfg.cpu_shard_cache:  # kept shards this load reuses
        avail = mp.mem_available()                          # or replaces
        host_available_bytes = None if avail is None else avail + reclaimable_bytes(
            cfg.cpu_shard_cache)
    return plan_memory(
        model, dtype=cfg.dtype, backend=backend, gpu_budget_bytes=budget,
        max_slots=cfg.max_slots, max_context=cfg.max_context, kv_block_size=cfg.block_size,
        kv_cache_dtype=cfg.kv_cache_dtype, prefill_chunk=cfg.prefill_chunk,
        prefix_cache=cfg.prefix_cache, prefix_cache_mb=cfg.prefix_cache_max_mb,
        prefix_cache_host_mb=cfg.prefix_cache_host_mb,
        max_drafts=cfg.max_drafts, placement=cfg.placement,
        cpu_experts_per_layer=cfg.cpu_experts_per_layer, hot_counts=hot_counts,
        cpu_workers=cfg.cpu_workers or len(cfg.cpu_cores) or len(numa_core_groups()),
        include_mtp=include_mtp, host_available_bytes=host_available_bytes,
        cpu_format=cfg.cpu_format, cuda_graphs=cfg.cuda_graphs, gpu_format=cfg.gpu_format,
        graph_buckets=cfg.graph_buckets)


def _experts_that_fit(plan: MemoryPlan, placement: str, cpu_per_layer: int) -> int:
    """Routed experts per layer on the GPU; -1 when not even the fixed part fits."""
    E, budget = plan.num_experts, plan.gpu_budget_bytes
    if placement == "gpu" or not E:
        return E
    if placement == "cpu":
        return 0
    if cpu_per_layer:
        return max(0, E - cpu_per_layer)
    if budget is None:
        return E
    # total(n) = (fixed + n * per_n) * (1 + slack) + context <= budget
    slack = 1 + (ALLOCATOR_SLACK if plan.backend == "cupy" else 0)
    room = (budget - plan.cuda_context_bytes) / slack - plan.gpu_fixed_bytes
    per_n = max(1, len(plan.moe_layers) * plan.gpu_bytes_per_expert)
    return -1 if room < 0 else min(E, int(room // per_n))


def _check(plan: MemoryPlan, placement: str, cpu_per_layer: int) -> None:
    """PlanError when ``plan`` is over the GPU budget or the host's RAM."""
    budget, total = plan.gpu_budget_bytes, plan.gpu_total_bytes
    if budget is not None and total > budget:
        E, n = plan.num_experts, plan.experts_gpu_per_layer
        if placement == "gpu" and E:
            why = (f"placement 'gpu' keeps all {E} experts of {len(plan.moe_layers)} layers "
                   f"({gib(plan.gpu_expert_bytes)}) on the GPU; use placement = 'split'")
        elif n and cpu_per_layer:
            why = (f"experts.cpu_experts_per_layer = {cpu_per_layer} leaves {n} experts per "
                   f"layer on the GPU; raise it, or leave it out and the plan chooses")
        else:
            why = ("lower scheduler.max_slots, max_context, prefill_chunk or "
                   "prefix_cache_max_mb, set kv_cache_dtype = 'int8', or raise "
                   "experts.gpu_memory_gb")
        big = sorted((p for p in gpu_parts(plan) if p[1]), key=lambda p: -p[1])[:4]
        raise PlanError(f"needs {gib(total)} of GPU memory, {gib(total - budget)} over the "
                        f"{gib(budget)} budget ({', '.join(f'{k} {gib(b)}' for k, b in big)}): "
                        f"{why}", plan)
    avail, need = plan.host_available_bytes, plan.host_needed_bytes
    if avail is not None and need > avail:
        raise PlanError(f"needs {gib(need)} of host RAM (CPU experts "
                        f"{gib(plan.cpu_expert_bytes)}, processes and loading "
                        f"{gib(need - plan.cpu_expert_bytes)}), {gib(need - avail)} over the "
                        f"{gib(avail)} available: keep more experts on the GPU (raise "
                        f"experts.gpu_memory_gb) or free host memory", plan)


def gpu_parts(plan: MemoryPlan) -> list[tuple[str, int]]:
    """Every GPU part of ``plan`` as ``(name, bytes)``, allowances last."""
    return [*plan.dense_parts, ("KV cache", plan.kv_cache_bytes),
            ("GDN states", plan.gdn_state_bytes),
            ("prefix GDN snapshots", plan.prefix_snapshot_bytes),
            ("speculation", plan.speculation_bytes), *plan.work_parts,
            ("routed experts", plan.gpu_expert_bytes),
            ("allocator slack", plan.allocator_slack_bytes),
            ("CUDA context", plan.cuda_context_bytes)]


def describe(plan: MemoryPlan) -> list[str]:
    """The plan as a few lines for `tandem check-config` and the worker's log."""
    where = "GPU" if plan.backend == "cupy" else "host (NumPy backend)"
    budget = "no limit" if plan.gpu_budget_bytes is None else gib(plan.gpu_budget_bytes)
    dense = ", ".join(f"{k} {gib(b)}" for k, b in plan.dense_parts if b)
    work = ", ".join(f"{k} {gib(b)}" for k, b in plan.work_parts if b)
    spec = f"; speculation: {gib(plan.speculation_bytes)}" if plan.speculation_bytes else ""
    host = ("not checked" if plan.host_available_bytes is None
            else f"{gib(plan.host_available_bytes)} available")
    return [
        f"weights: {plan.dtype} on the {where}; GPU budget {budget}",
        f"dense parts: {gib(plan.dense_bytes)} ({dense})",
        f"KV cache: {gib(plan.kv_cache_bytes)}, {plan.kv_blocks} blocks of "
        f"{gib(plan.kv_block_bytes)} ({plan.kv_prefix_blocks} for the prefix cache)",
        f"GDN states: {gib(plan.gdn_state_bytes)} ({gib(plan.gdn_state_bytes_per_slot)} per "
        f"slot); prefix snapshots: {plan.prefix_snapshots}, "
        f"{gib(plan.prefix_snapshot_bytes)}{spec}",
        f"work space: {gib(plan.work_bytes)} ({work})"
        + (f"; allocator slack {gib(plan.allocator_slack_bytes)}, CUDA context "
           f"{gib(plan.cuda_context_bytes)}" if plan.backend == "cupy" else ""),
        f"routed experts per layer: {plan.experts_gpu_per_layer} of {plan.num_experts} on the "
        f"GPU ({gib(plan.gpu_expert_bytes)} over {len(plan.moe_layers)} layers"
        f"{', int8' if plan.gpu_format == 'int8' else ''}), "
        f"{plan.experts_cpu_per_layer} on the CPU ({gib(plan.cpu_expert_bytes)} "
        f"{plan.cpu_format}); "
        f"placement {plan.placement}",
        f"GPU total: {gib(plan.gpu_total_bytes)} of {budget}",
        f"host RAM: {gib(plan.cpu_resident_bytes)} resident, {gib(plan.host_needed_bytes)} "
        f"at the peak of loading; {host}",
    ]


def gib(n: float) -> str:
    """Bytes for people: GiB with one decimal, MiB below 1 GiB."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"
