"""Gated DeltaNet (linear attention) layer of Qwen3-Next, token-loop form.

Per token and value head, with state S [Dk, Dv]:
    S <- exp(g) S;  m = k^T S;  S <- S + k (beta (v - m))^T;  o = q^T S
The conv window and S live in ``RecurrentStates`` per slot; a segment continues its slot's
state and leaves the updated state behind. For a slot tracked by ``states.verifying`` (a decode
token plus drafts) the state after every row is kept too, so the runner can adopt the one of
the last accepted row.
"""

from __future__ import annotations

from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.ops import Array, Ops
from gpu_worker.model_config import ModelConfig
from gpu_worker.states import RecurrentStates


def gated_deltanet(ops: Ops, cfg: ModelConfig, p: dict[str, Array], x: Array,
                   batch: RaggedBatch, states: RecurrentStates, layer: int) -> Array:
    """x [R, H] (normed) -> [R, H]; ``layer`` indexes the linear-attention layers."""
    xp = ops.xp
    R = x.shape[0]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk
    qkvz = ops.linear(x, p["in_proj_qkvz.weight"]).reshape(R, Hk, 2 * Dk + 2 * r * Dv)
    ba = ops.linear(x, p["in_proj_ba.weight"]).reshape(R, Hk, 2 * r)
    q, k = qkvz[..., :Dk], qkvz[..., Dk:2 * Dk]  # [R, Hk, Dk]
    v = qkvz[..., 2 * Dk:2 * Dk + r * Dv].reshape(R, Hv, Dv)
    z = qkvz[..., 2 * Dk + r * Dv:].reshape(R, Hv, Dv)
    b, a = ba[..., :r].reshape(R, Hv), ba[..., r:].reshape(R, Hv)
    mixed = xp.concatenate([q.reshape(R, -1), k.reshape(R, -1), v.reshape(R, -1)], axis=1)  # [R, C]

    beta = ops.sigmoid(b)  # [R, Hv]
    g = -xp.exp(p["A_log"]) * ops.softplus(a + p["dt_bias"])  # [R, Hv]
    conv_w = p["conv1d.weight"][:, 0, :]  # [C, K]
    K = conv_w.shape[1]
    out = xp.empty((R, Hv, Dv), dtype=ops.dtype)
    for seg in batch.segments:
        rows = seg.rows
        window = xp.concatenate([states.conv[layer, seg.slot], mixed[rows]], axis=0)  # [K-1+n, C]
        conv = sum(window[j:j + seg.num] * conv_w[:, j] for j in range(K))  # [n, C]
        states.conv[layer, seg.slot] = window[seg.num:]
        conv = ops.silu(conv)
        qc = conv[:, :Hk * Dk].reshape(seg.num, Hk, Dk)
        kc = conv[:, Hk * Dk:2 * Hk * Dk].reshape(seg.num, Hk, Dk)
        vc = conv[:, 2 * Hk * Dk:].reshape(seg.num, Hv, Dv)
        qc = _l2norm(xp, qc) * ops.dtype.type(Dk ** -0.5)
        kc = _l2norm(xp, kc)
        if r > 1:
            qc, kc = xp.repeat(qc, r, axis=1), xp.repeat(kc, r, axis=1)  # [n, Hv, Dk]
        decay = xp.exp(g[rows])  # [n, Hv]
        bt = beta[rows]
        S = states.rec[layer, seg.slot]  # [Hv, Dk, Dv]
        keep = [] if states.is_tracked(seg.slot) else None  # S after each row (drafts)
        for t in range(seg.num):
            S = S * decay[t][:, None, None]
            m = (kc[t][:, None, :] @ S)[:, 0]  # [Hv, Dv]
            delta = bt[t][:, None] * (vc[t] - m)
            S = S + kc[t][:, :, None] * delta[:, None, :]
            out[seg.row0 + t] = (qc[t][:, None, :] @ S)[:, 0]
            if keep is not None:
                keep.append(S)
        states.rec[layer, seg.slot] = S
        if keep is not None:
            states.record(layer, seg.slot, window, keep)

    o = ops.rms_norm(out, p["norm.weight"], cfg.rms_norm_eps, zero_centered=False)
    o = o * ops.silu(z)
    return ops.linear(o.reshape(R, Hv * Dv), p["out_proj.weight"])


def _l2norm(xp, x: Array) -> Array:
    # NOTE: eps 1e-6 sits inside the square root and is fixed (not rms_norm_eps).
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + x.dtype.type(1e-6))
