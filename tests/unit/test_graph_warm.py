"""The layouts captured at start-up (gpu_worker/graph_warm.py): exactly the multisets of slot
shapes the daemon's decode and verify passes can have, checked against a brute-force
enumeration of the planner's rules and against the passes the real scheduler plans."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gpu_worker.engine import Engine
from gpu_worker.graph_warm import MAX_WARM_LAYOUTS, layouts
from gpu_worker.runner import layout_order
from protocol.messages import DraftSource, SamplingParams, SlotWork, WorkKind
from protocol.worker_config import MAX_WIDE_SLOTS, WIDE_CAPACITIES, WorkerConfig
from scripts.tiny_model import make_tiny_model
from tests.unit.spec_serve import oracle, serve


def _brute(max_slots: int, max_drafts: int) -> set[tuple[int, ...]]:
    """Every assignment of drafts to 1..max_slots slots that a wide pass may hold, sorted."""
    out = set()
    for n in range(1, max_slots + 1):
        for drafts in itertools.product(range(max_drafts + 1), repeat=n):
            drafted = sum(1 for d in drafts if d)
            if drafted <= MAX_WIDE_SLOTS and sum(drafts) + n <= WIDE_CAPACITIES[-1]:
                out.add(tuple(sorted(drafts, reverse=True)))
    return out


def test_off_and_no_drafts_warm_the_decode_layouts_only():
    assert layouts(3, 0, "wide") == layouts(3, 4, "off") == [(0,), (0, 0), (0, 0, 0)]


def test_narrow_warms_a_drafted_slot_alone():
    assert layouts(2, 3, "narrow") == [(0,), (0, 0), (3,), (2,), (1,)]
    assert layouts(1, 2, "wide") == [(0,), (2,), (1,)]  # one slot: its pass is its own


@pytest.mark.parametrize("max_slots,max_drafts", [(2, 1), (3, 2), (4, 4), (6, 3), (4, 7)])
def test_wide_layouts_are_every_pass_the_planner_may_make(max_slots, max_drafts):
    got = layouts(max_slots, max_drafts, "wide", limit=10**6)
    assert len(got) == len(set(got))
    assert got[:max_slots] == [(0,) * n for n in range(1, max_slots + 1)]
    assert set(got) == _brute(max_slots, max_drafts)
    assert all(list(s) == sorted(s, reverse=True) for s in got)


def test_four_slots_of_four_drafts_make_114_verify_layouts_uniform_ones_first():
    got = layouts(4, 4, "wide")
    verify = got[4:]
    assert len(verify) == 114 <= MAX_WARM_LAYOUTS
    # the fixed draft lengths' layouts (every drafted slot alike) come before mixed ones
    uniform = [s for s in verify if len({d for d in s if d}) == 1]
    assert verify[:len(uniform)] == uniform
    assert (4, 4, 4) in uniform and (3, 3, 3, 3) in uniform and (4, 4, 4, 4) not in verify
    capped = layouts(8, 4, "wide", limit=50)
    assert len(capped) == 8 + 50 and all(len({d for d in s if d}) == 1 for s in capped[8:20])


def test_a_pass_in_layout_order_has_the_sorted_shape():
    """runner.layout_order puts more drafts first, so any assignment of a layout's drafts to
    slots reaches the graph as the layout's tuple."""
    rng = np.random.default_rng(0)
    for shape in layouts(4, 4, "wide"):
        drafts = list(rng.permutation(shape))
        work = [SlotWork(slot=s, request_id=f"r{s}", kind=WorkKind.DECODE,
                         input_ids=np.zeros(1, np.int32), start_pos=3, num_tokens=1,
                         prompt_len=1, needs_logits=True, sampling=SamplingParams(seed=0),
                         draft_ids=np.zeros(d, np.int32),
                         draft_sources=np.full(d, DraftSource.MTP, np.uint8))
                for s, d in enumerate(drafts)]
        assert tuple(len(w.draft_ids) for w in sorted(work, key=layout_order)) == shape


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
    warmed = set(layouts(4, 4, mode))
    seen = set()
    for plan in worker.plans:
        if not plan.slots or any(w.kind != WorkKind.DECODE for w in plan.slots):
            continue  # passes with prompt rows stay eager
        drafted = [w for w in plan.slots if len(w.draft_ids)]
        groups = ([plan.slots] if plan.wide or not drafted else
                  [[w for w in plan.slots if not len(w.draft_ids)]] + [[w] for w in drafted])
        for group in filter(None, groups):
            shape = tuple(len(w.draft_ids) for w in sorted(group, key=layout_order))
            assert shape in warmed, shape
            seen.add(shape)
    assert any(sum(s) for s in seen) and len(seen) > 4  # verify layouts, several of them


def test_the_worker_config_carries_the_speculation_mode_and_warm_up():
    cfg = WorkerConfig(run_dir="/tmp/x", model="/tmp/m", max_drafts=4,
                       speculation_mode="narrow", graph_warm_up="decode")
    assert WorkerConfig.from_json(cfg.to_json()) == cfg
    for bad in ({"speculation_mode": "fast"}, {"graph_warm_up": "some"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WorkerConfig(run_dir="/tmp/x", model="/tmp/m", **bad)
