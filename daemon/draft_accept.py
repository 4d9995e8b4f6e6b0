"""The adaptive draft budget's acceptance estimates (daemon/draft_stats.py's module doc,
its first point): per request, draft source and draft position, each given the drafts before
it were accepted."""

from __future__ import annotations

import collections

import numpy as np

# (successes, trials) a source's first draft position starts from: 0.8, optimistic, so that
# drafts run (and are measured) until the source's own figures say they do not pay; each
# later position leans on the one before it with the same weight (trials)
SOURCE_PRIOR = (1.6, 2.0)
MAX_POSITIONS = 16  # draft positions measured (speculation.num_drafts <= 15)
REQUEST_PRIOR_TRIALS = 16.0  # how much a request's estimate leans on its source's, until
# the requests' own spread says (request_weight): its first position's whole-life counts
# over the source's last SPREAD_REQUESTS requests of at least SPREAD_TRIALS verifies each,
# once there are SPREAD_MIN of them, give the spread of the requests' true rates around the
# source's, and the weight is what that spread is worth in trials, within WEIGHT_RANGE
SPREAD_REQUESTS = 64
SPREAD_TRIALS = 8.0
SPREAD_MIN = 8
WEIGHT_RANGE = (4.0, 1024.0)
REQUEST_DECAY = 0.95  # a request's counts, per verify
# the adaptive budget's optimism: it chooses on a source's rates raised by this many
# standard deviations of their estimates (rate(..., optimism=)). On the means alone, a
# position the choices stopped verifying after a few unlucky early verifies keeps its low
# estimate and its drafts are not tried again (session 31, the simulation of an H100
# machine: where every position accepted 0.88, some runs estimated one at 0.70-0.82 after
# 20-40 verifies);
# raised by its uncertainty it is tried until its estimate is sure, and a well-measured
# position is taken at about its mean
OPTIMISM = 0.75


class AcceptanceStats:
    """Acceptance probability per (request, source) and draft position, each given the
    drafts before it were accepted: :meth:`rate` gives them as ``[MAX_POSITIONS]``."""

    def __init__(self) -> None:
        self.sources: dict[int, np.ndarray] = {}  # source -> [2, positions]: successes, trials
        self.requests: dict[tuple[str, int], np.ndarray] = {}
        # source_rate's (the means, their standard deviations, the raised rates by
        # optimism), until the source's next verify
        self._rates: dict[int, tuple[np.ndarray, np.ndarray, dict[float, np.ndarray]]] = {}
        # each live request's first position, whole life: successes, trials
        self.lives: dict[tuple[str, int], list[float]] = {}
        self.ended: dict[int, collections.deque] = {}  # source -> ended requests' lives
        self._weights: dict[int, float] = {}  # request_weight's, until the next verify
        self.fixed_weight: float | None = None  # set: request_weight's, whatever the spread

    def observe(self, request_id: str, source: int, drafts: int, accepted: int) -> None:
        seen = np.zeros((2, MAX_POSITIONS))
        seen[0, :accepted] = 1.0
        seen[1, :min(accepted + (accepted < drafts), MAX_POSITIONS)] = 1.0
        src = self.sources.setdefault(source, np.zeros((2, MAX_POSITIONS)))
        src += seen
        self._rates.pop(source, None)
        self._weights.pop(source, None)
        life = self.lives.setdefault((request_id, source), [0.0, 0.0])
        life[0] += seen[0, 0]
        life[1] += seen[1, 0]
        req = self.requests.get((request_id, source))
        self.requests[(request_id, source)] = seen if req is None else REQUEST_DECAY * req + seen

    def source_rate(self, source: int, optimism: float = 0.0) -> np.ndarray:
        """``[MAX_POSITIONS]``: the source's probability at each position, over requests
        (read-only: kept until the source's next verify; a step's slots share it), raised by
        ``optimism`` standard deviations of each estimate (at most 1)."""
        out = self._rates.get(source)
        if out is None:
            s, t = self.sources.get(source, np.zeros((2, MAX_POSITIONS))).tolist()
            rates, sds = [], []
            before, weight = SOURCE_PRIOR[0] / SOURCE_PRIOR[1], SOURCE_PRIOR[1]
            for j in range(MAX_POSITIONS):  # (Python floats: a few times faster here)
                before = (s[j] + weight * before) / (t[j] + weight)
                rates.append(before)
                # a Beta posterior's (its mean before, of t + weight trials)
                sds.append((before * (1.0 - before) / (t[j] + weight + 1.0)) ** 0.5)
            out = self._rates[source] = (np.array(rates), np.array(sds), {})
            out[0].setflags(write=False)
        if not optimism:
            return out[0]
        raised = out[2].get(optimism)
        if raised is None:  # (once per verify: every slot of every step reads it)
            raised = out[2][optimism] = np.minimum(out[0] + optimism * out[1], 1.0)
            raised.setflags(write=False)
        return raised

    def trials(self, source: int, position: int) -> float:
        """Verifies of ``source`` that reached draft ``position`` (0: the first), over
        requests."""
        src = self.sources.get(source)
        return 0.0 if src is None or position >= MAX_POSITIONS else float(src[1, position])

    def rate(self, request_id: str, source: int, optimism: float = 0.0) -> np.ndarray:
        """``[MAX_POSITIONS]``: the request's probability at each position, its own decayed
        counts leaning on its source's rates (raised by ``optimism``: source_rate)."""
        prior = self.source_rate(source, optimism)
        req = self.requests.get((request_id, source))
        if req is None:
            return prior
        w = self.request_weight(source)
        return (req[0] + w * prior) / (req[1] + w)

    def request_weight(self, source: int) -> float:
        """How many trials of the source's rate a request's estimate leans on: the weight a
        Beta prior of the requests' spread has. Where the source's requests accept alike
        (the spread of their first positions' rates no wider than their verifies' sampling
        explains) the source's rate stands for each and a request's own misses move it
        little; where they differ, each request's own counts soon count."""
        w = self._weights.get(source) if self.fixed_weight is None else self.fixed_weight
        if w is not None:
            return w
        lives = [life for (_, src), life in self.lives.items() if src == source]
        lives += list(self.ended.get(source, ()))
        counted = np.array([life for life in lives if life[1] >= SPREAD_TRIALS]).reshape(-1, 2)
        if len(counted) < SPREAD_MIN:
            w = REQUEST_PRIOR_TRIALS
        else:
            k, n = counted.T
            total = n.sum()
            p = k.sum() / total
            spread = float(n @ (k / n - p) ** 2)  # sum_i n_i (p_i - p)^2
            # its expectation: (m - 1) p (1 - p) + tau^2 (N - sum n_i^2 / N)
            tau2 = (spread - (len(n) - 1) * p * (1 - p)) / (total - float(n @ n) / total)
            w = (WEIGHT_RANGE[1] if tau2 <= 0 else
                 float(np.clip(p * (1 - p) / tau2, *WEIGHT_RANGE)))
        self._weights[source] = w
        return w

    def keep(self, live: set[str]) -> None:
        self.requests = {k: v for k, v in self.requests.items() if k[0] in live}
        for key in [k for k in self.lives if k[0] not in live]:
            life = self.lives.pop(key)
            self.ended.setdefault(key[1], collections.deque(maxlen=SPREAD_REQUESTS)).append(
                tuple(life))
            self._weights.pop(key[1], None)
