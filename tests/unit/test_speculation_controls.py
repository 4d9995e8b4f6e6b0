"""Scheduling controls of speculation (issue 15 item 5): the per-request opt-out (HTTP body
field and SubmitRequest field), the cap on drafts per step and the preference between
admitting prompts and verifying drafts; validated, and the tokens those of plain decoding."""

from __future__ import annotations

import types

import msgpack
import pytest

from daemon.api_zmq import ZmqApi
from daemon.config import ConfigError, SpeculationSection, load_config
from daemon.openai_schema import ApiError, parse_chat, parse_completion
from gpu_worker.engine import Engine
from protocol import codec
from protocol.client import build_submit
from protocol.errors import ProtocolError
from protocol.messages import WorkKind
from scripts.tiny_model import make_tiny_model
from tests.unit.api_test_client import COMPLETIONS, _error
from tests.unit.api_test_client import client as client  # noqa: F401 (fixture)
from tests.unit.api_test_client import tokenizer as tokenizer  # noqa: F401 (fixture)
from tests.unit.spec_serve import drafted, oracle, serve

PROMPTS = [[5, 6, 7, 8] * 4, list(range(20, 36)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3],
           list(range(60, 72))]


# ---- validation ----------------------------------------------------------------------------------
def test_config_keys_are_validated():
    spec = load_config(None).speculation
    assert (spec.prefer, spec.max_drafts_per_step, spec.global_index_tokens) == \
        ("drafts", 0, 65536)
    for bad, message in (({"prefer": "latency"}, "speculation.prefer: must be one of"),
                         ({"max_drafts_per_step": -1}, "speculation.max_drafts_per_step: must "
                          "be >= 0"),
                         ({"max_drafts_per_step": 65}, "must be <= 64"),
                         ({"max_drafts_per_step": True}, "must be an integer"),
                         ({"global_index_tokens": -5}, "speculation.global_index_tokens")):
        with pytest.raises(ConfigError, match=message):
            SpeculationSection(mode="wide", **bad)
    got = load_config(None, {"speculation.prefer": "admission",
                             "speculation.max_drafts_per_step": 6}).speculation
    assert (got.prefer, got.max_drafts_per_step) == ("admission", 6)


def test_http_field_speculation_is_a_boolean():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(chat).speculation is True
    assert parse_chat({**chat, "speculation": None}).speculation is True
    assert parse_chat({**chat, "speculation": False}).speculation is False
    assert parse_completion({"prompt": "x", "speculation": True}).speculation is True
    for value in ("false", 0, 1, []):
        with pytest.raises(ApiError) as info:
            parse_completion({"prompt": "x", "speculation": value})
        assert info.value.param == "speculation" and info.value.status == 400


async def test_http_refuses_a_bad_speculation_field(client):  # noqa: F811
    resp = await client.post(COMPLETIONS, json={"prompt": "Hi", "speculation": "no"})
    assert (await _error(resp, 400))["param"] == "speculation"
    resp = await client.post(COMPLETIONS, json={"prompt": "Hi", "speculation": False})
    assert resp.status == 503  # valid: no scheduler behind this test server


def test_zmq_field_speculation_travels_and_is_typed():
    msg = build_submit(prompt_ids=[1, 2, 3], speculation=False, request_id="a")
    frames = codec.encode(msg)
    assert codec.decode(frames).speculation is False
    assert codec.decode(codec.encode(build_submit(prompt_ids=[1], request_id="b"))).speculation
    body = msgpack.unpackb(frames[1], raw=False)
    body["speculation"] = 0  # not a bool
    with pytest.raises(ProtocolError, match="speculation"):
        codec.decode([frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]])
    api = ZmqApi.__new__(ZmqApi)  # only its request conversion
    api.config = types.SimpleNamespace(max_prompt_tokens=1000, max_tokens=1000)
    api.vocab_size, api.defaults, api.tokenizer = 50, {}, None
    assert api._request(b"peer", msg).speculation is False


# ---- through the scheduler and the Runner ---------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=7,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="float64", max_slots=4, max_len=256).model


@pytest.mark.parametrize("proposer", ["suffix", "mtp"])
def test_an_opted_out_request_gets_no_drafts_and_the_same_tokens(model, proposer):
    assert model.mtp is not None
    plain, _, _ = serve(model, PROMPTS, n=30)
    got, worker, _ = serve(model, PROMPTS, n=30, mode="wide", min_match=1, proposer=proposer,
                           speculation=[True, False, True, False])
    assert got == plain
    by_request, asked = {}, {}
    for p in worker.plans:
        for w in p.slots:
            by_request[w.request_id] = by_request.get(w.request_id, 0) + len(w.draft_ids)
            asked[w.request_id] = max(asked.get(w.request_id, 0), w.mtp_drafts)
    assert by_request["r1"] == by_request["r3"] == 0 < by_request["r0"]
    assert asked["r1"] == asked["r3"] == 0  # nor does the worker's MTP head draft for them


@pytest.mark.parametrize("mode", ["wide", "narrow"])
def test_the_step_cap_bounds_drafts_fairly(model, mode):
    plain, _, _ = serve(model, PROMPTS, n=30)
    got, worker, _ = serve(model, PROMPTS, n=30, mode=mode, max_drafts_per_step=5,
                           drafts=oracle(plain, model.cfg.vocab_size, lambda seq: 4))
    assert got == plain
    full = [drafted(p) for p in worker.plans if len(p.slots) == 4
            and all(w.kind == WorkKind.DECODE for w in p.slots)]
    assert full and all(sum(c) <= 5 for c in drafted_all(worker))
    assert [2, 1, 1, 1] in full  # 4 x 4 drafts wanted: one at a time off the longest


def drafted_all(worker) -> list[list[int]]:
    return [drafted(p) for p in worker.plans]


@pytest.mark.parametrize("prefer", ["admission", "drafts"])
def test_prefer_decides_whether_a_step_with_a_prompt_chunk_verifies(model, prefer):
    """Two slots, four requests: later prompts are admitted while the others decode with
    drafts; "admission" keeps those steps plain."""
    n = [24, 10, 18, 12]
    plain, _, _ = serve(model, PROMPTS, n=n, slots=2)
    got, worker, _ = serve(model, PROMPTS, n=n, slots=2, mode="wide", prefer=prefer,
                           drafts=oracle(plain, model.cfg.vocab_size, lambda seq: 3))
    assert got == plain
    mixed = [p for p in worker.plans if any(w.kind == WorkKind.PREFILL for w in p.slots)
             and any(w.kind == WorkKind.DECODE for w in p.slots)]
    assert mixed
    with_drafts = [p for p in mixed if any(drafted(p))]
    assert bool(with_drafts) == (prefer == "drafts")
    assert any(any(drafted(p)) for p in worker.plans)  # decode-only steps verify either way
