"""Token selection, the NumPy reference: integer masses, exact filters, one keyed draw.

A sampled token depends only on the row's logits, the request's parameters and seed, and the
absolute position of the token being chosen (docs/sampling.md), so the same logits give the
same token whether the row was decoded alone, in a batch, as a verified draft
(docs/architecture.md §4), or on the GPU (gpu_worker/kernels/sampler.py computes the same
bits). Steps for temperature T > 0:

1. masses ``q_i = floor(exp((z_i - max z) / T) * 2**40)`` (gpu_worker/kernels/exact_math.py);
2. rank the tokens of positive mass by (q descending, id ascending); top-k keeps the first k;
   top-p keeps a token iff the mass ranked strictly before it (among the top-k) is
   < ``ceil(top_p * Q_k)``, computed exactly; min-p keeps ``q_i >= ceil(min_p * 2**40)``;
3. ``u = floor(draw64(seed, position) * Q / 2**64)`` with Q the kept mass; the token is the
   first, in vocabulary order, whose inclusive prefix of kept masses exceeds u.

So token i is drawn with probability q_i / Q (within 2**-64). Greedy (T = 0) is
``np.argmax`` (lowest id among ties).
"""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels.exact_math import (
    ceil_times,
    draw64,
    masses,
    min_mass,
    uniform_below,
)
from protocol.messages import SamplingParams

__all__ = ["filtered_logprobs", "kept_masses", "ranked", "sample"]


def ranked(q: np.ndarray, candidates: np.ndarray, limit: int = 0) -> np.ndarray:
    """The ``candidates`` (token ids) ordered by (q descending, id ascending); only the first
    ``limit`` of them when 0 < limit < len (selected without sorting the rest)."""
    V = q.size
    key = q[candidates] * V + (V - 1 - candidates)  # unique, ordered as (q, -id); < 2**63
    if 0 < limit < candidates.size:
        part = np.argpartition(-key, limit - 1)[:limit]
        return candidates[part[np.argsort(-key[part])]]
    return candidates[np.argsort(-key)]


def kept_masses(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """int64 [V]: each token's mass if the filters keep it, else 0 (temperature > 0)."""
    q = masses(logits, params.temperature)
    if q.size >= 1 << 22:
        raise ValueError(f"vocabulary of {q.size} tokens: the key q * V must fit 63 bits")
    order = np.flatnonzero(q)
    if params.top_p < 1.0 or 0 < params.top_k < order.size:  # the order matters
        order = ranked(q, order, params.top_k)
    if params.top_p < 1.0 and order.size:
        mass = q[order]
        before = np.cumsum(mass) - mass  # mass ranked strictly before each token
        order = order[before < ceil_times(params.top_p, int(mass.sum()))]
    if params.min_p > 0.0:
        order = order[q[order] >= min_mass(params.min_p)]
    out = np.zeros_like(q)
    out[order] = q[order]
    return out


def filtered_logprobs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 [V]: log of the probability :func:`sample` gives each token (-inf: never)."""
    kept = kept_masses(logits, params)
    with np.errstate(divide="ignore"):
        return np.log(kept.astype(np.float64)) - np.log(float(kept.sum()))


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """Choose the token at absolute ``position`` from one row of logits [V]."""
    if params.is_greedy:
        return int(np.argmax(logits))
    if params.seed is None:
        raise ValueError("sampling needs a seed (the daemon fixes one for every request)")
    kept = kept_masses(logits, params)
    total = int(kept.sum())
    if total == 0:  # every logit is -inf or NaN: nothing to weigh
        return int(np.argmax(logits))
    u = uniform_below(draw64(params.seed, position), total)
    return int(np.searchsorted(np.cumsum(kept), u, side="right"))
