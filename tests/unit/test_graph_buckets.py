"""Capacity buckets of the CUDA graphs (gpu_worker/graph_buckets.py): which passes are padded
and how, the keys that make one graph serve a bucket, the layouts warmed for them, the
memory they take, and the padding rows' routed experts (none)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gpu_worker import graph_buckets as gb
from gpu_worker.engine import Engine
from gpu_worker.experts.counters import ExpertCounters
from gpu_worker.graph_warm import layouts, one_per_bucket
from gpu_worker.kv_cache import BlockAllocator
from gpu_worker.memory_parts import GRAPH_POOL_RESERVE
from gpu_worker.memory_plan import plan_memory
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.moe import sparse_moe
from gpu_worker.model_config import ModelConfig
from gpu_worker.runner import layout_order, logit_rows
from gpu_worker.step_graph import pass_key
from protocol.worker_config import GIB, padded_rows
from scripts.tiny_model import make_tiny_model
from tests.unit.test_graph_warm import _work
from tests.unit.test_memory_plan import QWEN3_NEXT_80B


def _pass(drafts) -> tuple:
    work = sorted(_work(drafts), key=layout_order)
    batch = RaggedBatch.build([(w.slot, w.start_pos, np.concatenate(
        [w.input_ids, w.draft_ids]).astype(np.int64)) for w in work])
    rows, first = logit_rows(work, batch)
    return work, batch, np.asarray(rows, np.int64), first


def test_a_pass_takes_the_smallest_bucket_that_holds_its_rows():
    assert [gb.bucket(r) for r in range(1, 18)] == [1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                                     16, 16, 16, 16, None]
    assert gb.MAX_PAD == 3  # 5 rows -> 8, 9 -> 12, 13 -> 16
    # the rows a pass runs with (the worker pads by it, the daemon's budget prices by it):
    # one rule for an int and for an array, no rows and rows past the buckets as they are
    rows = np.arange(0, 21)
    want = [r if r == 0 or gb.bucket(r) is None else gb.bucket(r) for r in rows]
    assert padded_rows(rows).tolist() == want == [padded_rows(int(r)) for r in rows]
    assert padded_rows(rows, ()).tolist() == rows.tolist()
    assert padded_rows(rows.reshape(3, 7)).tolist() == np.reshape(want, (3, 7)).tolist()
    assert isinstance(padded_rows(3), int)


def test_padding_adds_rows_on_the_scratch_slot_after_the_passes_own():
    _, batch, rows, _ = _pass((2, 0, 1))  # 6 rows -> 8
    assert gb.padding(batch, rows) == 2
    padded, prow, live = gb.pad(batch, rows, 9, 2)
    assert padded.num_rows == 8 and padded.segments[:3] == batch.segments
    seg = padded.segments[3]
    assert (seg.slot, seg.start, seg.num, seg.row0, seg.route_key) == (9, 0, 2, 6, 9)
    assert list(padded.tokens[6:]) == [0, 0] and list(padded.positions[6:]) == [0, 1]
    assert np.array_equal(padded.tokens[:6], batch.tokens)
    assert list(prow) == list(range(8)) and list(live) == [True] * 6 + [False] * 2
    host = {"drafts": np.array([4, 5, 6, 0], np.int32)}
    gb.pad_drafts(host, 8)
    assert list(host["drafts"]) == [4, 5, 6, 0, 0, 0, 0, 0, 0]


def test_passes_at_a_bucket_or_past_the_last_or_with_unsampled_rows_are_not_padded():
    for drafts in ((1, 1), (3, 3, 3, 3), (4, 4, 4, 4, 0)):  # 4, 16 and 21 rows
        _, batch, rows, _ = _pass(drafts)
        assert gb.padding(batch, rows) == 0, drafts
    _, batch, rows, _ = _pass((1, 1, 1))
    assert gb.padding(batch, rows[:-1]) == 0  # a row that is no logits row


def test_every_split_of_a_buckets_rows_has_the_warmed_passes_key():
    """Any assignment of drafts to 1-4 slots the planner may make has, with buckets, the key
    of the warmed pass of the same graph (so the graph captured at start-up replays it), and
    the warmed passes' keys are all different."""
    warmed = {}
    for s in one_per_bucket(layouts(4, 4, "wide")):
        key = gb.shape_key(len(s) + sum(s), len(s))
        assert key not in warmed
        warmed[key] = pass_key(*_pass(s), buckets=True)
    assert len(warmed) == 25  # against 40 graphs of one rows and slots each
    for n in range(1, 5):
        for drafts in itertools.product(range(5), repeat=n):
            rows = n + sum(drafts)
            if rows <= 16 and sum(1 for d in drafts if d) <= 4:
                key = pass_key(*_pass(drafts), buckets=True)
                assert key == warmed[gb.shape_key(rows, n)], drafts
                assert (key[0] == "bucket") == (gb.bucket(rows) != rows)


