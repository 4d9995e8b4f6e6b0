"""The bookkeeping of a set of CUDA graphs kept per key (gpu_worker/step_graph.py's pass
graphs, gpu_worker/mtp_graph.py's drafting graphs): which keys have a graph (the least
recently used dropped past a limit), which ran once eagerly (a key's first pass compiles what
its graph will launch; the second is captured), which were refused (eager for good), and
their counts in the owner's ``totals`` as ``<prefix>captures``, ``<prefix>first_runs``,
``<prefix>refused`` and ``graph_capture_ms``."""

from __future__ import annotations

import collections
import time

FIRST, CAPTURE, REPLAY, REFUSED = "first", "capture", "replay", "refused"


class GraphTable:
    def __init__(self, totals: dict, prefix: str, limit: int) -> None:
        self.totals, self.prefix, self.limit = totals, prefix, limit
        self.graphs: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self.seen: set[tuple] = set()
        self.refused: dict[tuple, str] = {}

    def lookup(self, key: tuple) -> tuple[str, object | None]:
        """What a pass of ``key`` does now: (REFUSED, None), (FIRST, None) (its first pass:
        eager, counted), (CAPTURE, None) or (REPLAY, its graph, now the most recent)."""
        if key in self.refused:
            return REFUSED, None
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            return REPLAY, g
        if key not in self.seen:
            self.seen.add(key)
            self.totals[f"{self.prefix}first_runs"] += 1
            return FIRST, None
        return CAPTURE, None

    def keep(self, key: tuple, g: object, t0: float) -> object:
        """``g`` captured for ``key`` since ``t0`` (perf_counter): kept and counted."""
        self.graphs[key] = g
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)
        self.totals[f"{self.prefix}captures"] += 1
        self.totals["graph_capture_ms"] += (time.perf_counter() - t0) * 1e3
        return g

    def refuse(self, key: tuple, error: Exception) -> None:
        """``key``'s capture failed: its passes stay eager."""
        self.refused[key] = f"{type(error).__name__}: {error}"
        self.totals[f"{self.prefix}refused"] += 1
