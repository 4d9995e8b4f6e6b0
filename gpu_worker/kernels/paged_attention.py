"""Paged attention for every decode and verify row of a step in three launches (CuPy RawModule).

1. ``kv_write``: grid (rows, kv heads); scatters each row's K and V into its slot's block at
   its position (block tables: :meth:`KVCache.device_tables`). An int8 cache quantizes each
   32 values as ``KVCache._quantize`` does (``d = fp16(amax / 127)``, ``q = rint(x / d)``),
   same bytes.
2. ``paged_attn``: grid (rows, kv heads x head blocks, partitions: :func:`grid_partitions`,
   the warps looping over the rest), one warp per q head and partition. A
   row's keys 0..pos are cut in fixed partitions of ``P`` positions (:data:`PARTITION`, 64, a
   constant: partition z holds keys ``[z P, (z + 1) P) & [0, pos]``), so one row keeps many
   SMs busy. A warp takes its partition in chunks of :data:`CHUNK` positions from the
   partition's start; lane L holds dims ``d = L, L + 32, ...`` of q and of its accumulator.
   Per chunk: each score ``s_j`` is the lane partials ``sum_d q_d k_jd`` (d ascending, from
   +0), folded by the xor butterfly (16, 8, 4, 2, 1), times ``scale`` (the chunk's 16 sums are
   folded transposed: the butterfly's additions, each lane keeping half its keys per step, so
   lanes 2j and 2j + 1 end with key j's); the running max ``m``,
   ``alpha = exp(m_old - m)``, ``p_j = exp(s_j - m)`` (computed by lane 2j, shuffled to all),
   ``l = l * alpha + p_0 + p_1 + ...`` and
   ``acc_d = acc_d * alpha + p_0 v_0d + ...`` (ascending j); it stores ``m, l, acc`` of the
   partition. The warps of a block (up to :data:`MAX_WARPS` q heads of one kv head) read the
   same keys, so the L1 serves all but the first; no shared memory, no barrier. A prefill
   chunk's rows (one slot's) may go ``rows_per_warp`` to a warp: each key and value is loaded
   once for them, and each row's arithmetic is still the lone row's, op for op.
3. ``paged_merge``: grid (rows, q heads); ``M = max_z m_z``, ``a_z = exp(m_z - M)``, ``L =
   l_0 a_0 + l_1 a_1 + ...`` and ``A_d = acc_0d a_0 + acc_1d a_1 + ...`` in ascending z; the
   output is ``A / L``. A row with one partition (pos < P) gets ``a_0 = exp(0) = 1`` exactly:
   the bits of the one-level online softmax.

A row's bits depend only on its position, its q and keys, and ``P`` (never on the batch, the
other rows or the grid's size): the same alone or in any layout, and a verify row equals a
decode row at the same position.

``exp`` is not the CUDA library's (NumPy's differs in the last bit): :func:`exp_reference`'s
steps (Cody-Waite reduction by ln 2, Taylor polynomial by Horner, times 2^n) use only ``* + -``
and ``rint``, compiled with ``--fmad=false``, so :func:`attention_reference` (NumPy) gives
the kernel's bits. The math is float32 for float32 models and float64 for float64 ones.
"""

from __future__ import annotations

import functools

import numpy as np

from gpu_worker.kernels import raw_module
from gpu_worker.kernels.paged_attention_ref import CHUNK, PARTITION
from gpu_worker.kernels.paged_attention_ref import attention_reference as attention_reference
from gpu_worker.kernels.paged_attention_ref import exp_reference as exp_reference
from gpu_worker.kernels.paged_attention_src import DIM_SLOTS, MAX_WARPS, attn_kernel
from gpu_worker.kernels.paged_attention_src import source as _source

