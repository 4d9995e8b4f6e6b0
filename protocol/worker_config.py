"""Everything the GPU worker process is started with: one frozen, validated dataclass.

The daemon builds it from its Config (daemon/lifecycle.py) and hands it to
``python -m gpu_worker.server --config JSON``; the worker decodes it with `from_json` and
reads nothing else. The choice lists below are the only ones: daemon/config.py checks its
keys against them too.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np

DTYPES = ("float32", "float64", "bfloat16")  # bfloat16: bf16 weights, float32 compute
BACKENDS = ("numpy", "cupy", "auto")
KV_CACHE_DTYPES = ("model", "int8")  # model: the compute dtype; int8: + an fp16 scale per 32
PLACEMENTS = ("gpu", "cpu", "split")  # where the routed experts run
CPU_ISAS = ("auto", "portable", "avx2", "avx512vnni", "amx")  # CPU expert kernels (isa.py)
CPU_FORMATS = ("int8", "int4")  # CPU expert weights (cpu_experts/formats.py)
# GPU routed experts: the model dtype, or int8 blocks of 32 (gpu_worker/kernels/int8_stack.py)
GPU_FORMATS = ("model", "int8")
SPECULATION_MODES = ("off", "narrow", "wide")  # how drafted slots are verified
# what Runner.warm_graphs captures before READY: the decode layouts, or the verify ones too
GRAPH_WARM_UPS = ("decode", "all")
WIDE_CAPACITIES = (8, 12, 16)  # decode rows of a wide verify pass (daemon/draft_plan.py)
# rows a decode or verify pass is padded up to where the worker pads (ModelInfo.padded_passes;
# gpu_worker/graph_buckets.py): the speculation capacities and the few-slot decode sizes
GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16)
MAX_WIDE_SLOTS = 4  # drafted slots in one wide pass
HEARTBEAT_S = 1.0
GIB = 2**30  # gpu_memory_gb counts GiB, the unit CUDA and nvidia-smi report devices in
# NOTE: the daemon's PrefixCache holds at most this many checkpoints; each keeps a copy of
# its slot's GDN states on the device, which the memory plan counts
MAX_PREFIX_ENTRIES = 256


def padded_rows(rows: int | np.ndarray, buckets: tuple[int, ...] = GRAPH_BUCKETS
                ) -> int | np.ndarray:
    """The rows passes of ``rows`` rows (an int or an int array) run with when padded: up to
    the smallest of ``buckets`` that holds them; rows past the largest, no rows, and any rows
    with no buckets (``()``: an unpadded worker) as they are. The worker pads by it
    (gpu_worker/graph_buckets.py) and the daemon's draft budget prices passes by it."""
    if isinstance(rows, int | np.integer):  # the worker's once a pass: no arrays (~0.5 us)
        at = bisect.bisect_left(buckets, rows)
        return int(buckets[at] if rows > 0 and at < len(buckets) else rows)
    r = np.asarray(rows)
    if buckets:
        b = np.asarray(buckets)
        at = np.searchsorted(b, r)  # the first bucket >= rows
        r = np.where((r > 0) & (at < len(b)), b[np.minimum(at, len(b) - 1)], r)
    return r


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _count(name: str, value: object, lo: int) -> None:
    if type(value) is not int or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")


