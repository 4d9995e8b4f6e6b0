"""The expert-union-aware draft budget (docs/speculation.md, "The draft budget"): how many of
its fitted drafts each slot verifies this step, chosen to maximise the expected tokens of the
step per millisecond of its predicted time. Pure functions over plain arrays; the online
estimates they are fed with live in daemon/draft_stats.py.

Cost of one forward pass (ms), with the pass's rows R and its distinct CPU experts U (summed
over MoE layers, as the worker's ``counters["cpu_experts"]``):

    T = fixed + row * R + expert * U

``expert`` is one CPU expert's weight bytes over the CPU's memory bandwidth: a step reads each
distinct expert once, however many rows picked it, so a draft row costs experts only where it
routes to ones no other row of the pass picked.

Value: a slot's draft j is accepted, given the drafts before it were, with probability c_j
(its position's; one probability a for every position: a chain, c_j = a), so k drafts are
worth 1 + c_1 + c_1 c_2 + ... + c_1 ... c_k tokens (the step's own token plus the expected
accepted drafts); a prompt chunk is worth 0 (it costs what it costs either way).

Routing: a new row of slot s picks CPU expert e (a (layer, expert) pair) with probability
pi[e, s]. A slot's rows of one step are consecutive tokens, which keep some of the experts of
the token before them (the router's *locality* l): its n rows touch the experts of about
1 + (n - 1)(1 - l) independent rows, so a pass whose slots run n_s rows touches
E[U] = sum_e 1 - prod_s (1 - pi[e, s]) ** (1 + (n_s - 1)(1 - l)). Experts with equal
probabilities in every slot share a *pattern* (one row of ``log_miss``, counted ``weight``
times): the experts no slot picked last step fall into a few patterns by how often the router
picks them, so the sum runs over a few hundred patterns, not the model's tens of thousands of
experts.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np

from protocol.worker_config import padded_rows

MAX_CANDIDATES = 4096  # exhaustive search up to this many length combinations
MAX_ROUNDS = 8  # coordinate ascent beyond that: rounds over the slots
# a choice of more drafts must be predicted this much better (relative) than one of fewer: a
# tie-break (where two choices are this close the model cannot tell them apart). It was 0.5 %,
# standing in for costs that grow with the drafts while a row's cost came out 0 from the
# steps' noise; a row's cost now has a prior (daemon/draft_cost.py), and at 0.5 % the margin
# cut drafts that paid on an H100 machine (docs/benchmarks.md, session 28)
MARGIN = 0.001


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The pass cost model's constants, in ms (fitted online: daemon/draft_stats.CostFit)."""

    fixed_ms: float  # per forward pass: launches, attention, the GPU's experts, the link
    row_ms: float  # per row of the pass
    expert_ms: float  # per distinct CPU expert: its bytes / the CPU's DRAM bandwidth

    def pass_ms(self, rows: float, experts: float) -> float:
        return self.fixed_ms + self.row_ms * rows + self.expert_ms * experts


@dataclasses.dataclass(frozen=True)
class BudgetProblem:
    """One step's slots (S of them, plan order) as the chooser sees them."""

    base_rows: np.ndarray  # [S] int: rows a slot runs whatever its drafts (1; a chunk's size)
    max_drafts: np.ndarray  # [S] int: its fitted drafts (0: none)
    accept: np.ndarray  # [S] float: per-draft acceptance probability a (a chain), or
    # [S, >= max drafts]: each draft position's, given the drafts before it accepted
    base_value: np.ndarray  # [S] float: tokens it emits without drafts (1 decode, 0 prefill)
    log_miss: np.ndarray  # [P, S] float: log(1 - pi) of a row of slot s, per pattern
    weight: np.ndarray  # [P] float: CPU experts sharing each pattern
    wide: bool = True  # one pass; False (narrow): one per drafted slot, one for the rest
    # the worker pads each pass up to the next of these rows (ModelInfo.padded_passes: its
    # CUDA graphs' capacity buckets): a pass costs the rows it runs, not its own; () none
    pad_to: tuple[int, ...] = ()
    locality: float = 0.0  # a slot's row keeps this share of its previous row's experts

    def __post_init__(self) -> None:
        S = len(self.base_rows)
        assert self.max_drafts.shape == self.base_value.shape == (S,)
        assert self.accept.shape[0] == S and (self.accept.ndim == 1 or (
            self.accept.ndim == 2 and self.accept.shape[1] >= self.max_drafts.max(initial=0)))
        assert self.log_miss.shape == (len(self.weight), S)


