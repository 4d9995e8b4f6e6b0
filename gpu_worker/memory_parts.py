"""Bytes of each part of a served model, counted from its config alone (no weights read).

The pieces of gpu_worker/memory_plan.py's plan: dense weights by part (from the shapes of
``weights_spec.expected_tensors``), GDN state per slot, the work-space allowance, and the
order in which the GPU takes a layer's routed experts. docs/memory.md states the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from cpu_experts.formats import bytes_per_weight
from cpu_experts.tiles import BLOCK_BYTES, TU
from gpu_worker.expert_stats import hot_order
from gpu_worker.kernels.paged_attention_ref import PARTITION
from gpu_worker.model.moe import GROUPED_MAX_ROWS
from gpu_worker.model_config import ModelConfig
from protocol.worker_config import padded_rows

Shapes = Mapping[str, tuple[int, ...]]
Parts = tuple[tuple[str, int], ...]

WEIGHT_ITEMSIZE = {"bfloat16": 2, "float32": 4, "float64": 8}
# CPU format (cpu_experts/tiles.py): per block of 32 weights of 16 units, 512 int8 bytes then
# 16 float32 scales, so 36 bytes per 32 weights; each tensor of a worker's shard is 64-aligned
CPU_BYTES_PER_WEIGHT = BLOCK_BYTES / (TU * 32)
# per [experts] cpu_format: int8 as above; int4 256 bytes of nibbles then 16 fp16 scales
CPU_BYTES_PER_WEIGHT_BY_FORMAT = {f: bytes_per_weight(f) for f in ("int8", "int4")}
CPU_ALIGN = 64
# work-space allowances (docs/memory.md, "Work space")
ACTIVATION_COPIES = 8  # [rows, widest projection] tensors alive at once in one layer
SCORE_COPIES = 3  # attention scores [heads, chunk, context]: scores, masked, probabilities
LOGIT_COPIES = 2  # float32 logits [rows, V] and the sampler's probabilities
# CUDA graphs (gpu_worker/step_graph.py): their memory pool's first reserve, and the rows of
# the logits and hidden states every graph shares, per slot, at first
GRAPH_POOL_RESERVE = 256 << 20
GRAPH_OUTPUT_ROWS_PER_SLOT = 5
DENSE_PARTS = ("embeddings", "lm_head", "attention", "GDN", "norms", "routers",
               "shared experts", "dense MLPs", "MTP head")


def compute_itemsize(dtype: str) -> int:
    """Bytes of activations, "model" KV values, GDN states and vectors: float32 accumulation
    for bf16 weights, float64 for float64."""
    return 8 if dtype == "float64" else 4


def dense_parts(shapes: Shapes, dtype: str, *, tied: bool = False) -> Parts:
    """Bytes per dense part; matrices (model/ops.py's ``is_matrix``: 2-D, or stacked experts)
    in the weight dtype, vectors and conv taps in the compute dtype. The MTP head counts
    whole: its routed experts stay on the GPU. A ``tied`` lm_head is the embedding's array."""
    itemsize, act = WEIGHT_ITEMSIZE[dtype], compute_itemsize(dtype)
    parts = dict.fromkeys(DENSE_PARTS, 0)
    for name, shape in shapes.items():
        part = _part_of(name)
        if part is not None and not (tied and part == "lm_head"):
            matrix = len(shape) >= 2 and "conv1d" not in name
            parts[part] += math.prod(shape) * (itemsize if matrix else act)
    return tuple(parts.items())


def _part_of(name: str) -> str | None:
    if name.startswith("mtp."):
        return "MTP head"
    if ".mlp.experts." in name:
        return None  # routed experts: placed by the plan
    for key, part in ((".self_attn.", "attention"), (".linear_attn.", "GDN"),
                      (".mlp.gate.weight", "routers"), (".shared_expert", "shared experts"),
                      (".mlp.", "dense MLPs"), ("embed_tokens", "embeddings"),
                      ("lm_head", "lm_head")):
        if key in name:
            return part
    return "norms"


def gdn_state_bytes(config: ModelConfig, dtype: str) -> tuple[int, int]:
    """(delta-rule state, conv window + delta-rule state) bytes of one slot over all GDN
    layers (states.py: conv [K-1, C] and rec [Hv, Dk, Dv], at least float32)."""
    act = compute_itemsize(dtype)
    layers = len(config.linear_attention_layers) if config.is_next else 0
    rec = (layers * config.linear_num_value_heads * config.linear_key_head_dim
           * config.linear_value_head_dim * act)
    conv = layers * max(config.linear_conv_kernel_dim - 1, 0) * config.linear_conv_dim * act
    return rec, rec + conv


def work_parts(config: ModelConfig, shapes: Shapes, dtype: str, *, max_slots: int,
               max_context: int, prefill_chunk: int, max_drafts: int) -> Parts:
    """The work-space allowance; the largest forward has ``rows`` rows: every slot brings a
    prefill chunk, or its decode token plus its drafts (daemon/scheduler.py)."""
    act = compute_itemsize(dtype)
    rows = max_slots * max(prefill_chunk, 1 + max_drafts)
    dense = [(n, s) for n, s in shapes.items() if len(s) == 2 and ".experts." not in n]
    widest = max([max(s) for n, s in dense if "embed" not in n and "lm_head" not in n]
                 + [2 * config.hidden_size])  # the MTP fc's input is [rows, 2H]
    chunk = min(prefill_chunk, max_context)  # one segment's rows against the whole context
    scores = SCORE_COPIES * config.num_attention_heads * chunk * max_context * act
    gathered = 2 * max_context * config.num_key_value_heads * config.head_dim * act
    # paged attention's per-partition max, sum and values of every decode or verify row
    paged = (max_slots * (1 + max_drafts) * (max_context // PARTITION + 1)
             * config.num_attention_heads * (config.head_dim + 2) * act)
    logits = LOGIT_COPIES * max_slots * (1 + max_drafts) * config.vocab_size * 4
    experts = (min(rows, GROUPED_MAX_ROWS) * config.num_experts_per_tok
               * (config.hidden_size + 2 * config.moe_intermediate_size) * act)
    # a bf16 matrix may be widened to float32 for one product at a time: the largest one
    widen = max(math.prod(s) * 4 for _, s in dense) if dtype == "bfloat16" else 0
    return (("activations", ACTIVATION_COPIES * rows * widest * act),
            ("attention scores", scores + gathered + paged), ("logits", logits),
            ("expert scratch", experts), ("bf16 widening", widen))


def graph_output_rows(max_slots: int, max_drafts: int, buckets: bool) -> int:
    """Rows of the logits and hidden states every graph shares: the largest decode or verify
    pass's, padded up to its capacity bucket with ``buckets`` (gpu_worker/graph_buckets.py)."""
    rows = max_slots * max(1 + max_drafts, GRAPH_OUTPUT_ROWS_PER_SLOT)
    return padded_rows(rows) if buckets else rows


def graph_bytes(config: ModelConfig, *, max_slots: int, max_drafts: int,
                buckets: bool = False, scratch_bytes: int = 0) -> int:
    """What CUDA graphs add on the GPU: the pool's reserve (every graph's temporaries come
    from it) and the shared float32 logits and hidden rows of the largest decode or verify
    pass; with capacity buckets also ``scratch_bytes``, the padding rows' scratch slot (its
    KV blocks; it has no GDN state). Each graph keeps only its inputs and sampled tokens besides (a
    few KiB)."""
    rows = graph_output_rows(max_slots, max_drafts, buckets)
    return (GRAPH_POOL_RESERVE + rows * (config.vocab_size + config.hidden_size) * 4
            + (scratch_bytes if buckets else 0))


def expert_order(moe_layers: tuple[int, ...], num_experts: int,
                 hot_counts: Mapping[int, np.ndarray] | None
                 ) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Per MoE layer its expert ids in the order the GPU takes them: hottest first by
    ``hot_counts`` (gpu_worker/expert_stats.py), else ascending (the last ids go to the CPU)."""
    out = []
    for layer in moe_layers:
        if hot_counts is not None and layer in hot_counts:
            order = tuple(int(e) for e in hot_order(hot_counts[layer]))
        else:
            order = tuple(range(num_experts))
        out.append((layer, order))
    return tuple(out)


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_memory_bytes() -> int | None:
    """The current CUDA device's total memory; None without CuPy or a device."""
    try:
        import cupy  # noqa: PLC0415 (only where a GPU is asked about)

        return int(cupy.cuda.runtime.memGetInfo()[1])
    except Exception:  # ImportError, CUDARuntimeError: no usable device here
        return None
