"""Per-step counters of the routed experts, as the runner reports them (``take_stats``)."""

from __future__ import annotations

import numpy as np

from gpu_worker.backend import to_numpy


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
        pending are copied to the host first (an earlier replay of the same graph in this
        step would be overwritten), then the graph's are pending with the coming pass's
        rows (:meth:`track_rows`)."""
        if self._row_slot is None:
            return
        self._routes = [(base, _host_copy(ids), _host_copy(cpu), rs)
                        for base, ids, cpu, rs in self._routes]
        self._routes += [(base, ids, cpu, self._row_slot) for base, ids, cpu in captured
                         if len(self._row_slot) == ids.shape[0]]

    def take_slot_experts(self, keep: bool = True) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per tracked slot since the last call: its distinct CPU experts (int32 [K], layer *
        experts per layer + expert) and how many of its rows picked each (uint16 [K]). A row
        picks an expert at most once per layer, so a count is a number of rows. The layers
        of a pass are stacked where they live and copied to the host at once (two copies a
        pass, not two a layer: this runs between a step's forward and its result).
        ``keep=False``: the routes are dropped unread (a step whose plan did not ask: no
        copy, no host work; the forward still records them, so that a CUDA graph captured
        on such a step has its routes for the steps that ask)."""
        routes, self._routes, self._row_slot = self._routes, [], None
        if not keep:
            return {}
        slots, gids = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        i = 0
        while i < len(routes):
            j = i + 1  # routes[i:j]: one pass's layers (the same rows, shapes and arrays)
            while j < len(routes) and _same_pass(routes[i], routes[j]):
                j += 1
            run, row_slot = routes[i:j], routes[i][3]
            ids, cpu = _stacked([r[1] for r in run]), _stacked([r[2] for r in run])  # [L,R,k]
            base = np.array([r[0] for r in run], np.int64)
            mask = cpu & (row_slot >= 0)[None, :, None]
            gids.append((base[:, None, None] + ids.astype(np.int64))[mask])
            slots.append(np.broadcast_to(row_slot[None, :, None], ids.shape)[mask])
            i = j
        slot, gid = np.concatenate(slots).astype(np.int64), np.concatenate(gids)
        keys, rows = np.unique((slot << 32) | gid, return_counts=True)  # by slot, then id
        owner = keys >> 32
        cuts = np.flatnonzero(np.diff(owner)) + 1
        return {int(owner[a]): ((keys[a:b] & 0xFFFFFFFF).astype(np.int32),
                                rows[a:b].astype(np.uint16))
                for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(keys)], strict=True)
                if b > a}

    def take(self) -> dict[str, float]:
        """The counters since the last call, then zero."""
        stats = {"moe_layers": self.moe_layers, "gpu_experts": self.gpu_experts,
                 "cpu_experts": self.cpu_experts,
                 "cpu_expert_bytes": int(self.cpu_experts * self.bytes_per_expert),
                 "cpu_experts_ms": self.cpu_experts_ms}
        self._reset()
        return stats


def _same_pass(a: tuple, b: tuple) -> bool:
    """Whether two layers' routes stack: the same row map, shapes and kind of array."""
    return (a[3] is b[3] and a[1].shape == b[1].shape and type(a[1]) is type(b[1])
            and type(a[2]) is type(b[2]))


def _stacked(arrays: list) -> np.ndarray:
    """``arrays`` (all NumPy, or all of one device module) stacked, on the host."""
    if isinstance(arrays[0], np.ndarray):
        return np.stack(arrays)
    import cupy  # noqa: PLC0415 (a device array: cupy is imported already)

    return to_numpy(cupy.stack(arrays))


def _host_copy(array) -> np.ndarray:
    """A host array that nothing on the device (or the NumPy backend) writes again."""
    return array.copy() if isinstance(array, np.ndarray) else to_numpy(array)