MAX_DIM = 32 * DIM_SLOTS[-1]  # head dims the kernel holds in registers (8 per lane: 256)
# attention blocks per SM that ptxas must fit: 1 (up to 255 registers a thread; 142 at head
# dim 256) or 2 (128: twice the warps per SM to hide latency, 8 bytes of spills at head dim
# 256). 2 won on the H200 at tree 93288b1 (`python -m scripts.bench_attention --min-blocks
# 1,2`, docs/bench/attention_h200.json): 4 x 4 rows at 4096 tokens 309 us against 600.
MIN_BLOCKS = 2


@functools.cache
def _function(name: str, min_blocks: int = MIN_BLOCKS, rows: int = 1, variant: str | None = None):
    """A kernel of the module compiled for ``min_blocks``, ``rows`` per warp and ``variant``
    (None: all four); looked up once, each module compiled when first used."""
    return raw_module(_source(min_blocks, rows, variant),
                      "paged attention kernels").get_function(name)


def _attn_function(variant: str, hd: int, rows_per_warp: int, min_blocks: int | None):
    """The attention kernel of a launch: a module of one variant where ``rows_per_warp`` > 1
    (compiled when first used), else the decode rows' module of all four."""
    more = (rows_per_warp, variant) if rows_per_warp > 1 else (1, None)
    return _function(attn_kernel(variant, hd, rows_per_warp), min_blocks or MIN_BLOCKS, *more)


def compile_attention(kv, dtype, rows_per_warp: int = 1, min_blocks: int | None = None) -> None:
    """Compile (or load from CuPy's kernel cache) the attention kernel that launches of
    ``dtype`` activations over ``kv`` with these settings take, before they are needed."""
    _check_dtype(kv, np.dtype(dtype))
    _attn_function(_variant(dtype, kv.quant), kv.head_dim, rows_per_warp, min_blocks)


def _variant(dtype, quant: bool) -> str:
    if np.dtype(dtype) not in (np.float32, np.float64):
        raise TypeError(f"paged attention computes in float32 or float64, not {dtype}")
    return ("f32" if np.dtype(dtype) == np.float32 else "f64") + ("_i8" if quant else "")


def _check_dtype(kv, dtype) -> None:
    if not kv.quant and kv.k.dtype != dtype:
        raise TypeError(f"a {kv.k.dtype} cache with {dtype} activations")


def _pool_args(kv) -> tuple:
    scales = (kv.ks, kv.vs) if kv.quant else (kv.k, kv.v)  # unused pointers when not int8
    return kv.k, kv.v, *scales


