"""Fitting the routing model's knobs to a trained model's measured routing.

* Skew: the measured per-layer pick counts, sorted hottest first and normalised, averaged
  over layers, against the routing model's pick shares for a skew s (exact, from its
  strata: RoutingModel.popularity), sorted the same way. The fit minimises the L1 distance
  between the two curves over s.
* Locality: the measured mean fraction O of a token's k experts that the previous token
  also picked, minus the part chance explains: a fresh pick returns the previous token's
  expert of its lane with probability c (exact, from the strata), so the carry-over
  probability is q = (O - c) / (1 - c).

Scaling to a target's expert count E and k: the skew is kept (for s < 1 a Zipf law's share
of picks held by the hottest fraction x of experts tends to x ** (1 - s) whatever E, so the
placement's view of "the hottest quarter" is preserved) and q is kept (a per-pick
probability); the chance part c is recomputed for the target's E and k.
"""

from __future__ import annotations

import numpy as np

from gpu_worker.weights.routing import MAX_LOCALITY, RoutingModel, RoutingParams


def sorted_shares(counts: dict[int, np.ndarray] | list[np.ndarray]) -> np.ndarray:
    """float64 [E]: pick shares hottest first, averaged over layers (sums to 1)."""
    rows = list(counts.values()) if isinstance(counts, dict) else list(counts)
    curves = [np.sort(np.asarray(c, np.float64))[::-1] / max(1, np.sum(c)) for c in rows]
    return np.mean(curves, axis=0)


def model_shares(skew: float, num_experts: int, top_k: int) -> np.ndarray:
    """The routing model's pick shares at ``skew``, hottest first."""
    return np.sort(RoutingModel(num_experts, top_k, RoutingParams(skew)).popularity)[::-1]


def chance_overlap(skew: float, num_experts: int, top_k: int) -> float:
    """Mean fraction of a token's k experts that an independent fresh token also picks
    (per lane: the sum of its squared pick probabilities)."""
    inclusion = RoutingModel(num_experts, top_k, RoutingParams(skew)).inclusion
    return float(np.sum(inclusion ** 2) / top_k)


def fit_skew(counts: dict[int, np.ndarray] | list[np.ndarray], top_k: int,
             grid: np.ndarray | None = None) -> float:
    """The skew whose expected sorted shares are closest (L1) to the measured ones."""
    target = sorted_shares(counts)
    grid = np.arange(0.0, 3.0001, 0.02) if grid is None else grid
    errors = [np.abs(model_shares(float(s), target.size, top_k) - target).sum() for s in grid]
    return float(grid[int(np.argmin(errors))])


def fit_locality(overlap: float, skew: float, num_experts: int, top_k: int) -> float:
    """Carry-over probability q from a measured consecutive-token overlap fraction."""
    c = chance_overlap(skew, num_experts, top_k)
    return float(np.clip((overlap - c) / (1.0 - c), 0.0, MAX_LOCALITY))


def expected_overlap(locality: float, skew: float, num_experts: int, top_k: int) -> float:
    """What the routing model's consecutive tokens share, in expectation."""
    c = chance_overlap(skew, num_experts, top_k)
    return locality + (1.0 - locality) * c


def hot_share(skew: float, num_experts: int, top_k: int, fraction: float = 0.25) -> float:
    """Share of picks that go to the hottest ``fraction`` of experts at ``skew``."""
    shares = model_shares(skew, num_experts, top_k)
    return float(shares[: max(1, round(fraction * num_experts))].sum())
