"""Gated DeltaNet (linear attention) layer of Qwen3-Next.

Per token and value head, with state S [Dk, Dv]:
    S <- exp(g) S;  m = k^T S;  S <- S + k (beta (v - m))^T;  o = q^T S
The conv window and S live in ``RecurrentStates`` per slot; a segment continues its slot's
state and leaves the updated state behind. For a slot tracked by ``states.verifying`` (a decode
token plus drafts) the state after every row is kept too (states.track_conv / track_rec), so
the runner can adopt the one of the last accepted row.

On CuPy (float32 / float64, Dk <= 256) the conv (with the gates) and the recurrence of every
segment, decode, verify and prefill alike, are two kernel launches (gpu_worker/kernels/
gdn_recurrent.py: the conv kernel also computes beta and decay from ``ba``); on NumPy (and for
shapes those kernels do not take) a token loop per segment. On CuPy float32 with every kernel
on, a layer is five launches: the stacked input product, the conv, the recurrence, the gated
RMSNorm ``silu(z) * rms_norm(o)`` (Ops.gated_rms_norm) and out_proj.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels import gdn_recurrent
from gpu_worker.kernels.enabled import enabled
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.ops import Array, Ops
from gpu_worker.model_config import ModelConfig
from gpu_worker.states import RecurrentStates

# On CuPy in_proj_qkvz's rows are regrouped at load (model.stack_inputs, :func:`qkvz_rows`)
# into in_proj_mixed (the conv's input: every q head, every k head, every v head) and
# in_proj_z, so that the product gives them contiguous: no slicing copies, no concatenation.
# With in_proj_ba the three are one matrix, one launch.
GDN_IN_STACK = "in_stack"
GDN_IN_PARTS = ("in_proj_mixed.weight", "in_proj_z.weight", "in_proj_ba.weight")


def qkvz_rows(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Rows of in_proj_qkvz ``[Hk * (2 Dk + 2 r Dv), H]`` (per key head: q, k, v, z) that
    make in_proj_mixed (all q, all k, all v: the order of ``mixed`` below) and in_proj_z."""
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk
    W = 2 * Dk + 2 * r * Dv
    heads = np.arange(Hk)[:, None] * W

    def rows(lo: int, n: int) -> np.ndarray:
        return (heads + lo + np.arange(n)[None, :]).ravel()

    mixed = np.concatenate([rows(0, Dk), rows(Dk, Dk), rows(2 * Dk, r * Dv)])
    return mixed, rows(2 * Dk + r * Dv, r * Dv)