def write_kv(kv, layer: int, k, v, meta, tables) -> None:
    """Store ``k, v [R, Hkv, hd]`` (the compute dtype) at each row's (slot, position) given
    by ``meta`` (int32 [3, n] on the device: batch row, slot, position; blocks reserved)."""
    n = meta.shape[1]
    if n == 0:
        return
    hd = kv.head_dim
    _check_dtype(kv, k.dtype)
    fn = _function(f"kv_write_{_variant(k.dtype, kv.quant)}")
    k, v = (a.reshape(-1, kv.kv_heads, hd) for a in (k, v))
    fn((n, kv.kv_heads), (-(-hd // 32) * 32,),
       (k, v, *_pool_args(kv), tables, np.int32(tables.shape[1]), meta, np.int32(n),
        np.int32(layer), np.int32(kv.num_blocks), np.int32(kv.block_size),
        np.int32(kv.kv_heads), np.int32(hd)))


def _partitions(partition: int, kv, tables, max_position: int | None) -> int:
    """Partitions of the grid (nz): enough for ``max_position``, else for a whole table."""
    if partition <= 0 or partition % CHUNK:
        raise ValueError(f"the partition ({partition}) is not a positive multiple of {CHUNK}")
    top = tables.shape[1] * kv.block_size - 1 if max_position is None else max_position
    return max(1, top // partition + 1)


GRID_WARPS = 8192  # warps the attention grid aims at (a few waves of the H200's 132 SMs)


def grid_partitions(nz: int, rows: int, q_heads: int, target: int = GRID_WARPS) -> int:
    """The grid's z size for ``nz`` partitions of ``rows`` rows of ``q_heads`` heads: every
    partition gets a warp while that stays under ``target`` warps, else the warps loop over
    partitions (z, z + grid z, ...). A graph sizes nz for the context limit: at 128k tokens
    that is 2,049 partitions, most past every row's position. Speed only: each partition is
    computed alone and the bits never depend on the grid."""
    return max(1, min(nz, -(-target // max(1, rows * q_heads))))


def paged_attention(q, kv, layer: int, meta, tables, out, scale, *,
                    max_position: int | None = None, partition: int = PARTITION,
                    grid_warps: int = GRID_WARPS, min_blocks: int | None = None,
                    rows_per_warp: int = 1, block_warps: int = MAX_WARPS) -> None:
    """``out[row] = softmax(q[row] K^T * scale) V`` over keys 0..position of the row's slot,
    for the rows of ``meta`` (int32 [3, n] on the device); ``q``, ``out`` [R, Hq, hd]
    C-contiguous, the compute dtype; ``scale`` of that dtype. Other rows of ``out`` are left
    as they are. ``max_position`` (>= every row's position, host int) only sizes the grid
    and the workspace (the bits never depend on it); None bounds it by the tables' width.
    ``partition``: keys per warp (a multiple of :data:`CHUNK`; tests set it low);
    ``grid_warps``: :func:`grid_partitions`' target (tests set it low); ``min_blocks``: the
    attention kernel's compile bound (None: :data:`MIN_BLOCKS`); ``rows_per_warp``: rows a
    warp computes together, sharing each key's and value's loads (above 1, each group of that
    many consecutive rows of ``meta`` must be one slot's: a prefill chunk's rows);
    ``block_warps``: q heads of a block (at most :data:`MAX_WARPS`). None changes a bit."""
    n = meta.shape[1]
    if n == 0:
        return
    R, hq, hd = q.shape
    hkv = kv.kv_heads
    group = hq // hkv
    if hd > MAX_DIM:
        raise ValueError(f"paged attention holds head dims of up to {MAX_DIM}, not {hd}")
    if kv.k.size // max(hd, 1) >= 2 ** 31:
        raise ValueError(f"paged attention indexes up to 2^31 vectors of {hd}: the cache "
                         f"holds {kv.k.size // hd}")
    if hd != kv.head_dim or group * hkv != hq or out.shape != q.shape:
        raise ValueError(f"q {q.shape}, out {out.shape} do not fit the cache "
                         f"({hkv} kv heads of {kv.head_dim})")
    _check_dtype(kv, q.dtype)
    if not 1 <= block_warps <= MAX_WARPS or rows_per_warp < 1:
        raise ValueError(f"{rows_per_warp} rows a warp, {block_warps} warps a block")
    nz = _partitions(partition, kv, tables, max_position)
    xp = kv.xp
    pm = xp.empty((n, hkv, nz, group), q.dtype)  # per partition: max, sum, weighted values
    pl = xp.empty_like(pm)
    pacc = xp.empty((n, hkv, nz, group, hd), q.dtype)
    variant = _variant(q.dtype, kv.quant)
    dims = (np.int32(hkv), np.int32(hd), np.int32(group), np.int32(partition))
    warps, groups = min(group, block_warps), -(-n // rows_per_warp)
    _attn_function(variant, hd, rows_per_warp, min_blocks)(
        (groups, hkv * -(-group // warps), grid_partitions(nz, groups, hq, grid_warps)),
        (32 * warps,),
        (q, *_pool_args(kv), tables, np.int32(tables.shape[1]), meta, np.int32(n), pm, pl,
         pacc, np.int32(layer), np.int32(kv.num_blocks), np.int32(kv.block_size), *dims,
         np.int32(nz), q.dtype.type(scale)))
    _function(f"paged_merge_{variant}")(
        (n, hq), (-(-hd // 32) * 32,), (pm, pl, pacc, meta, np.int32(n), out, *dims,
                                         np.int32(nz)))
