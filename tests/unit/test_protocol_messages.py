"""Message invariants: kind bytes and directions, value checks at construction."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.errors import (
    QueueFullError,
    WorkerDiedError,
    error_from_reply,
)
from protocol.messages import (
    CLIENT_TO_DAEMON,
    DAEMON_TO_CLIENT,
    DAEMON_TO_WORKER,
    MESSAGE_TYPES,
    WORKER_TO_DAEMON,
    CacheOp,
    CacheOpKind,
    ErrorCode,
    ErrorReply,
    KvLayout,
    MsgKind,
    Phase,
    PromptPhase,
    SamplingDefaults,
    SamplingParams,
    SlotResult,
    SlotWork,
    StepPlan,
    SubmitRequest,
    WorkKind,
    token_array,
)


def test_every_kind_has_one_type_and_fits_a_byte():
    assert set(MESSAGE_TYPES) == set(MsgKind)
    assert all(0 < k < 256 and MESSAGE_TYPES[k].KIND is k for k in MsgKind)


def test_directions_cover_every_kind_and_only_ping_pong_are_shared():
    worker_link = DAEMON_TO_WORKER | WORKER_TO_DAEMON
    client_link = CLIENT_TO_DAEMON | DAEMON_TO_CLIENT
    assert worker_link | client_link == set(MsgKind)
    assert worker_link & client_link == {MsgKind.PING, MsgKind.PONG}
    assert not DAEMON_TO_WORKER & WORKER_TO_DAEMON
    assert not CLIENT_TO_DAEMON & DAEMON_TO_CLIENT


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -1}, {"min_p": 1.5}, {"seed": -1}, {"seed": 2**63}, {"repetition_penalty": 0.0},
    {"presence_penalty": 2.5}, {"frequency_penalty": float("inf")},
])
def test_sampling_params_reject_out_of_range(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_defaults_are_neutral():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert SamplingParams(temperature=0).is_greedy and not p.is_greedy


def test_submit_needs_exactly_one_prompt_form():
    with pytest.raises(ValueError):
        SubmitRequest(request_id="r")
    with pytest.raises(ValueError):
        SubmitRequest(request_id="r", prompt="a", prompt_ids=token_array([1]))
    with pytest.raises(ValueError):
        SubmitRequest(request_id="", prompt="a")
    with pytest.raises(ValueError):
        SubmitRequest(request_id="r", prompt="a", max_tokens=0)


def test_slot_work_checks_rows_and_drafts():
    ids = token_array([3])
    seeded = SamplingParams(seed=0)
    ok = SlotWork(slot=0, request_id="r", kind=WorkKind.DECODE, input_ids=ids, start_pos=4,
                  num_tokens=1, needs_logits=True, prompt_len=4, sampling=seeded,
                  draft_ids=token_array([7, 8]), draft_sources=np.array([1, 1], np.uint8))
    assert ok.num_rows == 3 and StepPlan(step_id=0, slots=[ok]).num_rows == 3
    with pytest.raises(ValueError):  # num_tokens disagrees with input_ids
        SlotWork(slot=0, request_id="r", kind=WorkKind.DECODE, input_ids=ids, start_pos=4,
                 num_tokens=2, needs_logits=True, prompt_len=4, sampling=seeded)
    with pytest.raises(ValueError):  # drafts in a prefill chunk
        SlotWork(slot=0, request_id="r", kind=WorkKind.PREFILL, input_ids=ids, start_pos=0,
                 num_tokens=1, needs_logits=True, prompt_len=1, draft_ids=token_array([1]),
                 sampling=seeded,
                 draft_sources=np.array([1], np.uint8))
    with pytest.raises(ValueError):  # the same slot twice
        StepPlan(step_id=0, slots=[ok, ok])
    with pytest.raises(ValueError):  # an unresolved seed
        SlotWork(slot=0, request_id="r", kind=WorkKind.DECODE, input_ids=ids, start_pos=4,
                 num_tokens=1, needs_logits=True, prompt_len=4)


def test_cache_ops_need_their_arguments():
    CacheOp(op=CacheOpKind.SHARE_PREFIX, slot=1, num_tokens=64, entry_id=2)
    CacheOp(op=CacheOpKind.DROP_CHECKPOINT, entry_id=3)
    for bad in [dict(op=CacheOpKind.SHARE_PREFIX, slot=1, num_tokens=64),
                dict(op=CacheOpKind.SHARE_PREFIX, slot=1, num_tokens=0, entry_id=2),
                dict(op=CacheOpKind.CHECKPOINT, slot=1),
                dict(op=CacheOpKind.FREE),
                dict(op=CacheOpKind.DROP_CHECKPOINT, slot=1, entry_id=3),
                dict(op=CacheOpKind.ALLOCATE, slot=0, num_tokens=-1)]:
        with pytest.raises(ValueError):
            CacheOp(**bad)


def test_slot_result_checks_acceptance_count():
    prompt = PromptPhase(phase=Phase.DECODE, prompt_tokens_this_step=0, prompt_len=4,
                         cached_len=0)
    with pytest.raises(ValueError):
        SlotResult(slot=0, request_id="r", token_ids=[1], num_accepted=1, prompt=prompt)


def test_token_array_refuses_out_of_range_ids():
    assert token_array([1, 2]).dtype == np.int32
    for bad in ([-1], [2**31], [1.5]):
        with pytest.raises(ValueError):
            token_array(bad)


def test_error_replies_map_to_typed_exceptions():
    err = error_from_reply(ErrorReply(code=ErrorCode.QUEUE_FULL, message="full",
                                      request_id="r", retry_after_s=2.0))
    assert isinstance(err, QueueFullError) and err.retry_after_s == 2.0
    assert err.request_id == "r"
    assert isinstance(error_from_reply(ErrorReply(code=ErrorCode.WORKER_DIED, message="x")),
                      WorkerDiedError)


def test_ready_reports_the_kv_pool_and_sampling_defaults():
    kv = KvLayout(block_size=16, block_bytes=1024, num_blocks=10, prefix_blocks=4,
                  dtype="float32")
    assert kv.capacity_tokens == 160
    with pytest.raises(ValueError):
        KvLayout(block_size=16, block_bytes=1024, num_blocks=10, prefix_blocks=11,
                 dtype="float32")
    assert SamplingDefaults(temperature=0.7, top_k=20).as_dict() == {"temperature": 0.7,
                                                                      "top_k": 20}
    for bad in ({"temperature": "hot"}, {"top_k": 2.5}, {"top_p": True}):
        with pytest.raises(ValueError):
            SamplingDefaults(**bad)
