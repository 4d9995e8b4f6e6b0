"""Per-step counters of the routed experts, as the runner reports them (``take_stats``)."""

from __future__ import annotations

import numpy as np

from gpu_worker.kernels.route_pack import pack_routes, pack_routes_reference


class ExpertCounters:
    """Distinct experts per MoE layer summed over layers (the backend's and the CPU's), CPU
    expert weight bytes read and CPU expert time (host path: wall time of the dispatches;
    launched path: the slowest worker's kernel time)."""

    def __init__(self, bytes_per_expert: float) -> None:
        self.bytes_per_expert = bytes_per_expert
        self._reset()
        # per-slot routing (WorkerConfig.slot_routing): the pass's row -> slot map [R] (-1:
        # a row not tracked), and per layer (id base, ids [R, k], cpu [R, k], row -> slot)
        self._row_slot: np.ndarray | None = None
        self._routes: list[tuple[int, object, object, np.ndarray]] = []
        # runs packed before a later replay rewrote their buffers (row -> slot, gids [L,R,k])
        self._packed: list[tuple[np.ndarray, np.ndarray]] = []

    def _reset(self) -> None:
        self.moe_layers = self.gpu_experts = self.cpu_experts = 0
        self.cpu_experts_ms = 0.0

    def add_layer(self, ids: np.ndarray, cpu: np.ndarray) -> None:
        """One layer on the host: ``ids [R, k]`` global expert ids, ``cpu [R, k]`` bool."""
        self.moe_layers += 1
        self.gpu_experts += len(np.unique(ids[~cpu]))
        self.cpu_experts += len(np.unique(ids[cpu]))

    def add_distinct(self, gpu: int, cpu: int, ms: float) -> None:
        """Counts the launched path's kernels kept on the device (PinnedRing.take_distinct)."""
        self.gpu_experts += gpu
        self.cpu_experts += cpu
        self.cpu_experts_ms += ms

    def track_rows(self, row_slot: np.ndarray | None) -> None:
        """Record the coming pass's CPU picks per slot: ``row_slot`` [R] (None: stop)."""
        self._row_slot = row_slot

    def pad_rows(self, rows: int) -> None:
        """The coming pass's rows past the tracked ones, up to ``rows``, are no slot's."""
        have = self._row_slot
        if have is not None and have.size < rows:
            self._row_slot = np.concatenate([have, np.full(rows - have.size, -1, have.dtype)])

    @property
    def tracking(self) -> bool:
        return self._row_slot is not None

    def add_routes(self, layer: int, num_experts: int, ids, cpu) -> None:
        """One layer's picks ``ids`` [R, k] and ``cpu`` [R, k] bool (host or device arrays,
        kept until :meth:`take_slot_experts`), when rows are tracked."""
        if self._row_slot is not None and len(self._row_slot) == ids.shape[0]:
            self._routes.append((layer * num_experts, ids, cpu, self._row_slot))

    def begin_capture(self) -> int:
        """Before a CUDA graph captures a forward: where its routes will start."""
        return len(self._routes)

    def end_capture(self, start: int) -> list[tuple[int, object, object]]:
        """The routes the captured forward added from ``start`` (device buffers of the graph,
        which each replay rewrites), taken off the pending list (capture runs nothing)."""
        captured = [(base, ids, cpu) for base, ids, cpu, _ in self._routes[start:]]
        del self._routes[start:]
        return captured

    def replay_routes(self, captured: list[tuple[int, object, object]]) -> None:
        """Before a replay of a graph whose capture gave ``captured``: the routes still
        pending are packed on the host first (an earlier replay of the same graph in this
        step would be overwritten), then the graph's are pending with the coming pass's
        rows (:meth:`track_rows`)."""
        if self._row_slot is None:
            return
        self._packed += _packed_runs(self._routes)
        self._routes = [(base, ids, cpu, self._row_slot) for base, ids, cpu in captured
                        if len(self._row_slot) == ids.shape[0]]

    def take_slot_experts(self, keep: bool = True) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per tracked slot since the last call: its distinct CPU experts (int32 [K], layer *
        experts per layer + expert, ascending) and how many of its rows picked each (uint16
        [K]). A row picks an expert at most once per layer, so a count is a number of rows.
        The layers of a pass are packed where they live and copied to the host at once (one
        launch and one copy a pass, not two copies a layer: gpu_worker/kernels/route_pack.py;
        this runs between a step's forward and its result). ``keep=False``: the routes are
        dropped unread (a step whose plan did not ask: no copy, no host work; the forward
        still records them, so that a CUDA graph captured on such a step has its routes for
        the steps that ask)."""
        routes, packed = self._routes, self._packed
        self._routes, self._packed, self._row_slot = [], [], None
        if not keep:
            return {}
        per_slot: dict[int, list[np.ndarray]] = {}
        for row_slot, gids in packed + _packed_runs(routes):  # gids [L, R, k]
            if not len(row_slot):
                continue
            edges = (np.flatnonzero(row_slot[1:] != row_slot[:-1]) + 1).tolist()
            for a, b in zip([0, *edges], [*edges, len(row_slot)], strict=True):  # one slot's
                if row_slot[a] >= 0:
                    per_slot.setdefault(int(row_slot[a]), []).append(gids[:, a:b].ravel())
        out = {}
        for slot, parts in per_slot.items():
            ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
            ids = ids[ids >= 0]
            if ids.size:
                out[slot] = _distinct_counts(ids)
        return out

    def take(self) -> dict[str, float]:
        """The counters since the last call, then zero."""
        stats = {"moe_layers": self.moe_layers, "gpu_experts": self.gpu_experts,
                 "cpu_experts": self.cpu_experts,
                 "cpu_expert_bytes": int(self.cpu_experts * self.bytes_per_expert),
                 "cpu_experts_ms": self.cpu_experts_ms}
        self._reset()
        return stats


def _distinct_counts(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``ids`` (1-D, a copy the caller gives away), ascending, and
    how often each occurs (uint16): ``np.unique(..., return_counts=True)`` with less
    overhead."""
    ids.sort()
    new = np.empty(ids.size, bool)
    new[0] = True
    np.not_equal(ids[1:], ids[:-1], out=new[1:])
    first = np.flatnonzero(new)
    counts = np.empty(first.size, np.uint16)
    counts[:-1] = first[1:] - first[:-1]
    counts[-1] = ids.size - first[-1]
    return ids[first], counts


def _same_pass(a: tuple, b: tuple) -> bool:
    """Whether two layers' routes pack together: the same row map, shapes, dtypes and kind
    of array."""
    return (a[3] is b[3] and a[1].shape == b[1].shape and type(a[1]) is type(b[1])
            and a[1].dtype == b[1].dtype and type(a[2]) is type(b[2]))


def _packed_runs(routes: list[tuple]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``routes`` (per layer: id base, ids, cpu, row -> slot) as runs of one pass's layers:
    (row -> slot [R], int32 [L, R, k] ``base + id`` on the CPU, else -1), on the host."""
    runs, i = [], 0
    while i < len(routes):
        j = i + 1  # routes[i:j]: one pass's layers (the same rows, shapes and arrays)
        while j < len(routes) and _same_pass(routes[i], routes[j]):
            j += 1
        run = routes[i:j]
        bases, ids, cpu = [r[0] for r in run], [r[1] for r in run], [r[2] for r in run]
        pack = pack_routes_reference if isinstance(ids[0], np.ndarray) else pack_routes
        runs.append((run[0][3], pack(bases, ids, cpu)))
        i = j
    return runs
