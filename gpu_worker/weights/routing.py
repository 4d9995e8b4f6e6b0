"""A routing model for synthetic weights: which experts each token picks.

Random router weights pick experts uniformly; trained models do not. Two knobs describe the
difference (docs/synthetic.md calibrates them from the embedded model):

* ``skew`` s: popularity. Per layer a fixed random permutation ranks the experts, and the
  ranks are dealt round-robin into k strata (rank r to stratum r % k), one per pick
  ("lane"). A fresh pick of lane j takes rank r of its stratum with probability
  proportional to (r + 1) ** -s (Zipf). 0 is uniform. Strata make a token's k experts
  distinct without redraws; an expert's share of picks is then (r + 1) ** -s over its
  stratum's total, close to k times its Zipf weight.
* ``locality`` q: each lane keeps the previous token's expert (same sequence) with
  probability q, else draws afresh (a fresh draw may still return the same expert by
  chance). 0: every token draws afresh. Consecutive tokens share, in expectation, a
  fraction q + (1 - q) c of their experts, c the chance a lane redraws its own expert.

Stateless and batch invariant: the ids of a row are a pure function of (seed, layer, key,
absolute position), computed on the host from counter-based hashes. A row's key is its
request's routing key (SlotWork.route_key: a hash of the request's ``user``), else its slot.
A lane's value at position p is its fresh draw at its last renewal position p' <= p (found by
walking back: renewal is a hashed coin per (layer, key, position, lane)), so a verify row at
p routes exactly like the plain decoding row at p, whatever else is in the batch, and a
request with a key routes the same in every slot.
NOTE: two experts of one stratum never serve the same token; with k strata of E / k
experts that changes neither the pick shares nor the overlap statistics above.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

# a lane is renewed at least every WINDOW positions (staggered per lane), which bounds the
# walk back; it lowers the carry-over probability by a factor (1 - 1/WINDOW) only
WINDOW = 512
MAX_LOCALITY = 0.99
_RENEW, _DRAW, _PERM = 1, 2, 4  # hash purposes
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


class RowRouting(Protocol):
    """The routed expert ids of one batch's rows (what sparse_moe asks for, per layer)."""

    def ids(self, layer: int) -> np.ndarray:
        """int64 [R, k]: the experts of every row of the batch at MoE layer ``layer``."""
        ...


@dataclasses.dataclass(frozen=True)
class RoutingParams:
    """The knobs: ``skew`` >= 0 (Zipf exponent), 0 <= ``locality`` <= MAX_LOCALITY."""

    skew: float = 0.0
    locality: float = 0.0

    def __post_init__(self) -> None:
        if not (np.isfinite(self.skew) and self.skew >= 0):
            raise ValueError(f"routing skew must be a finite number >= 0, got {self.skew}")
        if not 0 <= self.locality <= MAX_LOCALITY:
            raise ValueError(f"routing locality must be in [0, {MAX_LOCALITY}], "
                             f"got {self.locality}")


