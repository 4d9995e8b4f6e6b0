"""Full (softmax) attention over a ragged batch with a paged KV cache.

Qwen3-MoE: per-head q/k RMSNorm before rotate-half RoPE, GQA, scale hd^-0.5.
Qwen3-Next adds an output gate (q_proj emits [query | gate] per head), zero-centred q/k
norms and partial RoPE.

On CuPy float32 the q and k heads are normalised and rotated in one launch
(``Ops.qk_norm_rope``, the bits of two norms and two RoPE launches), every row's K/V goes
into the cache in one launch, and every row attends through the paged-attention kernels
(gpu_worker/kernels/paged_attention.py): its bits depend only on its own query, position and
prefix, never on the other rows of the step. The rows of segments of at most
:data:`PAGED_MAX_ROWS` rows (decode and verify rows, short prefill chunks) share one launch;
a longer segment (a prefill chunk) runs the same kernels in launches of a bounded number of
(row, partition) pairs (:data:`LONG_ROW_PARTITIONS`: the workspace stays small at long
contexts). So a prompt's rows give the same bits however it was cut into chunks, whatever
the prefix cache held, and as the decode rows that wrote those positions in an earlier turn:
a conversation's next turn sees the same cache whether it re-prefilled or hit the prefix
cache (seen on the H100 machine: with matrix products for long chunks, a coding agent's third
turn changed tokens between two runs of the same requests). NumPy, and CuPy with the paged
kernels off, use the per-segment matrix products for every segment.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gpu_worker.kernels import paged_attention as paged
from gpu_worker.kernels.enabled import enabled
from gpu_worker.kv_cache import KVCache
from gpu_worker.model.batch import RaggedBatch, Segment
from gpu_worker.model.ops import Array, Ops
from gpu_worker.model_config import ModelConfig

PAGED_MAX_ROWS = 16  # a segment of more rows (a prefill chunk) gets launches of its own
# rows x partitions of one long segment's launch: its workspace (max, sum and hd values per
# q head) stays under ~64 MiB for 16 q heads of 256 dims in float32
LONG_ROW_PARTITIONS = 4096
# a long segment's rows a warp computes together (one slot's consecutive rows: each key and
# value loaded once for them), its blocks' warps and compile bound (paged.paged_attention);
# speed only, never a bit. The fastest of six shapes on the H100 machine (da14ff6, python -m
# scripts.bench_attention --prefill, docs/bench/prefill_attention_h100_da14ff6.json): 512
# rows after 3,584 positions 5.35 ms against 9.08 at one row a warp (4.17 since 1c5ac99)
LONG_ROWS_PER_WARP, LONG_BLOCK_WARPS, LONG_MIN_BLOCKS = 2, 8, 2
QKV_STACK = "qkv_stack"  # q, k, v projections in one matrix (model.stack_inputs)
QKV_PARTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
# gated attention on CuPy: q_proj's rows (per head: query, then gate) regrouped at load into
# every head's query, then every head's gate (:func:`q_rows`): both come out contiguous
QKV_GATED_PARTS = ("q_query.weight", "q_gate.weight", "k_proj.weight", "v_proj.weight")


def q_rows(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a gated q_proj ``[Hq * 2 hd, H]`` that make q_query and q_gate."""
    hd = cfg.head_dim
    heads = np.arange(cfg.num_attention_heads)[:, None] * 2 * hd
    return ((heads + np.arange(hd)).ravel(), (heads + hd + np.arange(hd)).ravel())


