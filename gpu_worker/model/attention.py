"""Full (softmax) attention over a ragged batch with a paged KV cache.

Qwen3-MoE: per-head q/k RMSNorm before rotate-half RoPE, GQA, scale hd^-0.5.
Qwen3-Next adds an output gate (q_proj emits [query | gate] per head), zero-centred q/k
norms and partial RoPE.
"""

from __future__ import annotations

from gpu_worker.kv_cache import KVCache
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.ops import Array, Ops
from gpu_worker.model_config import ModelConfig


def full_attention(ops: Ops, cfg: ModelConfig, p: dict[str, Array], x: Array,
                   batch: RaggedBatch, cos: Array, sin: Array,
                   kv: KVCache, layer: int) -> Array:
    """x [R, H] (normed) -> attention output [R, H]; writes this batch's K/V into ``kv``."""
    xp = ops.xp
    R, hd = x.shape[0], cfg.head_dim
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    q = ops.linear(x, p["q_proj.weight"], p.get("q_proj.bias"))
    gate = None
    if cfg.gated_attention:
        q = q.reshape(R, Hq, 2 * hd)  # [R, Hq, query | gate]
        q, gate = q[..., :hd], q[..., hd:].reshape(R, Hq * hd)
    q = q.reshape(R, Hq, hd)
    k = ops.linear(x, p["k_proj.weight"], p.get("k_proj.bias")).reshape(R, Hkv, hd)
    v = ops.linear(x, p["v_proj.weight"], p.get("v_proj.bias")).reshape(R, Hkv, hd)
    zc = cfg.zero_centered_norms
    q = ops.rms_norm(q, p["q_norm.weight"], cfg.rms_norm_eps, zero_centered=zc)
    k = ops.rms_norm(k, p["k_norm.weight"], cfg.rms_norm_eps, zero_centered=zc)
    q = ops.apply_rope(q, cos, sin)
    k = ops.apply_rope(k, cos, sin)

    out = xp.empty((R, Hq, hd), dtype=ops.dtype)
    group = Hq // Hkv
    scale = ops.dtype.type(hd ** -0.5)
    for seg in batch.segments:
        rows = seg.rows
        kv.write(layer, seg.slot, seg.start, k[rows], v[rows])
        keys, values = kv.read(layer, seg.slot, seg.end)  # [L, Hkv, hd]
        qh = q[rows].reshape(seg.num, Hkv, group, hd).transpose(1, 2, 0, 3)  # [Hkv, g, n, hd]
        scores = (qh @ keys.transpose(1, 2, 0)[:, None]) * scale  # [Hkv, g, n, L]
        key_pos = xp.arange(seg.end)
        query_pos = xp.arange(seg.start, seg.end)
        masked = key_pos[None, :] > query_pos[:, None]  # [n, L]
        scores = xp.where(masked, -xp.inf, scores)
        probs = ops.softmax(scores, axis=-1)
        o = probs @ values.transpose(1, 0, 2)[:, None]  # [Hkv, g, n, hd]
        out[rows] = o.transpose(2, 0, 1, 3).reshape(seg.num, Hq, hd)
    out = out.reshape(R, Hq * hd)
    if gate is not None:
        out = out * ops.sigmoid(gate)
    return ops.linear(out, p["o_proj.weight"], p.get("o_proj.bias"))
