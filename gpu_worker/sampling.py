"""Token selection: filtered log-probabilities plus Gumbel noise keyed by (seed, position).

y = argmax(log p + G(seed, position)), with G a Gumbel draw that depends only on the
request seed and the absolute position of the token being chosen. The same logits thus give
the same token whether the row was decoded alone, in a batch, or as a verified draft
(docs/architecture.md §4). Greedy (temperature 0) uses no noise and the same argmax tie-break
(lowest token id). Runs on the host in float64 so every backend samples identically.
"""

from __future__ import annotations

import numpy as np

from protocol.messages import SamplingParams


def gumbel_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """Gumbel(0, 1) draws [vocab] from a counter-based generator keyed by (seed, position)."""
    rng = np.random.Generator(np.random.Philox(key=np.array([seed, position], dtype=np.uint64)))
    u = rng.random(vocab)
    # NOTE: random() is in [0, 1); 0 would give -inf, so map it to the smallest positive.
    u = np.maximum(u, np.finfo(np.float64).tiny)
    return -np.log(-np.log(u))


def filtered_logprobs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """log-softmax of logits / T after top-k, top-p and min-p filtering (float64, [V])."""
    z = np.asarray(logits, dtype=np.float64) / params.temperature
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z < kth, -np.inf, z)
    logp = z - _logsumexp(z)
    if params.top_p < 1.0:
        order = np.argsort(-logp, kind="stable")
        probs = np.exp(logp[order])
        before = np.cumsum(probs) - probs  # mass strictly above each token
        drop = order[before >= params.top_p]
        logp[drop] = -np.inf
    if params.min_p > 0.0:
        logp = np.where(logp < np.max(logp) + np.log(params.min_p), -np.inf, logp)
    return logp - _logsumexp(logp)


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """Choose the token at absolute ``position`` from one row of logits [V]."""
    if params.is_greedy:
        return int(np.argmax(logits))
    if params.seed is None:
        raise ValueError("sampling needs a seed (the daemon fixes one for every request)")
    logp = filtered_logprobs(logits, params)
    return int(np.argmax(logp + gumbel_noise(params.seed, position, logp.size)))


def _logsumexp(z: np.ndarray) -> float:
    m = np.max(z)
    return float(m + np.log(np.sum(np.exp(z - m))))
