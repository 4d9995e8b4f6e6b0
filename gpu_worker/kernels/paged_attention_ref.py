"""NumPy twin of gpu_worker/kernels/paged_attention.py: the kernels' exp and their two-level
attention order (online softmax per partition of :data:`PARTITION` keys in chunks of
:data:`CHUNK`, each score a warp's sum of :data:`LANES` partials, then the merge of the
partitions in ascending order), step for step, so that
:func:`attention_reference` gives the kernels' bits."""

from __future__ import annotations

import functools
import math

import numpy as np

CHUNK = 16  # key positions per online-softmax step (fixes the arithmetic order: never change)
PARTITION = 64  # key positions per warp (a multiple of CHUNK; part of the arithmetic order)
LANES = 32  # a score's partial sums: lane L takes dims L, L + 32, ... (then a butterfly)


@functools.cache
def exp_constants(dtype: np.dtype) -> dict:
    """The exp's constants as ``dtype`` scalars: cut-off, log2(e), ln 2 split in a high part
    with trailing zeros (n * hi is exact) and a low part, Taylor coefficients 1/k!."""
    t = np.dtype(dtype).type
    if np.dtype(dtype) == np.float32:
        hi, cut, degree = np.uint32(0x3F317200).view(np.float32), -80.0, 7
        lo = t(math.log(2) - float(hi))  # double's ln 2 is precise enough for this tail
    else:  # fdlibm's split: hi has 32 significant bits, lo the next 53
        hi, cut, degree = np.uint64(0x3FE62E42FEE00000).view(np.float64), -700.0, 13
        lo = np.uint64(0x3DEA39EF35793C76).view(np.float64)
    return {"cut": t(cut), "log2e": t(1 / math.log(2)), "ln2_hi": t(hi), "ln2_lo": t(lo),
            "coef": [t(1 / math.factorial(k)) for k in range(degree + 1)]}


def exp_reference(x: np.ndarray) -> np.ndarray:
    """e^x for x <= 0 as the kernels compute it (0 below the cut-off, for -inf and NaN)."""
    c = exp_constants(x.dtype)
    with np.errstate(all="ignore"):
        keep = x >= c["cut"]
        xs = np.where(keep, x, x.dtype.type(0))
        n = np.rint(xs * c["log2e"])
        r = (xs - n * c["ln2_hi"]) - n * c["ln2_lo"]
        p = np.full_like(r, c["coef"][-1])
        for coef in reversed(c["coef"][:-1]):
            p = p * r + coef
        return np.where(keep, p * np.ldexp(np.ones_like(p), n.astype(np.int32)),
                        x.dtype.type(0))


def _scores(qg, kc):
    """``q . k`` as a warp sums it: lane L adds ``q_d k_d`` for d = L, L + 32, ... from 0 (a
    lane past hd keeps 0), then the xor butterfly (16, 8, 4, 2, 1) -> [n, Hkv, g, c]."""
    hd, lanes = qg.shape[-1], LANES
    pad = -hd % lanes  # zeros add +0 to a partial, which is never -0: the same bits
    qp = np.concatenate([qg, np.zeros((*qg.shape[:-1], pad), qg.dtype)], -1)
    kp = np.concatenate([kc, np.zeros((*kc.shape[:-1], pad), kc.dtype)], -1)
    qp = qp.reshape(*qg.shape[:-1], 1, -1, lanes)  # [n, Hkv, g, 1, M, lanes]
    kp = kp.reshape(*kc.shape[:-1], -1, lanes)     # [n, Hkv, 1, c, M, lanes]
    part = np.zeros(np.broadcast_shapes(qp.shape[:-2], kp.shape[:-2]) + (lanes,), qg.dtype)
    for m in range(qp.shape[-2]):
        part = part + qp[..., m, :] * kp[..., m, :]
    lane = np.arange(lanes)
    for o in (16, 8, 4, 2, 1):
        part = part + part[..., lane ^ o]
    return part[..., 0]


def _partition_state(qg, keys, values, positions, first: int, stop: int, scale):
    """The online softmax over keys [first, stop) & [0, pos] of each row, chunk by chunk as a
    block computes it -> m, l [n, Hkv, g], acc [n, Hkv, g, hd] (rows with pos < first: -inf,
    0, 0)."""
    t = qg.dtype.type
    m = np.full(qg.shape[:3], -np.inf, qg.dtype)
    l = np.zeros(qg.shape[:3], qg.dtype)
    acc = np.zeros(qg.shape, qg.dtype)
    for c0 in range(first, min(stop, int(positions.max()) + 1), CHUNK):
        kc = keys[:, c0:c0 + CHUNK].transpose(0, 2, 1, 3)[:, :, None]  # [n, Hkv, 1, c, hd]
        vc = values[:, c0:c0 + CHUNK].transpose(0, 2, 1, 3)[:, :, None]
        c = kc.shape[3]
        valid = (c0 + np.arange(c))[None, :] <= positions[:, None]  # [n, c]
        active = valid[:, 0][:, None, None]  # rows whose keys reach this chunk
        s = _scores(qg, kc) * t(scale)
        vmask = valid[:, None, None, :]
        mn = np.maximum(m, np.where(vmask, s, t(-np.inf)).max(axis=-1))
        with np.errstate(invalid="ignore"):
            alpha = exp_reference(m - mn)
        p = exp_reference(s - mn[..., None])
        l = np.where(active, l * alpha, l)
        acc = np.where(active[..., None], acc * alpha[..., None], acc)
        for j in range(c):
            ok = vmask[..., j]
            l = np.where(ok, l + p[..., j], l)
            acc = np.where(ok[..., None], acc + p[..., j, None] * vc[..., j, :], acc)
        m = np.where(active, mn, m)
    return m, l, acc


def attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                        positions: np.ndarray, scale, partition: int = PARTITION) -> np.ndarray:
    """The kernels' arithmetic in NumPy, step for step (the same bits): ``q [n, Hq, hd]``,
    ``keys``/``values [n, L, Hkv, hd]`` (row i uses keys 0..positions[i]; L > max position),
    ``scale`` a scalar of q's dtype -> ``[n, Hq, hd]``: each partition's online softmax,
    then the merge in ascending partition order. Slow (a NumPy op per dim and key)."""
    n, hq, hd = q.shape
    hkv = keys.shape[2]
    qg = q.reshape(n, hkv, hq // hkv, hd)  # [n, Hkv, g, hd]
    positions = np.asarray(positions)
    parts = positions // partition + 1  # [n]
    states = [_partition_state(qg, keys, values, positions, z * partition,
                               (z + 1) * partition, scale) for z in range(int(parts.max()))]
    mx = states[0][0]
    for z, (m, _, _) in enumerate(states[1:], 1):
        mx = np.where((z < parts)[:, None, None], np.maximum(mx, m), mx)
    r = exp_reference(states[0][0] - mx)
    sl, sa = states[0][1] * r, states[0][2] * r[..., None]
    for z, (m, l, acc) in enumerate(states[1:], 1):
        ok = (z < parts)[:, None, None]
        with np.errstate(invalid="ignore"):
            r = exp_reference(m - mx)
        sl = np.where(ok, sl + l * r, sl)
        sa = np.where(ok[..., None], sa + acc * r[..., None], sa)
    return (sa / sl[..., None]).reshape(n, hq, hd)
