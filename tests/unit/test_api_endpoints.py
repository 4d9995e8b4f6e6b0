"""The HTTP API's auth, informational endpoints, internal errors and logs, and the tool-call
parsing of its output (the shared server: api_test_client.py)."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from daemon.api_http import make_app
from daemon.config import DEFAULT_MODEL, load_config
from daemon.logs import configure_logging, get_logger
from daemon.metrics import Metrics
from daemon.openai_tools import ToolCallStream, parse_tool_calls
from tests.unit import api_test_client
from tests.unit.api_test_client import (
    CHAT,
    COMPLETIONS,
    KEY,
    _chat,
    _client,
    _error,
)

# the shared fixtures (bound here, pytest finds them by module attribute)
client, keyed, tokenizer = api_test_client.client, api_test_client.keyed, api_test_client.tokenizer


# ---- auth ---------------------------------------------------------------------------------------
async def test_missing_and_wrong_keys_are_401(keyed):
    for headers in ({}, {"Authorization": "Bearer nope-nope-nope"},
                    {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        resp = await keyed.post(CHAT, json=_chat(), headers=headers)
        err = await _error(resp, 401)
        assert err["code"] == "invalid_api_key"
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    for path in ("/v1/models", "/metrics", "/v1/slots"):
        assert (await keyed.get(path)).status == 401


async def test_good_keys_pass_and_health_stays_open(keyed):
    for key in (KEY, "another-key-42"):
        resp = await keyed.post(CHAT, json=_chat(), headers={"Authorization": f"Bearer {key}"})
        assert resp.status == 503  # past auth and validation
    resp = await keyed.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status == 200
    assert (await keyed.get("/health")).status == 200
    assert (await keyed.get("/ready")).status == 503


# ---- other endpoints ---------------------------------------------------------------------------
async def test_health_ready_models_slots(client):
    assert await (await client.get("/health")).json() == {"status": "ok"}
    ready = await client.get("/ready")
    assert ready.status == 503 and (await ready.json())["status"] == "starting"
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tandem-tiny"
    assert models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == 256
    err = await _error(await client.get("/v1/slots"), 503)
    assert err["code"] == "engine_unavailable"


async def test_unknown_route_and_method_in_openai_shape(client):
    err = await _error(await client.get("/v1/embeddings"), 404)
    assert err["code"] == "not_found"
    resp = await client.get(CHAT)
    await _error(resp, 405)
    assert "POST" in resp.headers["Allow"]


async def test_metrics_count_requests_and_rejections(client):
    await client.post(CHAT, json=_chat(n=3))
    await client.post(CHAT, json=_chat(model="nope"))
    await client.post(COMPLETIONS, json={"prompt": "hi"})
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert 'tandem_requests_received_total{endpoint="chat_completions"} 2.0' in text
    assert 'tandem_requests_received_total{endpoint="completions"} 1.0' in text
    assert 'tandem_requests_rejected_total{reason="invalid_request"} 1.0' in text
    assert 'tandem_requests_rejected_total{reason="model_not_found"} 1.0' in text
    assert 'tandem_requests_rejected_total{reason="unavailable"} 1.0' in text


async def test_request_ids_are_unique(client):
    ids = set()
    for _ in range(3):
        resp = await client.post(CHAT, json=_chat(n=2))
        ids.add(resp.headers["X-Request-Id"])
    assert len(ids) == 3
    assert all(i.startswith("chatcmpl-") and len(i) == len("chatcmpl-") + 32 for i in ids)


async def test_server_keeps_serving_after_bad_input(client):
    await client.post(CHAT, data=b"\xff\xfe", headers={"Content-Type": "application/json"})
    await client.post(CHAT, data=json.dumps(_chat()).encode() * 2)
    assert (await client.get("/health")).status == 200


# ---- internal errors and logs --------------------------------------------------------------------
@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


async def test_internal_error_is_a_generic_500_logged_with_the_request_id(tokenizer,
                                                                         restore_logging):
    stream = io.StringIO()
    configure_logging("info", True, stream=stream)
    config = load_config(None, {"model.path": DEFAULT_MODEL})
    # a broken generation_config.json default reaches SamplingParams: a server-side fault
    app = make_app(None, tokenizer, config, Metrics(), generation_defaults={"temperature": "hot"})
    async with TestClient(TestServer(app)) as c:
        resp = await c.post(CHAT, json=_chat())
        err = await _error(resp, 500)
    rid = resp.headers["X-Request-Id"]
    assert err["type"] == "server_error" and rid in err["message"]
    assert "hot" not in err["message"] and "Traceback" not in err["message"]
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    logged = [x for x in lines if x["event"] == "internal_error"]
    assert logged and logged[0]["request_id"] == rid and "Traceback" in logged[0]["exception"]


async def test_logs_carry_request_ids_but_no_prompt_text(tokenizer, restore_logging):
    stream = io.StringIO()
    configure_logging("info", True, stream=stream)
    secret = "my-secret-prompt-text "
    c = await _client(tokenizer)
    try:
        resp = await c.post(COMPLETIONS, json={"prompt": secret * 60})
        assert resp.status == 400
        get_logger("test").info("probe", prompt=secret, messages=[{"content": secret}])
    finally:
        await c.close()
    text = stream.getvalue()
    assert "my-secret" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    rejected = [x for x in lines if x["event"] == "request_rejected"]
    assert rejected[0]["request_id"] == resp.headers["X-Request-Id"]
    assert rejected[0]["code"] == "context_length_exceeded"
    assert next(x for x in lines if x["event"] == "probe")["prompt"] == "<redacted: 22 chars>"

    stream = io.StringIO()
    configure_logging("info", True, log_prompts=True, stream=stream)
    get_logger("test").info("probe", prompt=secret)
    assert secret in stream.getvalue()


# ---- tool calls in the output --------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_are_parsed_out_of_the_text():
    content, calls = parse_tool_calls(f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Oslo')}")
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("text", [
    "no tools here",
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed
])
def test_text_without_valid_tool_calls_is_left_alone(text):
    assert parse_tool_calls(text) == (text, [])


def test_streamed_tool_calls_are_held_back_until_the_end():
    text = f"Sure. {CALL} done"
    stream = ToolCallStream()
    sent = "".join(stream.feed(ch) for ch in text)  # one character at a time
    assert sent == "Sure. "  # nothing of "<tool_call>" leaked, not even "<"
    rest, calls = stream.finish()
    assert rest == "done" and calls[0]["function"]["name"] == "get_weather"


def test_streamed_lookalike_tags_are_released():
    stream = ToolCallStream()
    sent = "".join(stream.feed(ch) for ch in "a <tool b <tool_cal")
    assert sent == "a <tool b "  # "<tool_cal" may still become a tag
    assert stream.feed("l c") == "<tool_call c"  # it did not
    assert stream.finish() == ("", [])


def test_streamed_answer_cut_short_sends_the_held_text_verbatim():
    stream = ToolCallStream()
    assert stream.feed(f"x {CALL}") == "x "
    assert stream.finish(parse=False) == (CALL, [])
