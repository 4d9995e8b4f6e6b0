"""The order of a pass's slots (gpu_worker/runner.layout_order): a pass's CUDA-graph layout
(step_graph.layout_key) depends on the shapes of its slots, not on which slot has which, so
verify passes whose slots swap draft lengths replay one graph. That the order changes no
token is what the speculation tests check (tests/unit/test_speculation.py: every pass of
theirs goes through it, against plain decoding)."""

import itertools

import numpy as np

from gpu_worker.model.batch import RaggedBatch
from gpu_worker.runner import layout_order, logit_rows
from gpu_worker.step_graph import layout_key
from protocol.messages import SamplingParams, SlotWork, WorkKind


def _work(slot: int, drafts: int, needs_logits: bool = True) -> SlotWork:
    return SlotWork(slot=slot, request_id=f"r{slot}", kind=WorkKind.DECODE,
                    input_ids=np.array([5 + slot], np.int32), start_pos=10 + slot,
                    num_tokens=1, needs_logits=needs_logits,
                    sampling=SamplingParams(seed=slot),
                    draft_ids=np.arange(drafts, dtype=np.int32) + 7,
                    draft_sources=np.zeros(drafts, np.uint8), prompt_len=4)


def _key(work: list[SlotWork]) -> tuple:
    batch = RaggedBatch.build([(w.slot, w.start_pos, np.concatenate(
        [w.input_ids, w.draft_ids]).astype(np.int64)) for w in work])
    rows, first = logit_rows(work, batch)
    return layout_key(work, batch, rows, first)


def test_slots_that_swap_shapes_share_one_layout() -> None:
    shapes = [3, 0, 1, 3]  # drafts per slot
    unsorted, ordered = set(), set()
    for perm in itertools.permutations(range(4)):
        work = [_work(slot, shapes[i]) for slot, i in enumerate(perm)]
        unsorted.add(_key(work))
        ordered.add(_key(sorted(work, key=layout_order)))
    assert len(unsorted) == 12 and len(ordered) == 1


def test_a_slot_that_needs_no_logits_is_its_own_shape() -> None:
    a = [_work(0, 0, needs_logits=False), _work(1, 0)]
    b = [_work(0, 0), _work(1, 0, needs_logits=False)]
    ka, kb = (_key(sorted(w, key=layout_order)) for w in (a, b))
    assert ka == kb and ka[3] == (True, False)
