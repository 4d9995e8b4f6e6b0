"""Per-slot expert tracking through CUDA graphs (gpu_worker/experts/counters.py): a captured
forward's routes are the graph's buffers, rewritten by every replay; each replay's routes must
be read with that pass's row -> slot map, and a second replay of the same graph in one step
must not overwrite the first's. NumPy arrays stand in for the device buffers (rewritten in
place, as a replay does)."""

import numpy as np

from gpu_worker.experts.counters import ExpertCounters

E = 8  # experts per layer


def _eager(row_slots, routes):
    """What eager passes report: every pass's (ids, cpu) per layer with its row -> slot."""
    c = ExpertCounters(1.0)
    for row_slot, layers in zip(row_slots, routes, strict=True):
        c.track_rows(row_slot)
        for layer, (ids, cpu) in enumerate(layers):
            c.add_routes(layer, E, ids.copy(), cpu.copy())
    return c.take_slot_experts()


def _graphed(row_slots, routes):
    """The same passes, the first one captured, every pass replayed into its buffers."""
    c = ExpertCounters(1.0)
    bufs = [(np.zeros_like(ids), np.zeros_like(cpu)) for ids, cpu in routes[0]]
    c.track_rows(row_slots[0])
    start = c.begin_capture()
    for layer, (ids, cpu) in enumerate(bufs):
        c.add_routes(layer, E, ids, cpu)
    captured = c.end_capture(start)
    assert c.take_slot_experts() == {}                   # capture ran nothing
    for row_slot, layers in zip(row_slots, routes, strict=True):
        c.track_rows(row_slot)
        c.replay_routes(captured)
        for (ids, cpu), (new_ids, new_cpu) in zip(bufs, layers, strict=True):
            ids[...], cpu[...] = new_ids, new_cpu        # the replay writes its buffers
    return c.take_slot_experts()


def _routes(rng, rows: int, layers: int = 3):
    return [(rng.integers(0, E, (rows, 2)).astype(np.int32), rng.random((rows, 2)) < 0.6)
            for _ in range(layers)]


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        x.tobytes() == y.tobytes() for k in a for x, y in zip(a[k], b[k], strict=True))


def test_one_replay_reports_the_eager_pass() -> None:
    rng = np.random.default_rng(0)
    row_slot = np.array([0, 0, 0, 2, 2, -1], np.int64)
    routes = [_routes(rng, 6)]
    want = _eager([row_slot], routes)
    assert want and _same(_graphed([row_slot], routes), want)


def test_two_replays_in_one_step_keep_both_passes() -> None:
    """Narrow verification replays one layout once per drafted slot within a step."""
    rng = np.random.default_rng(1)
    row_slots = [np.array([1, 1, 1, 1], np.int64), np.array([3, 3, 3, 3], np.int64)]
    routes = [_routes(rng, 4), _routes(rng, 4)]
    want = _eager(row_slots, routes)
    assert set(want) == {1, 3}
    assert _same(_graphed(row_slots, routes), want)


def test_untracked_passes_add_nothing() -> None:
    c = ExpertCounters(1.0)
    c.track_rows(np.zeros(2, np.int64))
    start = c.begin_capture()
    c.add_routes(0, E, np.zeros((2, 2), np.int32), np.ones((2, 2), bool))
    captured = c.end_capture(start)
    c.track_rows(None)
    c.replay_routes(captured)
    assert c.take_slot_experts() == {}
