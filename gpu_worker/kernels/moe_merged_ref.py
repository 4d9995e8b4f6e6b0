"""NumPy reference of the merged expert kernels (gpu_worker/kernels/moe_merged.py): the same
float operations in the same order, so float32 and bf16 give the GPU's bits exactly.

Every dot product ``w . x`` of length ``n`` is summed as the kernels sum it: lane ``l`` of a
warp (``l`` in 0..31) adds, in this order, the products at ``c = (j * 32 + l) * 8 + v`` for
``j = 0, 1, ...`` and ``v = 0..7`` (``c < n``; an out-of-range element is skipped, not added
as zero), starting from +0; then the 32 lane sums fold as a shuffle tree: ``s[l] += s[l + o]``
for ``o = 16, 8, 4, 2, 1``; lane 0 holds the result. The order depends on ``n`` only, never
on how many rows an expert has, so a row's bits do not depend on its batch.

``silu(g) * u`` uses an exp made of ``+ - * floor`` and a power of two (:func:`exp_neg`), not
the libraries' exp (CUDA's and NumPy's differ in the last bit): the float32 polynomial below
is accurate to about 1 ulp. Float64 takes the libraries' exp (checked with a tolerance).
The combine sums a row's pairs in slot order ``j = 0..k-1``: ``acc = acc + w[r, j] * y``.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels.int8_stack import Int8Stack

LANES, VEC = 32, 8  # a warp's lanes; consecutive elements per lane per step (one 16-byte load)
EXP_MIN = -87.0  # below: exp_neg gives 0 (exp(-87) = 1.6e-38, the float32 normals end at 1.2e-38)
# float32 constants of exp_neg, exact values shared with the kernel source (as bit patterns)
LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)  # 355/512: n * LN2_HI is exact for |n| < 2^15
LN2_LO = np.float32(0.6931471805599453 - 0.693359375)
# Taylor coefficients 1/7!, 1/6!, ..., 1/1!, 1/0! (Horner, highest first); |r| <= ln2/2
EXP_POLY = tuple(np.float32(1.0 / f) for f in (5040.0, 720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0))


def f32_bits(v: np.float32) -> int:
    """The bit pattern of a float32 constant (how the kernel source writes it)."""
    return int(np.array(v, np.float32).view(np.uint32))


def exp_neg(t: np.ndarray) -> np.ndarray:
    """exp(t) for float32 ``t <= 0`` as the kernels compute it: ``n = floor(t log2 e + 1/2)``,
    ``r = t - n ln2`` (two steps), a degree-7 polynomial, times ``2^n``; 0 below
    :data:`EXP_MIN`, NaN stays NaN."""
    t = np.asarray(t, np.float32)
    tc = np.maximum(t, np.float32(EXP_MIN))  # NaN propagates
    with np.errstate(invalid="ignore"):
        nf = np.floor(tc * LOG2E + np.float32(0.5))
        r = tc - nf * LN2_HI
        r = r - nf * LN2_LO
        p = np.full_like(r, EXP_POLY[0])
        for c in EXP_POLY[1:]:
            p = p * r + c
        scale = ((np.nan_to_num(nf).astype(np.int32) + 127) << 23).view(np.float32)
        out = p * scale
    return np.where(t < np.float32(EXP_MIN), np.float32(0), out)


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``silu(g) * u`` as the kernels: ``g * sigmoid(g) * u``, the sigmoid split by sign."""
    one = g.dtype.type(1)
    e = exp_neg(-np.abs(g)) if g.dtype == np.float32 else np.exp(-np.abs(g))
    with np.errstate(invalid="ignore"):
        s = np.where(g >= 0, one / (one + e), e / (one + e))
    return g * s * u


def lane_dot(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``x @ w.T`` summed in the kernels' order: ``w [O, n]``, ``x [m, n]`` -> ``[m, O]``
    (both of the compute dtype)."""
    m, n = x.shape
    acc = np.zeros((m, w.shape[0], LANES), x.dtype)  # [m, O, lanes]
    lanes = np.arange(LANES)
    for j in range(-(-n // (LANES * VEC))):
        for v in range(VEC):
            c = (j * LANES + lanes) * VEC + v
            ok = c < n
            if ok.all():  # a full sweep: strided views, the same products and sums
                sl = slice(c[0], c[-1] + 1, VEC)
                acc += x[:, None, sl] * w[None, :, sl]
            elif ok.any():
                cc = c[ok]
                acc[:, :, lanes[ok]] += x[:, None, cc] * w[None, :, cc]  # [m, O, lanes]
    for o in (16, 8, 4, 2, 1):
        acc[:, :, :o] = acc[:, :, :o] + acc[:, :, o:2 * o]
    return acc[:, :, 0]


def _real(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Weights as compute dtype: bf16 (raw uint16 bits or ml_dtypes) widened exactly."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(dtype)


def build_lists_reference(ids: np.ndarray, num_experts: int) -> dict[str, np.ndarray]:
    """What the build kernel writes, from ``ids [R, k]`` (-1 or >= E: not here): the active
    experts in ascending id with the start and count of their rows in the (expert, row) list
    (rows ascending, a row once per expert), the list's rows, and per pair its list position
    (-1: skipped)."""
    R, k = ids.shape
    valid = (ids >= 0) & (ids < num_experts)
    pairs = sorted({(int(e), r) for r in range(R) for j in range(k) if valid[r, j]
                    for e in [ids[r, j]]})
    where = {pr: q for q, pr in enumerate(pairs)}
    experts, counts = np.unique([e for e, _ in pairs], return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else counts
    pair_q = np.array([[where[(int(ids[r, j]), r)] if valid[r, j] else -1 for j in range(k)]
                       for r in range(R)], np.int32).reshape(R, k)
    return {"n_active": np.int32(len(experts)), "act_expert": experts.astype(np.int32),
            "act_start": np.asarray(starts, np.int32), "act_count": counts.astype(np.int32),
            "list_row": np.array([r for _, r in pairs], np.int32), "pair_q": pair_q}


def experts_merged_reference(x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                             gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """``experts_merged`` in NumPy: ``x [R, H]`` float32 or float64, ``ids [R, k]``,
    ``weights [R, k]``, ``gate/up [E, I, H]`` and ``down [E, H, I]`` of x's dtype or bf16
    (uint16 bits or ml_dtypes, with float32 x), or three int8 stacks (their exact float32
    values: gpu_worker/kernels/int8_stack.py). Returns ``[R, H]`` of x's dtype."""
    if isinstance(gate, Int8Stack):
        gate, up, down = (a.values() for a in (gate, up, down))
    dtype = x.dtype
    R, H = x.shape
    E, k = gate.shape[0], ids.shape[1]
    ids = np.where((ids >= 0) & (ids < E), ids, -1)
    y = np.zeros((R, k, H), dtype)  # [R, k, H]: expert ids[r, j] applied to row r
    for e in np.unique(ids[ids >= 0]):
        rows = np.nonzero((ids == e).any(axis=1))[0]
        xe = x[rows]  # [n, H]
        h = silu_mul(lane_dot(_real(gate[e], dtype), xe), lane_dot(_real(up[e], dtype), xe))
        ye = lane_dot(_real(down[e], dtype), h)  # [n, H]
        for n, r in enumerate(rows):
            y[r, ids[r] == e] = ye[n]
    out = np.zeros((R, H), dtype)
    w = weights.astype(dtype)
    for j in range(k):  # NOTE: slot order, whatever the ids
        ok = ids[:, j] >= 0
        out[ok] = out[ok] + w[ok, j, None] * y[ok, j]
    return out
