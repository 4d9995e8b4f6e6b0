"""The adaptive draft budget's acceptance estimates (daemon/draft_stats.py's module doc,
its first point): per request, draft source and draft position, each given the drafts before
it were accepted."""

from __future__ import annotations

import numpy as np

# (successes, trials) a source's first draft position starts from: 0.8, optimistic, so that
# drafts run (and are measured) until the source's own figures say they do not pay; each
# later position leans on the one before it with the same weight (trials)
SOURCE_PRIOR = (1.6, 2.0)
MAX_POSITIONS = 16  # draft positions measured (speculation.num_drafts <= 15)
REQUEST_PRIOR_TRIALS = 16.0  # how much a request's estimate leans on its source's
REQUEST_DECAY = 0.95  # a request's counts, per verify


class AcceptanceStats:
    """Acceptance probability per (request, source) and draft position, each given the
    drafts before it were accepted: :meth:`rate` gives them as ``[MAX_POSITIONS]``."""

    def __init__(self) -> None:
        self.sources: dict[int, np.ndarray] = {}  # source -> [2, positions]: successes, trials
        self.requests: dict[tuple[str, int], np.ndarray] = {}
        self._rates: dict[int, np.ndarray] = {}  # source_rate's, until the source's next verify

    def observe(self, request_id: str, source: int, drafts: int, accepted: int) -> None:
        seen = np.zeros((2, MAX_POSITIONS))
        seen[0, :accepted] = 1.0
        seen[1, :min(accepted + (accepted < drafts), MAX_POSITIONS)] = 1.0
        src = self.sources.setdefault(source, np.zeros((2, MAX_POSITIONS)))
        src += seen
        self._rates.pop(source, None)
        req = self.requests.get((request_id, source))
        self.requests[(request_id, source)] = seen if req is None else REQUEST_DECAY * req + seen

    def source_rate(self, source: int) -> np.ndarray:
        """``[MAX_POSITIONS]``: the source's probability at each position, over requests
        (read-only: kept until the source's next verify; a step's slots share it)."""
        out = self._rates.get(source)
        if out is None:
            s, t = self.sources.get(source, np.zeros((2, MAX_POSITIONS))).tolist()
            rates = []
            before, weight = SOURCE_PRIOR[0] / SOURCE_PRIOR[1], SOURCE_PRIOR[1]
            for j in range(MAX_POSITIONS):  # (Python floats: a few times faster here)
                before = (s[j] + weight * before) / (t[j] + weight)
                rates.append(before)
            out = self._rates[source] = np.array(rates)
            out.setflags(write=False)
        return out

    def trials(self, source: int, position: int) -> float:
        """Verifies of ``source`` that reached draft ``position`` (0: the first), over
        requests."""
        src = self.sources.get(source)
        return 0.0 if src is None or position >= MAX_POSITIONS else float(src[1, position])

    def rate(self, request_id: str, source: int) -> np.ndarray:
        prior = self.source_rate(source)
        req = self.requests.get((request_id, source))
        if req is None:
            return prior
        return (req[0] + REQUEST_PRIOR_TRIALS * prior) / (req[1] + REQUEST_PRIOR_TRIALS)

    def keep(self, live: set[str]) -> None:
        self.requests = {k: v for k, v in self.requests.items() if k[0] in live}
