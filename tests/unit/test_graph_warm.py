"""The layouts captured at start-up (gpu_worker/graph_warm.py): one pass of each CUDA-graph
layout (rows and slots, step_graph.layout_key) the daemon's decode and verify passes can
have, checked against a brute-force enumeration of the planner's rules and against the
passes the real scheduler plans."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gpu_worker.engine import Engine
from gpu_worker.graph_warm import MAX_WARM_LAYOUTS, layouts
from protocol.messages import DraftSource, SamplingParams, SlotWork, WorkKind
from protocol.worker_config import MAX_WIDE_SLOTS, WIDE_CAPACITIES, WorkerConfig
from scripts.tiny_model import make_tiny_model
from tests.unit.spec_serve import oracle, serve
from tests.unit.test_layout_order import _key  # a pass's graph key, as the Runner makes it


def _brute(max_slots: int, max_drafts: int) -> set[tuple[int, int]]:
    """(slots, rows) of every assignment of drafts to 1..max_slots slots a wide pass may hold."""
    out = set()
    for n in range(1, max_slots + 1):
        for drafts in itertools.product(range(max_drafts + 1), repeat=n):
            drafted = sum(1 for d in drafts if d)
            if drafted <= MAX_WIDE_SLOTS and sum(drafts) + n <= WIDE_CAPACITIES[-1]:
                out.add((n, n + sum(drafts)))
    return out


def _work(drafts) -> list[SlotWork]:
    return [SlotWork(slot=s, request_id=f"r{s}", kind=WorkKind.DECODE,
                     input_ids=np.zeros(1, np.int32), start_pos=3, num_tokens=1, prompt_len=1,
                     needs_logits=True, sampling=SamplingParams(seed=0),
                     draft_ids=np.zeros(d, np.int32),
                     draft_sources=np.full(d, DraftSource.MTP, np.uint8))
            for s, d in enumerate(drafts)]


def test_off_and_no_drafts_warm_the_decode_layouts_only():
    assert layouts(3, 0, "wide") == layouts(3, 4, "off") == [(0,), (0, 0), (0, 0, 0)]


def test_narrow_warms_a_drafted_slot_alone():
    assert layouts(2, 3, "narrow") == [(0,), (0, 0), (3,), (2,), (1,)]
    assert layouts(1, 2, "wide") == [(0,), (2,), (1,)]  # one slot: its pass is its own


@pytest.mark.parametrize("max_slots,max_drafts", [(2, 1), (3, 2), (4, 4), (6, 3), (4, 7)])
def test_wide_layouts_are_one_pass_of_every_layout_the_planner_may_make(max_slots, max_drafts):
    got = layouts(max_slots, max_drafts, "wide", limit=10**6)
    assert got[:max_slots] == [(0,) * n for n in range(1, max_slots + 1)]
    keys = [(len(s), len(s) + sum(s)) for s in got]
    assert len(keys) == len(set(keys)) and set(keys) == _brute(max_slots, max_drafts)
    for s in got:  # each a pass the planner may make
        assert list(s) == sorted(s, reverse=True) and max(s) <= max_drafts
        assert sum(1 for d in s if d) <= MAX_WIDE_SLOTS and len(s) + sum(s) <= 16


def test_four_slots_of_four_drafts_make_36_verify_layouts():
    assert len(layouts(4, 4, "wide")) == 4 + 36 <= 4 + MAX_WARM_LAYOUTS
    assert len(layouts(8, 4, "wide", limit=50)) == 8 + 50


def test_every_split_of_a_layouts_rows_has_its_graph_key():
    """Any assignment of drafts to slots the planner may make has the key of the warmed pass
    with its slots and rows (so the graph captured at start-up replays it)."""
    warmed = {(len(s), len(s) + sum(s)): _key(_work(s)) for s in layouts(4, 4, "wide")}
    for n in range(1, 5):
        for drafts in itertools.product(range(5), repeat=n):
            if len(drafts) + sum(drafts) <= 16:
                assert _key(_work(drafts)) == warmed[(n, n + sum(drafts))], drafts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=5,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=4, max_len=320).model


@pytest.mark.parametrize("mode", ["wide", "narrow"])
def test_the_schedulers_passes_are_among_the_warmed_layouts(model, mode):
    """Four requests with oracle drafts of 0-4 tokens (varied per slot and step), planned
    by the real scheduler: every decode pass's shape is a warmed layout."""
    prompts = [[5, 6, 7, 8] * 4, list(range(20, 36)), [3, 1, 4, 1, 5, 9], list(range(60, 72))]
    plain, _, _ = serve(model, prompts, n=24, context=320)
    lengths = lambda seq: (len(seq.generated) + int(seq.req.request_id[1:])) % 5  # noqa: E731
    _, worker, _ = serve(model, prompts, n=24, mode=mode, context=320,
                         drafts=oracle(plain, model.cfg.vocab_size, lengths), num_drafts=4)
    warmed = {_key(_work(s)) for s in layouts(4, 4, mode)}
    seen = set()
    for plan in worker.plans:
        if not plan.slots or any(w.kind != WorkKind.DECODE for w in plan.slots):
            continue  # passes with prompt rows stay eager
        drafted = [w for w in plan.slots if len(w.draft_ids)]
        groups = ([plan.slots] if plan.wide or not drafted else
                  [[w for w in plan.slots if not len(w.draft_ids)]] + [[w] for w in drafted])
        for group in filter(None, groups):
            key = _key(group)
            assert key in warmed, key
            seen.add(key)
    assert len(seen) > 4  # verify layouts, several of them


def test_the_worker_config_carries_the_speculation_mode_and_warm_up():
    cfg = WorkerConfig(run_dir="/tmp/x", model="/tmp/m", max_drafts=4,
                       speculation_mode="narrow", graph_warm_up="decode", graph_buckets=False,
                       mtp_drafts=4, graph_mtp=False)
    assert WorkerConfig.from_json(cfg.to_json()) == cfg and not cfg.graph_buckets
    assert cfg.mtp_drafts == 4 and not cfg.graph_mtp
    for bad in ({"speculation_mode": "fast"}, {"graph_warm_up": "some"},
                {"graph_buckets": 1}, {"mtp_drafts": -1}, {"graph_mtp": "no"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WorkerConfig(run_dir="/tmp/x", model="/tmp/m", **bad)


@pytest.mark.parametrize("mode", ["wide", "narrow"])
@pytest.mark.parametrize("buckets", [True, False])
def test_the_mtp_layouts_cover_every_head_pass_the_scheduler_makes(mode, buckets):
    """Every head pass a step can make (each slot of a pass committing 1 + its accepted
    drafts; wide: the pass's slots together, at most 16 rows; narrow: a drafted slot alone,
    the undrafted slots of one row together) has a warmed layout's graph key."""
    from gpu_worker.graph_buckets import bucket  # noqa: PLC0415
    from gpu_worker.graph_warm import mtp_layouts  # noqa: PLC0415

    def key(rows):
        return (bucket(sum(rows)) if buckets else sum(rows), len(rows))

    warmed = {key(r) for r in mtp_layouts(4, 4, mode, buckets)}
    assert len(warmed) == len(mtp_layouts(4, 4, mode, buckets))
    for n in range(1, 5):
        for committed in itertools.product(range(1, 6), repeat=n):
            if mode == "narrow" and n > 1 and max(committed) > 1:
                continue  # narrow: drafted slots pass alone
            if sum(committed) <= 16:
                assert key(committed) in warmed, committed
