"""The online estimates behind the adaptive draft budget (daemon/draft_budget.py; the budget
itself, ``DraftBudget``, is daemon/draft_adaptive.py), and where each of them lives.

* Acceptance per request, draft source and draft position: a verify of k drafts with A
  accepted is a success at positions 1..A and, when A < k, a failure at position A + 1 (the
  positions after it were not tried). A position's probability is that of its draft given
  the ones before it were accepted: MTP heads and suffix matches are surer of their first
  draft than of their third. Over all requests, a source's position leans on the position
  before it (the first on a prior): until a position is measured it is taken to accept as
  the one before it does (the chain). A request's counts decay (recent text matters) and
  lean on its source's, position by position. The choice reads the source's rates raised
  by their uncertainty (daemon/draft_accept.OPTIMISM), so a position measured low early is
  tried again.
* Routing per request: the CPU experts its rows picked in its last decode step
  (``SlotResult.cpu_experts`` / ``cpu_expert_rows``, sent when the WorkerConfig asks), the
  CPU picks per row, the experts held (``counters["cpu_experts_held"]``), each expert's
  share of all picks (its popularity class: a router favours some experts), the
  *persistence* (how much more than chance a row picks the experts its slot picked a
  given number of steps before: the adaptive budget's, two) and the *locality* (how many
  of the experts of the row before a slot's next row of the same step keeps).
* Step cost. A CPU expert's: the worker's CPU expert time of a decode-only step over its
  distinct CPU experts (``timings_ms["cpu_experts"]``, ``counters["cpu_experts"]``), with
  forgetting, from the first such step: the experts are read while the GPU waits, and the
  steps' experts and rows rise together, so a fit of the step time alone cannot tell an
  expert's cost from a row's. The pass's and a row's: least squares, with forgetting, of
  what the CPU experts leave of each decode-only step's wall time, on (passes, rows); the
  config's constants until ``MIN_STEPS`` such steps were seen, and a row's where the steps'
  rows cannot tell it (a slight ridge toward it). Without the worker's CPU time (no CPU experts),
  all three by the fit of the step time. All of it per number of slots (daemon/draft_cost.py).
  Steps that captured a CUDA graph or ran a layout's
  first (eager, compiling) pass are left out: they cost more than their layout does, and a
  budget that changes lengths meets new layouts often, so fitting them would make every row
  look dearer and cut later drafts.
"""

from __future__ import annotations

import numpy as np

from daemon.draft_budget import pattern_table, patterns

EMA = 0.1  # weight of a new step in the persistence, locality and picks-per-row averages
POPULARITY_EMA = 0.01  # weight of a slot's step in each CPU expert's share of the picks
MAX_SHARE_IDS = 1 << 22  # global expert ids (layer * experts + expert) the shares cover
# experts fall into popularity classes by their share of the picks, BIN_STEPS classes per
# doubling, between 2 ** -BIN_SPAN and 2 ** BIN_SPAN times the uniform share (beyond: the
# end classes)
BIN_STEPS = 1
BIN_SPAN = 10
CLASSES = 2 * BIN_SPAN * BIN_STEPS + 1
CLASS_REFRESH = 16
MAX_STEP_GAP = 8  # steps without routes a step's routes stand for in the shares, at most


