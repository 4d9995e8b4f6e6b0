"""Codec: round trips of every message type (frame counts, zero-copy arrays) and rejection
of every kind of malformed input with its typed error code."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from protocol.codec import ALLOWED_DTYPES, Limits, decode, encode
from protocol.errors import ProtocolError
from protocol.errors import ProtocolErrorCode as E
from protocol.messages import (
    DAEMON_TO_CLIENT,
    MESSAGE_TYPES,
    CacheOp,
    CacheOpKind,
    CancelRequest,
    ChatMessage,
    DraftSource,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    KvLayout,
    ModelInfo,
    MsgKind,
    Phase,
    Ping,
    Pong,
    PromptPhase,
    ReadyMsg,
    SamplingDefaults,
    SamplingParams,
    Shutdown,
    SlotResult,
    SlotStatus,
    SlotWork,
    StatusReply,
    StatusRequest,
    StepPlan,
    StepResult,
    SubmitRequest,
    TokenEvent,
    Usage,
    WorkerError,
    WorkerErrorCode,
    WorkKind,
)

BIG = 1000  # tokens: 4000 bytes, over the inline threshold -> its own frame


def step_plan() -> StepPlan:
    prefill = SlotWork(slot=0, request_id="a", kind=WorkKind.PREFILL,
                       input_ids=np.arange(BIG, dtype=np.int32), start_pos=64, num_tokens=BIG,
                       needs_logits=False, prompt_len=2000, cached_len=64,
                       sampling=SamplingParams(temperature=0.0, seed=7))
    decode_row = SlotWork(slot=3, request_id="b", kind=WorkKind.DECODE,
                          input_ids=np.array([42], np.int32), start_pos=17, num_tokens=1,
                          needs_logits=True, prompt_len=9,
                          sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=20,
                                                  seed=2**63 - 1, min_p=0.05,
                                                  repetition_penalty=1.1, presence_penalty=0.5,
                                                  frequency_penalty=-0.5),
                          draft_ids=np.array([5, 6], np.int32),
                          draft_sources=np.array([DraftSource.MTP, DraftSource.SUFFIX], np.uint8),
                          route_key=2**63 - 1)  # a synthetic model's routing key, the largest
    return StepPlan(step_id=11, slots=[prefill, decode_row],
                    cache_ops=[CacheOp(op=CacheOpKind.ALLOCATE, slot=0, num_tokens=2048),
                               CacheOp(op=CacheOpKind.SHARE_PREFIX, slot=0, num_tokens=64,
                                       entry_id=9),
                               CacheOp(op=CacheOpKind.SWAP_IN, slot=1, entry_id=8)],
                    cache_ops_after=[CacheOp(op=CacheOpKind.CHECKPOINT, slot=3, entry_id=10,
                                             num_tokens=20),
                                     CacheOp(op=CacheOpKind.DROP_CHECKPOINT, entry_id=2)])


# (message, expected frame count)
SAMPLES = [
    (step_plan(), 3),
    (StepPlan(step_id=0), 2),
    (StepResult(step_id=11, slots=[
        SlotResult(slot=0, request_id="a", token_ids=[], num_accepted=0,
                   prompt=PromptPhase(phase=Phase.PREFILL, prompt_tokens_this_step=BIG,
                                      prompt_len=2000, cached_len=64)),
        SlotResult(slot=3, request_id="b", token_ids=[5, 6, 8], num_accepted=2,
                   prompt=PromptPhase(phase=Phase.DECODE, prompt_tokens_this_step=0,
                                      prompt_len=9, cached_len=0))],
        timings_ms={"forward": 12.5, "cpu_experts": 3.0}, counters={"rows": 1003}), 2),
    (ReadyMsg(protocol_version=1, pid=1234, host_cores=[0, 1],
              model=ModelInfo(name="tiny", vocab_size=512, max_slots=4, max_context=4096,
                              eos_token_ids=[1, 2],
                              generation_defaults=SamplingDefaults(temperature=0.7, top_k=20),
                              kv=KvLayout(block_size=64, block_bytes=4096, num_blocks=128,
                                          prefix_blocks=64, dtype="int8"),
                              synthetic_routing=True, padded_passes=True)), 2),
    (WorkerError(code=WorkerErrorCode.BAD_PLAN, message="unknown entry 3", step_id=3), 2),
    (Heartbeat(seq=5, time_ns=123456789), 2),
    (Shutdown(reason="SIGTERM"), 2),
    (Ping(nonce=1, time_ns=2), 2),
    (Pong(nonce=1, time_ns=2), 2),
    (SubmitRequest(request_id="r1", prompt="Hello there", max_tokens=16, stop=["\n"],
                   priority=2, include_usage=True, user="agent-0"), 2),
    (SubmitRequest(request_id="r2", prompt_ids=np.arange(5000, dtype=np.int32)), 3),
    (SubmitRequest(request_id="r3", messages=[ChatMessage(role="system", content="Be brief."),
                                              ChatMessage(role="user", content="Hi")],
                   sampling=SamplingParams(temperature=0.0), stream=False), 2),
    (TokenEvent(request_id="r1", index=0, token_ids=[72], text="H"), 2),
    (TokenEvent(request_id="r1", index=4, token_ids=[], text="", finish_reason="length",
                usage=Usage(prompt_tokens=11, completion_tokens=16, cached_tokens=4)), 2),
    (CancelRequest(request_id="r1"), 2),
    (StatusRequest(query_id="q"), 2),
    (StatusReply(query_id="q", model="tiny", protocol_version=1, max_slots=2, queue_depth=3,
                 slots=[SlotStatus(slot=0, request_id="r1", phase=Phase.DECODE, prompt_done=11,
                                   prompt_len=11, num_generated=4),
                        SlotStatus(slot=1, request_id=None, phase=None, prompt_done=0,
                                   prompt_len=0, num_generated=0)]), 2),
    (ErrorReply(code=ErrorCode.QUEUE_FULL, message="queue full", request_id="r9",
                retry_after_s=1.5), 2),
]


def assert_same(a, b, path="msg"):
    """Deep equality over dataclasses, lists, dicts and arrays (dtype and shape included)."""
    assert type(a) is type(b), path
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k}]")
    else:
        assert a == b, path


def test_samples_cover_every_message_type():
    assert {type(m) for m, _ in SAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg,n_frames", SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg, n_frames):
    frames = encode(msg)
    assert len(frames) == n_frames
    assert bytes(frames[0]) == bytes([msg.KIND])
    # As received from a socket: plain bytes, not the sender's views.
    out = decode([bytes(f) for f in frames])
    assert_same(msg, out)


def test_arrays_travel_out_of_band_without_copies():
    plan = step_plan()
    frames = encode(plan)
    # Sender side: the frame is a view of the message's array.
    assert np.shares_memory(np.frombuffer(frames[2], np.int32), plan.slots[0].input_ids)
    wire = [bytes(f) for f in frames]
    out = decode(wire)
    ids = out.slots[0].input_ids
    assert np.shares_memory(ids, np.frombuffer(wire[2], np.uint8))  # receiver side: a view
    assert not ids.flags.writeable
    with pytest.raises(ValueError):
        ids[0] = 1
    # Small arrays rode inside the body.
    assert out.slots[1].draft_ids.tolist() == [5, 6]
    assert out.slots[1].draft_sources.dtype == np.uint8


def test_non_contiguous_and_2d_arrays_and_numpy_scalars():
    ids = np.arange(2 * BIG, dtype=np.int32)[::2]  # non-contiguous: encoded as a copy
    msg = SubmitRequest(request_id="x", prompt_ids=ids, max_tokens=np.int64(5),
                        sampling=SamplingParams(temperature=np.float32(0.5)))
    out = decode(encode(msg))
    assert out.prompt_ids.tolist() == ids.tolist() and out.max_tokens == 5
    assert type(out.max_tokens) is int and out.sampling.temperature == 0.5


# ---------------------------------------------------------------- malformed input


def body_of(frames):
    return msgpack.unpackb(frames[1], raw=False)  # ext values stay msgpack.ExtType


def with_body(frames, body):
    return [frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]]


def array_header(ext):
    return msgpack.unpackb(ext.data, raw=False)


def set_array_header(ext, header):
    return msgpack.ExtType(ext.code, msgpack.packb(header, use_bin_type=True))


def expect(code, frames, **kwargs):
    with pytest.raises(ProtocolError) as info:
        decode(frames, **kwargs)
    assert info.value.code == code, info.value
    return info.value


@pytest.fixture
def plan_frames():
    return [bytes(f) for f in encode(step_plan())]


def test_rejects_frame_level_garbage(plan_frames):
    expect(E.UNKNOWN_KIND, [b"\xff", *plan_frames[1:]])
    expect(E.UNKNOWN_KIND, [b"\x00", plan_frames[1]])
    expect(E.MALFORMED, [b"\x10\x00", *plan_frames[1:]])
    expect(E.MALFORMED, plan_frames[:1])
    expect(E.MALFORMED, [])
    expect(E.MALFORMED, [plan_frames[0], plan_frames[1][:-3], plan_frames[2]])  # truncated
    expect(E.MALFORMED, [plan_frames[0], b"\xc1 not msgpack at all"])
    expect(E.MALFORMED, [plan_frames[0], msgpack.packb([1, 2, 3])])  # not a map
    expect(E.MALFORMED, [plan_frames[0], b"\xa3ab"])  # truncated str
    expect(E.MALFORMED, [plan_frames[0], msgpack.packb({"step_id": msgpack.ExtType(42, b"")})])


def test_rejects_bad_fields(plan_frames):
    body = body_of(plan_frames)
    err = expect(E.UNKNOWN_FIELD, with_body(plan_frames, {**body, "bogus": 1}))
    assert "bogus" in err.message
    nested = body_of(plan_frames)
    nested["slots"][1]["sampling"]["typical_p"] = 0.5
    err = expect(E.UNKNOWN_FIELD, with_body(plan_frames, nested))
    assert "StepPlan.slots[1].sampling" in err.message
    missing = body_of(plan_frames)
    del missing["step_id"]
    expect(E.MISSING_FIELD, with_body(plan_frames, missing))
    missing = body_of(plan_frames)
    del missing["slots"][0]["sampling"]["top_p"]
    err = expect(E.MISSING_FIELD, with_body(plan_frames, missing))
    assert "top_p" in err.message


@pytest.mark.parametrize("mutate", [
    lambda b: b.update(step_id="11"),
    lambda b: b.update(step_id=True),  # bool is not an int here
    lambda b: b.update(step_id=1.5),
    lambda b: b.update(slots={"0": 1}),
    lambda b: b["slots"][0].update(request_id=7),
    lambda b: b["slots"][0].update(needs_logits=1),
    lambda b: b["slots"][0].update(sampling=[0.5]),
    lambda b: b["slots"][0].update(input_ids=[1, 2, 3]),  # list where an array is due
    lambda b: b["slots"][0].update(start_pos=b["slots"][1]["draft_ids"]),  # array for an int
    lambda b: b["cache_ops"][0].update(slot="0"),
    lambda b: b["slots"][1].update(route_key="agent-0"),  # the daemon sends the hash
    lambda b: b["slots"][1].update(route_key=True),
], ids=range(12))
def test_rejects_wrong_types(plan_frames, mutate):
    body = body_of(plan_frames)
    mutate(body)
    expect(E.WRONG_TYPE, with_body(plan_frames, body))


def test_rejects_bad_values(plan_frames):
    body = body_of(plan_frames)
    body["slots"][0]["kind"] = 99  # no such WorkKind
    expect(E.BAD_VALUE, with_body(plan_frames, body))
    body = body_of(plan_frames)
    body["slots"][0]["num_tokens"] = 3  # != len(input_ids)
    expect(E.BAD_VALUE, with_body(plan_frames, body))
    body = body_of(plan_frames)
    body["slots"][1]["sampling"]["top_p"] = 0.0
    expect(E.BAD_VALUE, with_body(plan_frames, body))
    for key in (2**63, -1):  # a routing key is in 0..2**63-1 (the device's int64)
        body = body_of(plan_frames)
        body["slots"][1]["route_key"] = key
        assert "route_key" in expect(E.BAD_VALUE, with_body(plan_frames, body)).message
    frames = [bytes(f) for f in encode(TokenEvent(request_id="r", index=0, token_ids=[],
                                                  text=""))]
    body = body_of(frames)
    body["finish_reason"] = "exploded"
    expect(E.BAD_VALUE, with_body(frames, body))


def test_rejects_oversized_input(plan_frames):
    expect(E.TOO_LARGE, plan_frames, limits=Limits(max_frame_bytes=BIG * 4 - 1))
    expect(E.TOO_LARGE, plan_frames, limits=Limits(max_body_bytes=len(plan_frames[1]) - 1))
    expect(E.TOO_LARGE, plan_frames, limits=Limits(max_total_bytes=4000))
    expect(E.TOO_MANY_FRAMES, plan_frames, limits=Limits(max_frames=2))
    assert decode(plan_frames, limits=Limits(max_frame_bytes=BIG * 4, max_frames=3))


def mutate_input_ids(frames, fn):
    body = body_of(frames)
    ext = body["slots"][0]["input_ids"]
    body["slots"][0]["input_ids"] = set_array_header(ext, fn(array_header(ext)))
    return with_body(frames, body)


def test_rejects_bad_arrays(plan_frames):
    assert array_header(body_of(plan_frames)["slots"][0]["input_ids"]) == ["<i4", [BIG], 2]
    assert "|O" not in ALLOWED_DTYPES
    expect(E.BAD_DTYPE, mutate_input_ids(plan_frames, lambda h: ["|O", [BIG], 2]))
    expect(E.BAD_DTYPE, mutate_input_ids(plan_frames, lambda h: ["<c8", [BIG // 2], 2]))
    expect(E.BAD_DTYPE, mutate_input_ids(plan_frames, lambda h: [">i4", [BIG], 2]))
    # An allowed dtype, but not the field's (input_ids is int32), same byte count.
    expect(E.BAD_DTYPE, mutate_input_ids(plan_frames, lambda h: ["<i8", [BIG // 2], 2]))
    expect(E.BAD_SHAPE, mutate_input_ids(plan_frames, lambda h: ["<i4", [BIG - 1], 2]))
    expect(E.BAD_SHAPE, mutate_input_ids(plan_frames, lambda h: ["<i4", [10, 100], 2]))
    expect(E.BAD_SHAPE, mutate_input_ids(plan_frames, lambda h: ["<i4", [-BIG], 2]))
    expect(E.BAD_SHAPE, mutate_input_ids(plan_frames, lambda h: ["<i4", "1000", 2]))
    expect(E.BAD_FRAME_REF, mutate_input_ids(plan_frames, lambda h: ["<i4", [BIG], 3]))
    expect(E.BAD_FRAME_REF, mutate_input_ids(plan_frames, lambda h: ["<i4", [BIG], 1]))
    expect(E.BAD_FRAME_REF, [*plan_frames, b"\x00" * 8])  # a frame nobody references
    expect(E.MALFORMED, mutate_input_ids(plan_frames, lambda h: ["<i4", [BIG]]))


def test_rejects_kinds_not_allowed_on_the_socket(plan_frames):
    err = expect(E.UNEXPECTED_KIND, plan_frames, allowed=DAEMON_TO_CLIENT)
    assert "StepPlan" in err.message
    assert decode(plan_frames, allowed={MsgKind.STEP_PLAN})


def test_encode_refuses_what_the_receiver_would_reject():
    with pytest.raises(ProtocolError) as info:
        encode(ChatMessage(role="user", content="not a top-level message"))
    assert info.value.code == E.UNKNOWN_KIND
    plan = step_plan()
    plan.slots[0].input_ids = np.arange(BIG, dtype=np.int64)
    with pytest.raises(ProtocolError) as info:
        encode(plan)
    assert info.value.code == E.BAD_DTYPE
    with pytest.raises(ProtocolError) as info:
        encode(StepPlan(step_id="7"))
    assert info.value.code == E.WRONG_TYPE
