"""Per-slot expert tracking through CUDA graphs (gpu_worker/experts/counters.py): a captured
forward's routes are the graph's buffers, rewritten by every replay; each replay's routes must
be read with that pass's row -> slot map, and a second replay of the same graph in one step
must not overwrite the first's. NumPy arrays stand in for the device buffers (rewritten in
place, as a replay does)."""

import numpy as np
import pytest

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


# ---- every layout against the slow formula ---------------------------------------------------
def _slow(passes) -> dict[int, dict[int, int]]:
    """Per slot {layer * E + expert: rows}, by loops: ``passes`` [(row_slot, [(ids, cpu)])]."""
    want: dict[int, dict[int, int]] = {}
    for row_slot, layers in passes:
        for layer, (ids, cpu) in enumerate(layers):
            for r, s in enumerate(row_slot.tolist()):
                for e, on in zip(ids[r].tolist(), cpu[r].tolist(), strict=True):
                    if s >= 0 and on:
                        slot = want.setdefault(s, {})
                        slot[layer * E + e] = slot.get(layer * E + e, 0) + 1
    return want


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_every_layout_gives_the_slow_formulas_counts(dtype) -> None:
    """Slots in several runs of a pass (a slot's rows split by another's), prompt and padding
    rows (-1), a slot whose picks are all on the GPU, several passes in one step, part of
    them replays packed before the next replay: each slot's experts and rows as counted by
    loops, ascending, int32 and uint16."""
    rng = np.random.default_rng(7)
    layouts = [np.array([0, 0, 0, 0], np.int64),
               np.array([2, 2, -1, -1, 1, 1, 1, 2, 5, 5, -1], np.int64),
               np.array([3, 3, 0, 0], np.int64),  # replays the first pass's graph
               np.array([-1, -1, 4], np.int64)]
    passes = []
    for row_slot in layouts:
        layers = [(rng.integers(0, E, (len(row_slot), 3)).astype(dtype),
                   rng.random((len(row_slot), 3)) < 0.5) for _ in range(4)]
        layers = [(ids, cpu & (row_slot != 5)[:, None]) for ids, cpu in layers]  # 5: GPU only
        passes.append((row_slot, layers))
    want = _slow(passes)
    assert 5 not in want and {0, 1, 2, 3, 4} <= set(want)
    for graphed in range(len(passes) + 1):  # the first `graphed` passes replay one graph
        c = ExpertCounters(1.0)
        bufs = [(np.zeros_like(ids), np.zeros_like(cpu)) for ids, cpu in passes[0][1]]
        c.track_rows(passes[0][0])
        start = c.begin_capture()
        for layer, (ids, cpu) in enumerate(bufs):
            c.add_routes(layer, E, ids, cpu)
        captured = c.end_capture(start)
        for i, (row_slot, layers) in enumerate(passes):
            c.track_rows(row_slot)
            if i < graphed and len(row_slot) == len(passes[0][0]):
                c.replay_routes(captured)
                for (ids, cpu), (new_ids, new_cpu) in zip(bufs, layers, strict=True):
                    ids[...], cpu[...] = new_ids, new_cpu
            else:
                for layer, (ids, cpu) in enumerate(layers):
                    c.add_routes(layer, E, ids.copy(), cpu.copy())
        got = c.take_slot_experts()
        assert set(got) == set(want), graphed
        for s, (ids, rows) in got.items():
            assert ids.dtype == np.int32 and rows.dtype == np.uint16
            assert (np.diff(ids) > 0).all()
            assert dict(zip(ids.tolist(), rows.tolist(), strict=True)) == want[s], (graphed, s)
        assert c.take_slot_experts() == {}


def test_a_pass_of_no_rows_or_no_tracked_rows_reports_nothing() -> None:
    c = ExpertCounters(1.0)
    c.track_rows(np.zeros(0, np.int64))
    c.add_routes(0, E, np.zeros((0, 2), np.int32), np.zeros((0, 2), bool))
    assert c.take_slot_experts() == {}
    c.track_rows(np.array([-1, -1], np.int64))  # a prompt chunk's rows
    c.add_routes(0, E, np.ones((2, 2), np.int32), np.ones((2, 2), bool))
    assert c.take_slot_experts() == {}