class RoutingStats:
    """Each request's CPU experts of its last decode step and the figures to predict the
    next step's from them."""

    def __init__(self, gap: int = 1) -> None:
        # the steps between a slot's routes and the step they predict: the persistence is
        # learned from routes that many steps apart
        self.gap = gap
        self.last: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}  # ids [K], rows [K]
        # that picked each, the step's rows
        self.seen_at: dict[str, int] = {}  # the step (observe's ``step``) of each one's last
        # and the routes before those (with their step): where every step's are read, the
        # routes ``gap`` steps old are these
        self.older: dict[str, tuple[int, tuple[np.ndarray, np.ndarray, int]]] = {}
        self.universe = 0  # CPU experts held, over all MoE layers
        self.picks_per_row = 0.0  # CPU (layer, expert) picks of one row, over layers
        self.persistence = 0.5
        self.locality = 0.0  # a row's share of experts kept from the row before (same slot)
        # each CPU expert's share of the picks (``POPULARITY_EMA`` per slot's step), as the
        # shares seen (by global id) plus what is left of a uniform prior over the universe
        self._seen = np.zeros(0)
        self._prior = 1.0
        self._noise = 0.0  # what sampling adds to the sum of the squared shares
        self._classes: tuple[np.ndarray, np.ndarray] | None = None  # _class_table's, kept
        self._stale = 0  # slot steps since (shares learned after) the classes were counted
        self._step, self._gap = -1, 1  # the last step with routes, steps since the one before
        self._snapshot = (self._seen, self._prior)  # the shares they were counted from

    def observe(self, request_id: str, rows: int, ids: np.ndarray, counts: np.ndarray,
                universe: int, step: int | None = None) -> None:
        """One decode slot's step: ``rows`` rows picked CPU experts ``ids`` [K] (global:
        layer * experts per layer + expert), ``counts`` [K] of its rows each. ``step``: the
        step's number, where not every step's routes are observed (the persistence is
        learned only from a slot's steps ``gap`` apart); None: every step's are."""
        self.universe = universe
        if not len(ids) or universe <= 0 or rows <= 0:
            return
        picks = float(counts.sum())
        per_row = picks / rows
        self.picks_per_row = (self.picks_per_row + EMA * (per_row - self.picks_per_row)
                              if self.picks_per_row else per_row)
        ids, counts = ids.astype(np.int64), counts.astype(np.int64)
        if len(ids) > 1 and not (ids[1:] > ids[:-1]).all():  # the worker sends them sorted
            order = np.argsort(ids, kind="stable")
            ids, counts = ids[order], counts[order]
        prev = self.last.get(request_id) if step is None else self.routes_of(request_id,
                                                                            step - self.gap)
        if prev is not None and len(prev[0]) < universe:
            hit = float(counts[_members(prev[0], ids)].sum()) / picks
            chance = min(self._share(prev[0]), 0.99)  # a fresh pick lands among them
            seen = min(max((hit - chance) / (1.0 - chance), 0.0), 1.0)
            self.persistence += EMA * (seen - self.persistence)
        if rows > 1:
            kept = self._kept(rows, len(ids), per_row)
            self.locality += EMA * (kept - self.locality)
        if step is not None:
            if request_id in self.seen_at:
                self.older[request_id] = (self.seen_at[request_id], self.last[request_id])
            self.seen_at[request_id] = step
        self.last[request_id] = (ids, counts, rows)
        # a step with routes stands for the steps without since the last one (up to
        # MAX_STEP_GAP of them): the shares fade per step, however few steps are read
        if step is not None and step != self._step:
            self._gap = min(step - self._step, MAX_STEP_GAP) if self._step >= 0 else 1
            self._step = step
        a = 1.0 - (1.0 - POPULARITY_EMA) ** self._gap
        if ids[-1] >= max(len(self._seen), MAX_SHARE_IDS):
            return  # an id no model's layers reach: keep its routing, learn no share from it
        if ids[-1] >= len(self._seen):
            self._seen = np.concatenate([self._seen, np.zeros(int(ids[-1]) + 1 - len(self._seen))])
        self._seen *= 1.0 - a
        self._seen[ids] += a * counts / picks
        self._prior *= 1.0 - a
        self._noise = (1.0 - a) ** 2 * self._noise + a * a / picks
        self._stale += 1

    def _kept(self, rows: int, distinct: int, per_row: float) -> float:
        """The locality that explains ``distinct`` experts of ``rows`` consecutive rows of
        ``per_row`` picks each: (rows - x) / (rows - 1), where x independent rows of fresh
        picks are expected to touch ``distinct`` experts (by the popularity classes)."""
        mean, count = self._class_table()
        full = count > 0
        miss = np.log1p(-np.clip(mean[full] * per_row, 0.0, 1.0 - 1e-12))
        count = count[full]
        x = float(rows)
        for _ in range(8):  # Newton on the concave sum_b n_b (1 - (1 - q_b) ** x) = distinct
            left = np.exp(x * miss)
            f = float(count @ (1.0 - left)) - distinct
            slope = -float(count @ (left * miss))
            if slope <= 0 or abs(f) < 0.25:
                break
            x = min(max(x - f / slope, 1.0), float(rows))
        return (rows - x) / (rows - 1)

    def _class_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean share [CLASSES], count [CLASSES]) of the CPU experts by popularity class
        (:func:`popularity_class`; an empty class: its middle share, 0), counted again once
        the shares learned ``CLASS_REFRESH`` slot steps more (a step moves them by 1 %)."""
        if self._classes is None or self._stale >= CLASS_REFRESH:
            self._stale = 0
            u = max(self.universe, 1)
            self._snapshot = (self._seen.copy(), self._prior)
            held = np.flatnonzero(self._seen > 0)
            shares = np.append(self._seen[held] + self._prior / u, self._prior / u)
            number = np.append(np.ones(len(held)), max(u - len(held), 0))
            cls = popularity_class(shares, u)
            count = np.bincount(cls, number, CLASSES)
            total = np.bincount(cls, shares * number, CLASSES)
            nominal = 2.0 ** ((np.arange(CLASSES) + 0.5) / BIN_STEPS - BIN_SPAN) / u
            self._classes = (np.divide(total, count, out=nominal, where=count > 0), count)
        return self._classes

    def _share(self, ids: np.ndarray) -> float:
        """The share of all CPU picks that experts ``ids`` (distinct) take."""
        return float(self._shares(ids).sum())

    def _shares(self, ids: np.ndarray, snapshot: bool = False) -> np.ndarray:
        """Each of experts ``ids``' share of all CPU picks (``snapshot``: as the popularity
        classes last counted them)."""
        seen, prior = self._snapshot if snapshot else (self._seen, self._prior)
        inside = ids < len(seen)
        out = np.zeros(len(ids))
        out[inside] = seen[ids[inside]]
        return out + prior / max(self.universe, 1)

    @property
    def effective(self) -> int:
        """How many CPU experts a fresh pick spreads over, as far as two picks collide:
        1 / (sum of the squared shares), less what sampling adds to it. The universe when
        every expert is as likely; fewer where some are hotter (a real router's skew). A
        figure for /metrics: the union model uses the popularity classes themselves."""
        u = self.universe
        if u <= 0:
            return 0
        seen, p = self._seen, self._prior
        squares = float(seen @ seen) + 2.0 * p / u * float(seen.sum()) + p * p / u
        return int(min(u, 1.0 / max(squares - self._noise, 1.0 / u)))

    def keep(self, live: set[str]) -> None:
        self.last = {k: v for k, v in self.last.items() if k in live}
        self.seen_at = {k: v for k, v in self.seen_at.items() if k in live}
        self.older = {k: v for k, v in self.older.items() if k in live}

    def has_history(self, request_id: str, step: int | None = None) -> bool:
        """Whether the request's routes of ``step`` are kept (None: any)."""
        return self.routes_of(request_id, step) is not None

    def routes_of(self, request_id: str, step: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The request's routes (ids, rows per id, the step's rows) of ``step``, of its last
        two steps with routes (None: its last; none: None)."""
        if step is None or self.seen_at.get(request_id) == step:
            return self.last.get(request_id)
        older = self.older.get(request_id)
        return older[1] if older is not None and older[0] == step else None

    def patterns(self, request_ids: list[str | None], step: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """daemon/draft_budget.patterns for slots of these requests (None: a prompt chunk),
        in the same order and bits, without its sort of [K, S + 1] rows: an expert's row of
        counts and its popularity class are one integer (the slots' counts as digits, the
        first slot the most significant, then the class), so experts with equal rows are
        found by sorting K integers. ``step``: the last step; a slot whose routes are older
        is taken to have none (its experts then persist no more than chance)."""
        hist = [self.routes_of(r, step) if r is not None else None for r in request_ids]
        S = len(hist)
        history = np.array([h is not None for h in hist])
        if self.universe <= 0 or self.picks_per_row <= 0:
            return np.zeros((0, S)), np.zeros(0)
        mean, count = self._class_table()
        base = 1 + max((h[2] for h in hist if h is not None), default=0)
        if base ** S * CLASSES >= 2 ** 62:  # keys too wide
            return self._patterns_by_rows(hist, history)
        digit = base ** np.arange(S - 1, -1, -1, dtype=np.int64)  # [S]
        past = [(h[0], h[1].astype(np.int64) * digit[s]) for s, h in enumerate(hist)
                if h is not None and len(h[0])]
        keys = np.zeros(0, np.int64)
        rest = count.copy()
        if past:
            ids = np.concatenate([p[0] for p in past])
            order = np.argsort(ids, kind="stable")
            srt = ids[order]
            first = np.flatnonzero(np.concatenate([[True], srt[1:] != srt[:-1]]))
            cls = popularity_class(self._shares(srt[first], True), self.universe)
            keys = np.add.reduceat(np.concatenate([p[1] for p in past])[order], first)
            keys = keys * CLASSES + cls  # [K] one per distinct expert, all >= CLASSES
            rest = np.maximum(rest - np.bincount(cls, minlength=CLASSES), 0)
        keys = np.sort(np.concatenate([np.flatnonzero(rest > 0), keys]))  # the unpicked first
        if not len(keys):
            return np.zeros((0, S)), np.zeros(0)
        new = np.concatenate([[True], keys[1:] != keys[:-1]])
        counts = np.diff(np.append(np.flatnonzero(new), len(keys))).astype(np.float64)
        uniq = keys[new]
        unpicked = uniq < CLASSES  # one key per class: its count is the class's rest
        counts[unpicked] = rest[uniq[unpicked]]
        digits = (uniq // CLASSES)[:, None] // digit[None, :] % base  # [P, S]
        rows = np.array([h[2] if h is not None else 1 for h in hist])
        return pattern_table(digits / rows[None, :], mean[uniq % CLASSES] * self.picks_per_row,
                             counts, history, self.persistence)

    def _patterns_by_rows(self, hist: list, history: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`patterns` by daemon/draft_budget.patterns' sort of the fraction rows."""
        mean, count = self._class_table()
        ids = [h[0] for h in hist if h is not None]
        union = np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
        frac = np.zeros((len(union), len(hist)))  # [K, S]
        for s, h in enumerate(hist):
            if h is not None:
                frac[np.searchsorted(union, h[0]), s] = h[1] / h[2]
        cls = popularity_class(self._shares(union, True), self.universe)
        rest = np.maximum(count - np.bincount(cls, minlength=CLASSES), 0)
        return patterns(frac, mean[cls] * self.picks_per_row, history, self.persistence,
                        mean * self.picks_per_row, rest)


def popularity_class(shares: np.ndarray, universe: int) -> np.ndarray:
    """The popularity class (0 .. CLASSES - 1) of experts of these shares of the picks:
    ``BIN_STEPS`` classes per doubling of the share over the uniform 1 / ``universe``."""
    scaled = np.maximum(np.asarray(shares) * universe, 2.0 ** -BIN_SPAN)
    steps = np.floor(np.log2(scaled) * BIN_STEPS).astype(np.int64) + BIN_SPAN * BIN_STEPS
    return np.clip(steps, 0, CLASSES - 1)


def _members(ref: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``np.isin(ids, ref)`` for a sorted ``ref``, by binary search (no hashing or sort of
    either: a few times faster at a step's thousand experts a slot)."""
    if not len(ref):
        return np.zeros(len(ids), dtype=bool)
    at = np.minimum(np.searchsorted(ref, ids), len(ref) - 1)
    return ref[at] == ids