def test_the_scratch_blocks_are_the_highest_so_the_others_go_as_without_them():
    a, b = BlockAllocator(8), BlockAllocator(7)
    assert a.allocate(1, last=True) == [7]
    assert a.allocate(3) == b.allocate(3) == [0, 1, 2]


def test_the_memory_plan_counts_the_scratch_slot_and_the_bucket_rows():
    cfg = ModelConfig.from_dict(QWEN3_NEXT_80B)
    kw = dict(gpu_budget_bytes=32 * GIB, max_drafts=4, host_available_bytes=None,
              cuda_graphs=True, max_slots=3, kv_block_size=64)
    exact = dict(plan_memory(cfg, **kw).work_parts)["CUDA graphs"]
    plan = plan_memory(cfg, graph_buckets=True, **kw)
    buckets = dict(plan.work_parts)["CUDA graphs"]
    row = (cfg.vocab_size + cfg.hidden_size) * 4
    assert exact == GRAPH_POOL_RESERVE + 15 * row  # 3 slots of 5 rows
    assert buckets == GRAPH_POOL_RESERVE + 16 * row + plan.kv_block_bytes


def test_a_padded_pass_tracks_no_slot_on_its_padding_rows():
    c = ExpertCounters(1.0)
    c.track_rows(np.array([0, 0, 2], np.int64))
    c.pad_rows(4)
    ids = np.array([[1, 2], [3, 1], [2, 5], [-1, -1]], np.int32)
    c.add_routes(0, 8, ids, np.ones((4, 2), bool))
    got = c.take_slot_experts()
    assert sorted(got) == [0, 2] and list(got[0][0]) == [1, 2, 3] and list(got[2][0]) == [2, 5]


@pytest.fixture(scope="module")
def moe_layer(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=3, tokenizer=False)
    model = Engine.from_dir(path, dtype="float64", max_slots=2, max_len=64).model
    return model, next(layer for layer in model.layers if layer.sparse)


def test_padding_rows_pick_no_routed_expert(moe_layer):
    """``live`` False: the row's MoE output is the shared expert's alone (no routed expert's
    term), and the live rows' outputs are those of the block without the padding."""
    model, layer = moe_layer
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, model.cfg.hidden_size))
    live = np.array([True, True, True, False, False])
    out = sparse_moe(model.ops, model.cfg, layer.mlp, x, None, layer.index, live=live)
    alone = sparse_moe(model.ops, model.cfg, layer.mlp, x[:3], None, layer.index)
    assert np.array_equal(out[:3], alone)
    p = dict(layer.mlp)
    for name in ("experts.down_proj",):  # routed experts off: the shared part alone
        p[name] = np.zeros_like(p[name])
    shared = sparse_moe(model.ops, model.cfg, p, x, None, layer.index)
    assert np.array_equal(out[3:], shared[3:]) and not np.array_equal(out[:3], shared[:3])


def test_a_slot_past_the_states_starts_from_zero_and_keeps_nothing(moe_layer):
    """The token loop (NumPy, and CuPy without the GDN kernels) treats the scratch slot as
    the kernels do (table slot -1): a zero conv window and state, nothing stored; its rows
    give what a fresh slot's give and the other slots' states are untouched."""
    model = moe_layer[0]
    logits = []
    for scratch in (2, 1):  # past the 2 slots' states; a fresh slot of them
        caches = model.new_caches(2, 64, 4, extra_blocks=4)
        batch = RaggedBatch.build([(0, 0, [5, 6, 7]), (scratch, 0, [0, 0])])
        out = model.forward(batch, caches, np.arange(5))
        logits.append(out.logits)
        assert caches.states.has_state(scratch) == (scratch == 1)
        if scratch == 2:
            kept = [a[:, 1].copy() for a in (caches.states.conv, caches.states.rec)]
        else:
            fresh = model.new_caches(2, 64, 4, extra_blocks=4).states
            assert not any(np.array_equal(a[:, 1], b[:, 1]) for a, b in
                           zip((caches.states.conv, caches.states.rec),
                               (fresh.conv, fresh.rec), strict=True))
    assert all(not a.any() for a in kept)  # slot 1 untouched by the scratch rows
    assert np.array_equal(logits[0], logits[1])