def gains(accept: np.ndarray, max_drafts: int) -> np.ndarray:
    """[S, max_drafts + 1]: expected accepted drafts of k drafts: sum_{j<=k} a^j of a chain
    (``accept`` [S]), sum_{j<=k} c_1 ... c_j of per-position ones (``accept`` [S, K])."""
    if accept.ndim == 2:
        powers = np.cumprod(accept[:, :max_drafts], axis=1)  # [S, K]
    else:
        powers = accept[:, None] ** np.arange(1, max_drafts + 1)[None, :]  # [S, K]
    return np.concatenate([np.zeros((len(accept), 1)), np.cumsum(powers, axis=1)], axis=1)


def expected_union(rows: np.ndarray, log_miss: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """E[distinct CPU experts] of passes whose slots run ``rows`` [C, S] rows: [C]."""
    if not len(weight):
        return np.zeros(len(rows))
    return (1.0 - np.exp(rows @ log_miss.T)) @ weight  # [C, P] -> [C]


def fresh_rows(rows: np.ndarray, locality: float) -> np.ndarray:
    """The independent rows that touch as many experts as a slot's ``rows`` consecutive
    rows do: 1 + (n - 1)(1 - locality), 0 for none."""
    return np.where(rows > 0, 1.0 + (rows - 1) * (1.0 - locality), 0.0)


def ratio(problem: BudgetProblem, cost: StepCost, drafts: np.ndarray) -> np.ndarray:
    """Expected tokens per ms of the step for each candidate ``drafts`` [C, S]: [C]."""
    p = problem
    table = gains(p.accept, int(p.max_drafts.max(initial=0)))  # [S, K+1]
    value = p.base_value.sum() + table[np.arange(len(p.accept))[None, :], drafts].sum(axis=1)
    rows = p.base_rows[None, :] + drafts  # [C, S]
    fresh = fresh_rows(rows, p.locality)
    if p.wide:
        ms = (cost.fixed_ms + cost.row_ms * padded_rows(rows.sum(axis=1), p.pad_to)
              + cost.expert_ms * expected_union(fresh, p.log_miss, p.weight))
    else:  # a slot verifying k > 0 drafts runs its own pass; the others share one
        drafted = drafts > 0  # [C, S]
        plain = np.where(drafted, 0.0, fresh)  # [C, S]
        alone = (1.0 - np.exp(fresh[:, :, None] * p.log_miss.T[None])) @ p.weight  # [C, S]
        ms = (cost.fixed_ms * ((plain.sum(axis=1) > 0) + drafted.sum(axis=1))
              + cost.row_ms * (padded_rows(np.where(drafted, 0, rows).sum(axis=1), p.pad_to)
                               + (padded_rows(rows, p.pad_to) * drafted).sum(axis=1))
              + cost.expert_ms * (expected_union(plain, p.log_miss, p.weight)
                                  + (alone * drafted).sum(axis=1)))
    return value / np.maximum(ms, 1e-9)


def choose(problem: BudgetProblem, cost: StepCost) -> list[int]:
    """Each slot's draft count in 0..max_drafts maximising :func:`ratio`, the fewest drafts
    among those within ``MARGIN`` of the best (:func:`_best`). Exhaustive up to
    ``MAX_CANDIDATES`` combinations, else coordinate ascent from the full lengths (each slot
    in turn takes its best length given the others', until a round changes nothing)."""
    limits = problem.max_drafts.astype(np.int64)
    if not limits.any():
        return [0] * len(limits)
    if math.prod(int(n) + 1 for n in limits) <= MAX_CANDIDATES:
        cands = _candidates(tuple(int(n) for n in limits))
        return [int(k) for k in cands[_best(problem, cost, cands)]]
    best = limits.copy()
    for _ in range(MAX_ROUNDS):
        before = best.copy()
        for s in np.flatnonzero(limits):
            cands = np.repeat(best[None, :], limits[s] + 1, axis=0)
            cands[:, s] = np.arange(limits[s] + 1)
            best = cands[_best(problem, cost, cands)]
        if np.array_equal(best, before):
            break
    return [int(k) for k in best]


@functools.lru_cache(maxsize=64)
def _candidates(limits: tuple[int, ...]) -> np.ndarray:
    """[C, S]: every combination of 0..limits[s] drafts (read-only: shared between steps)."""
    cands = np.array(list(itertools.product(*(range(n + 1) for n in limits))))
    cands.setflags(write=False)
    return cands


def _best(problem: BudgetProblem, cost: StepCost, cands: np.ndarray) -> int:
    """The index of the best candidate: of those within ``MARGIN`` of the highest ratio,
    the fewest drafts, then the highest ratio."""
    r = ratio(problem, cost, cands)
    top = r.max()
    near = np.flatnonzero(r >= top * (1.0 - MARGIN) - 1e-12 * abs(top))
    drafts = cands[near].sum(axis=1)
    fewest = near[drafts == drafts.min()]
    return int(fewest[np.argmax(r[fewest])])


def patterns(fractions: np.ndarray, chance: np.ndarray, history: np.ndarray,
             persistence: float, rest_chance: np.ndarray, rest_count: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """(log_miss [P, S], weight [P]) from the last step's routing.

    ``fractions`` [K, S]: for each CPU expert any slot picked last step, the share of the
    slot's rows that picked it (0: none); ``chance`` [K]: the chance a fresh pick of a row
    takes it (its share of all picks times the picks of a row); ``history`` [S] bool: whether
    the slot has routing from last step (a prompt chunk, a new request: no). A row of a slot
    with history picks expert e with pi = persistence * fraction + (1 - persistence) *
    chance, one without with its chance. The experts no slot picked last step are
    ``rest_count`` [B] experts of fresh-pick chance ``rest_chance`` [B] (a few classes of
    popularity). Patterns come in the order of their (fraction row, chance) rows, the rest's
    (fractions 0) first."""
    K, S = fractions.shape
    keep = rest_count > 0
    rows = np.concatenate([np.zeros((int(keep.sum()), S)), fractions])  # [K', S]
    base = np.concatenate([rest_chance[keep], chance])
    counts = np.concatenate([rest_count[keep], np.ones(K)]).astype(np.float64)
    if not len(rows):
        return np.zeros((0, S)), np.zeros(0)
    full = np.concatenate([rows, base[:, None]], axis=1)
    order = np.lexsort(full.T[::-1])  # equal rows side by side (np.unique(axis=0): slower)
    srt = full[order]
    new = np.ones(len(srt), dtype=bool)
    new[1:] = (srt[1:] != srt[:-1]).any(axis=1)
    group = np.cumsum(new) - 1
    weight = np.bincount(group, counts[order])
    uniq = srt[new]
    return pattern_table(uniq[:, :S], uniq[:, S], weight, history, persistence)


def pattern_table(uniq: np.ndarray, chance: np.ndarray, counts: np.ndarray,
                  history: np.ndarray, persistence: float) -> tuple[np.ndarray, np.ndarray]:
    """(log_miss [P, S], weight [P]) of the distinct fraction rows ``uniq`` [P, S] of fresh
    chance ``chance`` [P], held by ``counts`` [P] experts each (:func:`patterns`' last
    part)."""
    fresh = chance[:, None]
    pi = np.where(history[None, :], persistence * uniq + (1.0 - persistence) * fresh, fresh)
    return np.log1p(-np.clip(pi, 0.0, 1.0 - 1e-12)), counts