def full_attention(ops: Ops, cfg: ModelConfig, p: dict[str, Array], x: Array,
                   batch: RaggedBatch, cos: Array, sin: Array,
                   kv: KVCache, layer: int, meta: StepMeta | None = None) -> Array:
    """x [R, H] (normed) -> attention output [R, H]; writes this batch's K/V into ``kv``.
    ``meta``: the paged kernels' metadata when the step built it beforehand."""
    xp = ops.xp
    R, hd = x.shape[0], cfg.head_dim
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    gate = None
    parts = QKV_GATED_PARTS if QKV_GATED_PARTS[0] in p else QKV_PARTS
    outs = ops.linear_parts(x, p, parts, QKV_STACK)  # one launch with the stack
    if parts is QKV_GATED_PARTS:  # regrouped rows: query and gate contiguous
        q, gate, k, v = outs
    else:
        q, k, v = outs
        if cfg.gated_attention:
            q = q.reshape(R, Hq, 2 * hd)  # [R, Hq, query | gate]
            q, gate = q[..., :hd], q[..., hd:].reshape(R, Hq * hd)
    q = q.reshape(R, Hq, hd)
    k, v = k.reshape(R, Hkv, hd), v.reshape(R, Hkv, hd)
    q, k = ops.qk_norm_rope(q, k, p["q_norm.weight"], p["k_norm.weight"], cfg.rms_norm_eps,
                            cos, sin, zero_centered=cfg.zero_centered_norms)  # one launch

    scale = ops.dtype.type(hd ** -0.5)
    if xp is np or not enabled("paged_attention"):
        out = xp.empty((R, Hq, hd), dtype=ops.dtype)
        for seg in batch.segments:
            kv.write(layer, seg.slot, seg.start, k[seg.rows], v[seg.rows])
            out[seg.rows] = _segment(ops, q[seg.rows], kv, layer, seg, scale)
    else:
        out = _paged(ops, q, k, v, batch, kv, layer, scale, meta)
    out = out.reshape(R, Hq * hd)
    if gate is not None:
        out = ops.sigmoid_mul(gate, out)  # sigmoid(gate) * out: the product commutes
    return ops.linear(out, p["o_proj.weight"], p.get("o_proj.bias"))


def compile_long_launches(kv: KVCache, dtype) -> None:
    """On CuPy with the paged kernels: compile the long segments' attention kernel now,
    before serving (else the first prompt of more than :data:`PAGED_MAX_ROWS` tokens waits
    for its compile)."""
    if kv.xp is not np and enabled("paged_attention"):
        paged.compile_attention(kv, dtype, LONG_ROWS_PER_WARP, LONG_MIN_BLOCKS)