class RoutingModel:
    """Expert picks for ``num_experts`` experts, ``top_k`` per token (see the module doc)."""

    def __init__(self, num_experts: int, top_k: int, params: RoutingParams = RoutingParams(),
                 seed: int = 0) -> None:
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        self.num_experts, self.top_k, self.params, self.seed = num_experts, top_k, params, seed
        weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -params.skew  # by rank
        lane = np.arange(num_experts) % top_k  # the stratum of each rank
        totals = np.bincount(lane, weights, minlength=top_k)
        self.inclusion = weights / totals[lane]  # [E] by rank: P(a token picks rank r)
        self.popularity = self.inclusion / top_k  # [E] by rank: share of all picks
        width = -(-num_experts // top_k)
        cdf = np.ones((top_k, width))  # [k, E/k]: lane j's cumulative weights over its ranks
        for j in range(top_k):
            c = np.cumsum(weights[j::top_k]) / totals[j]
            cdf[j, : c.size] = c
            cdf[j, c.size - 1:] = 1.0
        self._cdf = cdf
        self._perms: dict[int, np.ndarray] = {}

    def ranking(self, layer: int) -> np.ndarray:
        """int64 [E]: the expert of each popularity rank at ``layer`` (rank 0 hottest)."""
        if layer not in self._perms:
            key = _hash(self.seed, _PERM, layer)[0]
            self._perms[layer] = np.random.default_rng(int(key)).permutation(self.num_experts)
        return self._perms[layer]

    def expected_counts(self, layer: int) -> np.ndarray:
        """float64 [E]: each expert's share of all picks at ``layer``, a stand-in for
        ``tandem expert-stats`` counts when placing the hottest experts."""
        out = np.empty(self.num_experts)
        out[self.ranking(layer)] = self.popularity
        return out

    def renumber(self, layer: int, order: np.ndarray) -> None:
        """Follow gpu_worker.expert_stats.permute_experts: new expert j is old ``order[j]``."""
        new_id = np.argsort(np.asarray(order))  # old id -> new id
        self._perms[layer] = new_id[self.ranking(layer)]

    def bind(self, keys: np.ndarray, positions: np.ndarray) -> BoundRouting:
        """The routing of rows (routing ``keys`` [R], ``positions`` [R]), computed per
        layer. A key is in 0..2**63-1: a slot, or a request's SlotWork.route_key."""
        return BoundRouting(self, np.asarray(keys, np.int64), np.asarray(positions, np.int64))

    def bind_batch(self, batch) -> BoundRouting:
        """:meth:`bind` for a gpu_worker.model.batch.RaggedBatch: each row keyed by its
        segment's ``route_key`` (the request's routing key, else the slot)."""
        keys = np.empty(batch.num_rows, np.int64)
        for seg in batch.segments:
            keys[seg.rows] = seg.route_key
        return self.bind(keys, batch.positions)

    def choose(self, layer: int, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """int64 [R, k]: distinct experts per row, a pure function of (seed, layer, key,
        position) of that row."""
        return self.choose_layers([layer], keys, positions)[0]

    def choose_layers(self, layers, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """int64 [L, R, k]: :meth:`choose` of every layer of ``layers`` in one vectorised
        pass (a pass's routing before it runs: one call instead of one per MoE layer)."""
        layers = np.asarray(layers, np.int64).reshape(-1)
        keys = np.asarray(keys, np.int64).reshape(-1)
        positions = np.asarray(positions, np.int64).reshape(-1)
        if (positions < 0).any():
            raise ValueError("positions must be >= 0")
        k, L, R = self.top_k, layers.size, keys.size
        lay, sl, pos, lanes = np.broadcast_arrays(
            layers[:, None, None], keys[None, :, None], positions[None, :, None],
            np.arange(k, dtype=np.int64)[None, None, :])  # each [L, R, k]
        start = self._renewals(lay, sl, pos, lanes)
        u = _uniform(_hash(self.seed, _DRAW, lay, sl, start, lanes))
        ranks = np.empty_like(start)
        for j in range(k):  # rank j + k * i of lane j's stratum
            ranks[..., j] = j + k * np.searchsorted(self._cdf[j], u[..., j], side="right")
        ranks = np.minimum(ranks, self.num_experts - 1).reshape(L, R * k)
        perms = np.stack([self.ranking(int(layer)) for layer in layers])  # [L, E]
        return np.take_along_axis(perms, ranks, axis=1).reshape(L, R, k)

    # ---- internals -------------------------------------------------------------------------
    def _renewals(self, layers: np.ndarray, keys: np.ndarray, positions: np.ndarray,
                  lanes: np.ndarray) -> np.ndarray:
        """Per entry (broadcast shapes): the last position <= p at which the lane drew
        afresh."""
        layers, keys, start, lanes = np.broadcast_arrays(layers, keys, positions, lanes)
        shape = start.shape
        layers, keys = layers.ravel(), keys.ravel()
        start, lanes = start.ravel().copy(), lanes.ravel()
        q = self.params.locality
        todo = np.arange(start.size)
        while todo.size:
            p, lane = start[todo], lanes[todo]
            renew = (p == 0) | ((p + lane * WINDOW // self.top_k) % WINDOW == 0)
            if q > 0:
                coin = _uniform(_hash(self.seed, _RENEW, layers[todo], keys[todo], p, lane))
                renew |= coin >= q
            else:
                renew[:] = True
            start[todo[~renew]] -= 1
            todo = todo[~renew]
        return start.reshape(shape)


@dataclasses.dataclass
class BoundRouting:
    """A RoutingModel bound to one batch's rows (a :class:`RowRouting`)."""

    model: RoutingModel
    keys: np.ndarray  # [R]
    positions: np.ndarray  # [R]

    def ids(self, layer: int) -> np.ndarray:
        return self.model.choose(layer, self.keys, self.positions)


def _splitmix(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _hash(*parts) -> np.ndarray:
    """uint64 hash of the broadcast integer arrays ``parts`` (splitmix64 chained)."""
    arrays = np.broadcast_arrays(*[np.atleast_1d(np.asarray(p, np.int64)) for p in parts])
    with np.errstate(over="ignore"):
        h = np.zeros(arrays[0].shape, np.uint64)
        for a in arrays:
            h = _splitmix(h ^ (a.astype(np.uint64) & _M64))
    return h


def _uniform(h: np.ndarray) -> np.ndarray:
    """float64 in [0, 1) from the top 53 bits of ``h``."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
