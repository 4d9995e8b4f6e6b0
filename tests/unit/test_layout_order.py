"""The CUDA-graph key of a pass (step_graph.layout_key) and the order of its slots
(gpu_worker/runner.layout_order): passes with the same rows, slots and drafts in all share one
graph however the rows split among the slots or which slot has which; any other count is
another graph. That the order changes no token is what the speculation tests check
(tests/unit/test_speculation.py: every pass of theirs goes through it, against plain
decoding); that a graph replays another split's pass with eager's bits is
tests/gpu/test_step_graph_cupy.py."""

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
    work = sorted(work, key=layout_order)
    batch = RaggedBatch.build([(w.slot, w.start_pos, np.concatenate(
        [w.input_ids, w.draft_ids]).astype(np.int64)) for w in work])
    rows, first = logit_rows(work, batch)
    return layout_key(work, batch, rows, first)


def test_passes_of_the_same_rows_and_slots_share_one_graph() -> None:
    keys = set()
    for shapes in ([3, 0, 1, 3], [2, 2, 2, 1], [0, 0, 0, 7], [4, 3, 0, 0]):
        for perm in itertools.permutations(shapes):
            keys.add(_key([_work(slot, d) for slot, d in enumerate(perm)]))
    assert len(keys) == 1
    others = {_key([_work(s, d) for s, d in enumerate(shapes)])
              for shapes in ([3, 0, 1, 2], [3, 0, 1], [3, 0, 1, 3, 0], [0, 0, 0, 0])}
    assert len(others) == 4 and not others & keys


def test_a_slot_that_needs_no_logits_is_its_own_shape() -> None:
    a = [_work(0, 0, needs_logits=False), _work(1, 0)]
    b = [_work(0, 0), _work(1, 0, needs_logits=False)]
    ka, kb = _key(a), _key(b)
    assert ka == kb and ka[-1] == (True, False)