def _segment(ops: Ops, q: Array, kv: KVCache, layer: int, seg: Segment, scale) -> Array:
    """One segment's rows q [n, Hq, hd] against its slot's keys 0..seg.end-1 (already
    written), causal -> [n, Hq, hd]: matrix products and a softmax over the whole prefix."""
    xp = ops.xp
    n, Hq, hd = q.shape
    keys, values = kv.read(layer, seg.slot, seg.end)  # [L, Hkv, hd]
    Hkv = keys.shape[1]
    qh = q.reshape(n, Hkv, Hq // Hkv, hd).transpose(1, 2, 0, 3)  # [Hkv, g, n, hd]
    scores = (qh @ keys.transpose(1, 2, 0)[:, None]) * scale  # [Hkv, g, n, L]
    masked = xp.arange(seg.end)[None, :] > xp.arange(seg.start, seg.end)[:, None]  # [n, L]
    probs = ops.softmax(xp.where(masked, -xp.inf, scores), axis=-1)
    o = probs @ values.transpose(1, 0, 2)[:, None]  # [Hkv, g, n, hd]
    return o.transpose(2, 0, 1, 3).reshape(n, Hq, hd)


@dataclasses.dataclass
class StepMeta:
    """A batch's device metadata for the kernels, built once per batch (every layer reuses
    it) while the cache's tables keep the version they had when it was built."""

    batch: RaggedBatch
    version: int
    write: Array  # int32 [3, R]: batch row, slot, position of every row
    paged: Array  # int32 [3, n]: the same for the rows of the paged-attention launch
    # the long segments' launches (:func:`long_launches`): their rows' int32 [3, m] and the
    # last position among them
    long: tuple[tuple[Array, int], ...]
    max_position: int  # >= the batch's last position: sizes the partitioned launch


def long_launches(batch: RaggedBatch) -> list[tuple[int, int, int]]:
    """(first row, end row, last position) of each paged launch of the segments of more than
    :data:`PAGED_MAX_ROWS` rows: at most :data:`LONG_ROW_PARTITIONS` (row, partition) pairs
    each, so the workspace stays small at long contexts (the launches' sizes never change a
    bit: each row is computed as a lone decode row at its position)."""
    out = []
    for seg in batch.segments:
        if seg.num <= PAGED_MAX_ROWS:
            continue
        step = max(1, LONG_ROW_PARTITIONS // ((seg.end - 1) // paged.PARTITION + 1))
        for a in range(seg.row0, seg.row0 + seg.num, step):
            b = min(a + step, seg.row0 + seg.num)
            out.append((a, b, seg.start + (b - seg.row0) - 1))
    return out


def step_meta_host(kv: KVCache, batch: RaggedBatch) -> np.ndarray:
    """The host side of a batch's :class:`StepMeta`: allocates the segments' KV blocks and
    copies shared ones (copy-on-write), then returns int32 [3R + 3n + ...]: row, slot,
    position of every row, then of the rows of the paged launch (segments of <=
    PAGED_MAX_ROWS rows), then of each long segment launch's rows (:func:`long_launches`)."""
    for seg in batch.segments:
        kv.reserve(seg.slot, seg.start, seg.num)
    R = batch.num_rows
    slots = np.repeat([s.slot for s in batch.segments], [s.num for s in batch.segments])
    rows = np.stack([np.arange(R), slots, batch.positions]).astype(np.int32)  # [3, R]
    short = np.concatenate([np.full(s.num, s.num <= PAGED_MAX_ROWS) for s in batch.segments])
    return np.concatenate([rows.ravel(), rows[:, short].ravel(),
                           *(rows[:, a:b].ravel() for a, b, _ in long_launches(batch))])


def step_meta(kv: KVCache, batch: RaggedBatch, dev: Array,
              max_position: int | None = None) -> StepMeta:
    """The :class:`StepMeta` over ``dev``, :func:`step_meta_host` on the backend.
    ``max_position``: the batch's last position when None (a CUDA graph passes the context
    limit: its grid must cover any step it replays; a row's bits do not depend on it)."""
    R = batch.num_rows
    n = sum(s.num for s in batch.segments if s.num <= PAGED_MAX_ROWS)
    at, long = 3 * (R + n), []
    for a, b, last in long_launches(batch):
        long.append((dev[at:at + 3 * (b - a)].reshape(3, b - a), last))
        at += 3 * (b - a)
    top = int(batch.positions.max(initial=0)) if max_position is None else max_position
    return StepMeta(batch, kv.version, dev[:3 * R].reshape(3, R),
                    dev[3 * R:3 * (R + n)].reshape(3, n), tuple(long), top)


def _step_meta(xp, kv: KVCache, batch: RaggedBatch) -> StepMeta:
    meta = kv.paged_meta
    if meta is not None and meta.batch is batch and meta.version == kv.version:
        return meta
    kv.paged_meta = step_meta(kv, batch, xp.asarray(step_meta_host(kv, batch)))  # one upload
    return kv.paged_meta


def _paged(ops: Ops, q: Array, k: Array, v: Array, batch: RaggedBatch, kv: KVCache,
           layer: int, scale, meta: StepMeta | None = None) -> Array:
    """The CuPy path: one K/V write launch, one paged-attention launch for the short
    segments' rows, then the long segments' launches (:func:`long_launches`) -> [R, Hq, hd].
    ``meta``: the step's (gpu_worker/step_inputs.py), else built here once per batch."""
    xp = ops.xp
    meta = meta if meta is not None else _step_meta(xp, kv, batch)
    tables = kv.device_tables()
    q, k, v = (xp.ascontiguousarray(a) for a in (q, k, v))
    paged.write_kv(kv, layer, k, v, meta.write, tables)
    out = xp.empty(q.shape, dtype=ops.dtype)
    paged.paged_attention(q, kv, layer, meta.paged, tables, out, scale,
                          max_position=meta.max_position)
    for rows, last in meta.long:
        paged.paged_attention(q, kv, layer, rows, tables, out, scale, max_position=last,
                              rows_per_warp=LONG_ROWS_PER_WARP, block_warps=LONG_BLOCK_WARPS,
                              min_blocks=LONG_MIN_BLOCKS)
    return out