def gated_deltanet(ops: Ops, cfg: ModelConfig, p: dict[str, Array], x: Array,
                   batch: RaggedBatch, states: RecurrentStates, layer: int) -> Array:
    """x [R, H] (normed) -> [R, H]; ``layer`` indexes the linear-attention layers."""
    xp = ops.xp
    R = x.shape[0]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk
    # ba [R, Hk * 2r]: per key head r b, then r a
    if GDN_IN_PARTS[0] in p:  # regrouped rows (CuPy): mixed and z come out contiguous
        mixed, z, ba = ops.linear_parts(x, p, GDN_IN_PARTS, GDN_IN_STACK)
        z = z.reshape(R, Hv, Dv)
    else:
        qkvz = ops.linear(x, p["in_proj_qkvz.weight"]).reshape(R, Hk, 2 * Dk + 2 * r * Dv)
        ba = ops.linear(x, p["in_proj_ba.weight"])
        q, k = qkvz[..., :Dk], qkvz[..., Dk:2 * Dk]  # [R, Hk, Dk]
        v = qkvz[..., 2 * Dk:2 * Dk + r * Dv].reshape(R, Hv, Dv)
        z = qkvz[..., 2 * Dk + r * Dv:].reshape(R, Hv, Dv)
        mixed = xp.concatenate([q.reshape(R, -1), k.reshape(R, -1), v.reshape(R, -1)],
                               axis=1)  # [R, C]

    conv_w = p["conv1d.weight"][:, 0, :]  # [C, K]
    table = states.segment_table(batch.segments)  # also allocates the per-row buffers
    # NOTE: the path depends on the backend and the shapes only, never on the batch
    if (xp is not np and enabled("gdn") and states.conv.dtype == ops.dtype
            and gdn_recurrent.supports(ops.dtype, Dk, conv_w.shape[1])):
        tracked = states.track_conv is not None
        # the conv, and beta = sigmoid(b), decay = exp(g) (the kernels' exp and log1p)
        conv, beta, decay = gdn_recurrent.conv_silu(
            mixed, conv_w, states.conv[layer], table,
            states.track_conv[layer] if tracked else None,
            gates=(ba, p["A_log"], p["dt_bias"], Hk))
        out = gdn_recurrent.recurrence(conv, decay, beta, states.rec[layer], table,
                                       key_heads=Hk, scale=float(ops.dtype.type(Dk ** -0.5)),
                                       track=states.track_rec[layer] if tracked else None)
    else:
        ba = ba.reshape(R, Hk, 2 * r)
        b, a = ba[..., :r].reshape(R, Hv), ba[..., r:].reshape(R, Hv)
        beta = ops.sigmoid(b)  # [R, Hv]
        g = -xp.exp(p["A_log"]) * ops.softplus(a + p["dt_bias"])  # [R, Hv]
        out = _token_loop(ops, cfg, mixed, conv_w, beta, g, batch, states, layer)

    # out [R, Hv, Dv]: each value head's Dv outputs normed, times silu(z). With fused_sigmoid
    # silu(z) * o through silu_mul (the product commutes: the same bits as o * silu(z)), the
    # norm and it one launch where both take their kernels (Ops.gated_rms_norm)
    if enabled("fused_sigmoid"):
        o = ops.gated_rms_norm(out, z, p["norm.weight"], cfg.rms_norm_eps, zero_centered=False)
    else:
        o = ops.rms_norm(out, p["norm.weight"], cfg.rms_norm_eps, zero_centered=False)
        o = o * ops.silu(z)
    return ops.linear(o.reshape(R, Hv * Dv), p["out_proj.weight"])


def _token_loop(ops: Ops, cfg: ModelConfig, mixed: Array, conv_w: Array, beta: Array, g: Array,
                batch: RaggedBatch, states: RecurrentStates, layer: int) -> Array:
    """The conv and the recurrence segment by segment, row by row -> out [R, Hv, Dv]."""
    xp = ops.xp
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, Hv // Hk
    K = conv_w.shape[1]
    out = xp.empty((mixed.shape[0], Hv, Dv), dtype=ops.dtype)
    for seg in batch.segments:
        rows = seg.rows
        keep = states.has_state(seg.slot)  # else a zero state, not kept (a scratch slot)
        old = (states.conv[layer, seg.slot] if keep else
               xp.zeros(states.conv.shape[2:], states.conv.dtype))
        window = xp.concatenate([old, mixed[rows]], axis=0)  # [K-1+n, C]
        conv = sum(window[j:j + seg.num] * conv_w[:, j] for j in range(K))  # [n, C]
        if keep:
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
        S = (states.rec[layer, seg.slot] if keep else
             xp.zeros(states.rec.shape[2:], states.rec.dtype))  # [Hv, Dk, Dv]
        first = states.track_row(seg.slot)  # T-row of the state after each row (drafts)
        for t in range(seg.num):
            S = S * decay[t][:, None, None]
            m = (kc[t][:, None, :] @ S)[:, 0]  # [Hv, Dv]
            delta = bt[t][:, None] * (vc[t] - m)
            S = S + kc[t][:, :, None] * delta[:, None, :]
            out[seg.row0 + t] = (qc[t][:, None, :] @ S)[:, 0]
            if first is not None:
                states.track_conv[layer, first + t] = window[t + 1:t + K]
                states.track_rec[layer, first + t] = S
        if keep:
            states.rec[layer, seg.slot] = S
    return out


def _l2norm(xp, x: Array) -> Array:
    # NOTE: eps 1e-6 sits inside the square root and is fixed (not rms_norm_eps).
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + x.dtype.type(1e-6))