def prefix_blocks(enabled: bool, max_mb: int, block_bytes: int, blocks_per_slot: int,
                  max_slots: int) -> int:
    """KV blocks the prefix cache may pin: `max_mb` MiB of blocks of `block_bytes`, at most
    four slots' worth per slot (and at least one); 0 with the cache off."""
    if not enabled:
        return 0
    return max(1, min(max_mb * 2**20 // max(block_bytes, 1), 4 * blocks_per_slot * max_slots))


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    """The GPU worker's whole configuration (the keys it comes from: configs/tiny.toml and
    docs/architecture.md §9)."""

    run_dir: str  # the worker link's socket lives here
    model: str  # the model directory
    name: str = ""  # served name; "" -> the directory's name
    dtype: str = "float32"
    backend: str = "numpy"
    max_slots: int = 4
    max_context: int = 4096
    block_size: int = 64  # KV tokens per block
    kv_cache_dtype: str = "model"
    prefix_cache: bool = True
    prefix_cache_max_mb: int = 1024  # the prefix cache's KV budget (blocks beyond the slots')
    prefix_cache_host_mb: int = 0  # its host memory tier (the memory plan counts it)
    placement: str = "gpu"
    cpu_experts_per_layer: int = 0
    cpu_workers: int = 0  # 0: one per NUMA node
    cpu_cores: tuple[tuple[int, ...], ...] = ()  # one core list per CPU expert worker
    # the cores the daemon was started on ((): the worker's own): the worker starts there,
    # not on the few the daemon keeps to once a worker is ready (protocol/host_cores.py)
    affinity: tuple[int, ...] = ()
    pin_host: bool = True  # keep to the cores the CPU expert workers leave ([experts] pin_host)
    cpu_isa: str = "auto"  # auto: the best this CPU has
    cpu_format: str = "int8"  # CPU expert weights: int8 (1.125 B/weight) or int4 (0.5625)
    gpu_format: str = "model"  # GPU routed experts: the model dtype, or int8 (1.0625 B)
    hot_experts: str = ""  # split: router counts file; the GPU keeps the hottest experts
    cpu_shard_cache: str = ""  # a directory keeping the CPU experts' shards between runs
    gpu_memory_gb: float | None = None  # GPU budget in GiB; None: the whole device (CuPy)
    prefill_chunk: int = 512  # the daemon's longest prefill segment (sizes the work space)
    max_drafts: int = 0  # draft tokens per slot and step (0: speculation off)
    speculation_mode: str = "off"  # off, narrow or wide: the verify passes' layouts
    slot_routing: bool = False  # SlotResult.cpu_experts per decode slot (adaptive drafts)
    draft_overlap: bool = False  # a pass's MTP drafter under the next pass's CPU experts
    cuda_graphs: bool = True  # decode/verify passes as CUDA graphs where they can be
    graph_warm_up: str = "all"  # captured before READY: decode layouts, or verify ones too
    graph_buckets: bool = True  # passes padded up to the capacity buckets' graphs
    mtp_drafts: int = 0  # MTP drafts per slot the daemon asks for: their graphs warmed too
    graph_mtp: bool = True  # the MTP head's drafting as one CUDA graph per pass
    heartbeat_s: float = HEARTBEAT_S  # a Heartbeat this often while idle

    def __post_init__(self) -> None:
        for name in ("run_dir", "model", "name", "hot_experts", "cpu_shard_cache"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")
        if not self.run_dir or not self.model:
            raise ValueError("run_dir and model must be set")
        _choice("dtype", self.dtype, DTYPES)
        _choice("backend", self.backend, BACKENDS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("placement", self.placement, PLACEMENTS)
        _choice("cpu_isa", self.cpu_isa, CPU_ISAS)
        _choice("cpu_format", self.cpu_format, CPU_FORMATS)
        _choice("gpu_format", self.gpu_format, GPU_FORMATS)
        _choice("speculation_mode", self.speculation_mode, SPECULATION_MODES)
        _choice("graph_warm_up", self.graph_warm_up, GRAPH_WARM_UPS)
        for name, lo in (("max_slots", 1), ("max_context", 1), ("block_size", 1),
                         ("prefix_cache_max_mb", 0), ("prefix_cache_host_mb", 0),
                         ("cpu_experts_per_layer", 0),
                         ("cpu_workers", 0), ("prefill_chunk", 1), ("max_drafts", 0),
                         ("mtp_drafts", 0)):
            _count(name, getattr(self, name), lo)
        for name in ("prefix_cache", "slot_routing", "draft_overlap", "cuda_graphs",
                     "graph_buckets", "graph_mtp", "pin_host"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not all(isinstance(g, tuple) and g and all(type(c) is int and c >= 0 for c in g)
                   for g in self.cpu_cores):
            raise ValueError("cpu_cores must be non-empty tuples of core numbers >= 0")
        if not all(type(c) is int and c >= 0 for c in self.affinity):
            raise ValueError("affinity must be a tuple of core numbers >= 0")
        if self.hot_experts and self.placement != "split":
            raise ValueError("hot_experts needs placement 'split'")
        gb = self.gpu_memory_gb
        if gb is not None and (type(gb) not in (int, float) or not math.isfinite(gb) or gb <= 0):
            raise ValueError(f"gpu_memory_gb must be a number > 0 or None, got {gb!r}")
        if not (isinstance(self.heartbeat_s, int | float) and math.isfinite(self.heartbeat_s)
                and self.heartbeat_s > 0):
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s!r}")

    @property
    def blocks_per_slot(self) -> int:
        return -(-self.max_context // self.block_size)

    @property
    def gpu_budget_bytes(self) -> int | None:
        """gpu_memory_gb in bytes; None: no budget given."""
        return None if self.gpu_memory_gb is None else int(self.gpu_memory_gb * GIB)

    def prefix_blocks(self, block_bytes: int) -> int:
        """KV blocks the prefix cache may pin (:func:`prefix_blocks`)."""
        return prefix_blocks(self.prefix_cache, self.prefix_cache_max_mb, block_bytes,
                             self.blocks_per_slot, self.max_slots)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        """Raises ValueError for anything but a JSON object of known keys and good values."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a WorkerConfig is a JSON object")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown WorkerConfig key(s) {sorted(unknown)}")
        if isinstance(data.get("affinity"), list):
            data["affinity"] = tuple(data["affinity"])
        if isinstance(data.get("cpu_cores"), list):
            data["cpu_cores"] = tuple(tuple(g) if isinstance(g, list) else g
                                      for g in data["cpu_cores"])
        try:
            return cls(**data)
        except TypeError as exc:  # a missing key
            raise ValueError(f"WorkerConfig: {exc}") from None
