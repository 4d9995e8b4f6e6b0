"""The HTTP API's answers that come before the scheduler: validation, limits, auth, errors,
and the informational endpoints. Real aiohttp server on a real socket, real tokenizer; the
scheduler is absent (None), so a request that passes every check is answered 503."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from daemon.api_http import make_app
from daemon.cli import DEFAULT_MODEL
from daemon.config import load_config
from daemon.logs import configure_logging, get_logger
from daemon.metrics import Metrics
from daemon.openai_tools import ToolCallStream, parse_tool_calls
from daemon.tokenizer import Tokenizer

KEY = "sk-test-0123456789"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEFAULT_MODEL)


async def _client(tokenizer, **overrides) -> TestClient:
    config = load_config(None, {"model.path": DEFAULT_MODEL, "scheduler.max_context": 256,
                                "limits.max_prompt_tokens": 240, "limits.max_tokens": 32,
                                "server.max_body_bytes": 4096, **overrides})
    metrics = Metrics()
    app = make_app(None, tokenizer, config, metrics,
                   generation_defaults={"temperature": 0.7, "top_p": 0.8})
    client = TestClient(TestServer(app))
    await client.start_server()
    client.metrics = metrics  # type: ignore[attr-defined]
    return client


@pytest.fixture
async def client(tokenizer):
    c = await _client(tokenizer)
    yield c
    await c.close()


@pytest.fixture
async def keyed(tokenizer):
    c = await _client(tokenizer, **{"server.api_keys": [KEY, "another-key-42"]})
    yield c
    await c.close()


async def _error(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert resp.headers["X-Request-Id"]
    return body["error"]


def _chat(**fields) -> dict:
    return {"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hello"}], **fields}


# ---- bodies and types ---------------------------------------------------------------------------
async def test_malformed_json_is_400(client):
    resp = await client.post(CHAT, data=b'{"messages": [', headers={"Content-Type":
                                                                      "application/json"})
    err = await _error(resp, 400)
    assert "not valid JSON" in err["message"]
    assert err["type"] == "invalid_request_error"


async def test_deeply_nested_json_is_400(client):
    err = await _error(await client.post(CHAT, data=b"[" * 2000 + b"]" * 2000), 400)
    assert "nested too deeply" in err["message"]


async def test_body_must_be_an_object(client):
    err = await _error(await client.post(CHAT, json=[1, 2]), 400)
    assert "JSON object" in err["message"]


async def test_oversized_body_is_413(client):
    big = _chat(messages=[{"role": "user", "content": "x" * 5000}])
    err = await _error(await client.post(CHAT, json=big), 413)
    assert "4096 bytes" in err["message"]
    assert err["code"] == "body_too_large"


@pytest.mark.parametrize("fields, param, words", [
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"temperature": -0.5}, "temperature", "must be in"),
    ({"top_p": 0}, "top_p", "(0.0, 1.0]"),
    ({"top_p": 1.5}, "top_p", "must be in"),
    ({"top_k": -2}, "top_k", ">= -1"),
    ({"top_k": 2.5}, "top_k", "integer"),
    ({"min_p": 2}, "min_p", "must be in"),
    ({"seed": -1}, "seed", "must be in"),
    ({"seed": True}, "seed", "integer"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": "10"}, "max_tokens", "integer"),
    ({"max_tokens": 8, "max_completion_tokens": 9}, "max_completion_tokens", "differ"),
    ({"stop": 5}, "stop", "string or a list"),
    ({"stop": [""]}, "stop", "1 to 256"),
    ({"stop": ["a"] * 17}, "stop", "at most 16"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
    ({"stream": True, "stream_options": {"foo": 1}}, "stream_options", "stream_options.foo"),
    ({"priority": 5000}, "priority", "must be in"),
    ({"model": 3}, "model", "must be a string"),
    ({"user": 3}, "user", "must be a string"),
    ({"ignore_eos": 1}, "ignore_eos", "true or false"),
])
async def test_wrong_types_and_ranges_are_400(client, fields, param, words):
    err = await _error(await client.post(CHAT, json=_chat(**fields)), 400)
    assert err["param"] == param
    assert words in err["message"]


@pytest.mark.parametrize("fields, param, words", [
    ({"n": 2}, "n", "must be 1"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"top_logprobs": 3}, "top_logprobs", "not supported"),
    ({"logit_bias": {"5": 1}}, "logit_bias", "not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "\"auto\" or \"none\""),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "auto"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not implemented"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "not supported"),
    ({"functions": []}, "functions", "unknown field 'functions'"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "unknown field"),
    ({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs", "enable_thinking"),
])
async def test_unsupported_features_are_400_with_a_message(client, fields, param, words):
    err = await _error(await client.post(CHAT, json=_chat(**fields)), 400)
    assert err["param"] == param
    assert words in err["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "hi", "best_of": 3}, "best_of", "must be 1"),
    ({"prompt": "hi", "echo": True}, "echo", "not implemented"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "not implemented"),
    ({"prompt": ["a", "b"]}, "prompt", "batch prompts are not supported"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "batch prompts are not supported"),
    ({"prompt": [1, -2]}, "prompt", "token ids"),
    ({"prompt": [1, "2"]}, "prompt", "token ids"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({}, "prompt", "is required"),
    ({"prompt": {"text": "x"}}, "prompt", "got dict"),
    ({"prompt": [10 ** 6]}, "prompt", "out of range"),
    ({"prompt": "hi", "messages": []}, "messages", "unknown field"),
])
async def test_completion_prompt_shapes(client, body, param, words):
    err = await _error(await client.post(COMPLETIONS, json=body), 400)
    assert err["param"] == param
    assert words in err["message"]


@pytest.mark.parametrize("messages, param, words", [
    (None, "messages", "required"),
    ([], "messages", "non-empty list"),
    ("hi", "messages", "non-empty list"),
    ([{"role": "robot", "content": "x"}], "messages[0].role", "must be one of"),
    ([{"content": "x"}], "messages[0].role", "must be one of"),
    ([{"role": "user"}], "messages[0].content", "is required"),
    ([{"role": "user", "content": 5}], "messages[0].content", "string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0]", "'image_url' is not supported"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]", "text"),
    ([{"role": "user", "content": "x", "audio": 1}], "messages[0].audio", "unknown field"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls",
     "assistant message"),
    (["hello"], "messages[0]", "must be an object"),
])
async def test_chat_message_shapes(client, messages, param, words):
    body = {"messages": messages} if messages is not None else {"model": "tandem-tiny"}
    err = await _error(await client.post(CHAT, json=body), 400)
    assert err["param"] == param
    assert words in err["message"]


async def test_bad_tools_are_400(client):
    err = await _error(await client.post(CHAT, json=_chat(tools=[{"type": "retrieval"}])), 400)
    assert err["param"] == "tools[0]"


async def test_chat_template_errors_are_400(tokenizer):
    strict = Tokenizer(tokenizer.backend, eos_token_ids=tokenizer.eos_token_ids,
                       chat_template="{% if messages[0].role != 'user' %}"
                                     "{{ raise_exception('conversations start with a user') }}"
                                     "{% endif %}{{ messages[0].content }}")
    c = await _client(strict)
    try:
        body = _chat(messages=[{"role": "assistant", "content": "a"}])
        err = await _error(await c.post(CHAT, json=body), 400)
        assert "conversations start with a user" in err["message"]
        assert (await c.post(CHAT, json=_chat())).status == 503  # renders: reaches the engine
    finally:
        await c.close()


async def test_no_tokenizer_needs_token_ids():
    c = await _client(None)
    try:
        err = await _error(await c.post(COMPLETIONS, json={"prompt": "hi"}), 400)
        assert "list of token ids" in err["message"]
        assert (await c.post(COMPLETIONS, json={"prompt": [5, 6]})).status == 503
    finally:
        await c.close()


# ---- model names, limits -----------------------------------------------------------------------
async def test_unknown_model_is_404(client):
    err = await _error(await client.post(CHAT, json=_chat(model="gpt-4o")), 404)
    assert err["code"] == "model_not_found"
    assert "gpt-4o" in err["message"] and "tandem-tiny" in err["message"]


async def test_alias_is_accepted(tokenizer):
    c = await _client(tokenizer, **{"model.aliases": ["tiny"]})
    try:
        resp = await c.post(CHAT, json=_chat(model="tiny"))
        assert resp.status == 503  # validated, then the absent engine
        models = await (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tandem-tiny", "tiny"]
        card = await (await c.get("/v1/models/tiny")).json()
        assert card["id"] == "tiny" and card["root"] == "tandem-tiny"
        err = await _error(await c.get("/v1/models/Qwen/Qwen3-8B"), 404)
        assert err["code"] == "model_not_found" and "Qwen/Qwen3-8B" in err["message"]
    finally:
        await c.close()


async def test_prompt_over_max_prompt_tokens_is_400_with_counts(client, tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 16
    n = len(tokenizer.encode(text))
    assert n > 240
    err = await _error(await client.post(COMPLETIONS, json={"prompt": text}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"{n} tokens" in err["message"] and "240" in err["message"]
    chat = _chat(messages=[{"role": "user", "content": text}])
    err = await _error(await client.post(CHAT, json=chat), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


async def test_prompt_plus_max_tokens_over_context_is_400_with_counts(client):
    ids = list(range(230))
    err = await _error(await client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 30}),
                       400)
    assert err["param"] == "max_tokens"
    assert "230 tokens" in err["message"] and "(30)" in err["message"]
    assert "260" in err["message"] and "256" in err["message"]


async def test_max_tokens_over_limit_is_400(client):
    err = await _error(await client.post(COMPLETIONS, json={"prompt": [1], "max_tokens": 33}),
                       400)
    assert "<= 32" in err["message"]


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "seed": 3,
                   "stop": ["\n"], "user": "u1", "n": 1, "priority": 2,
                   "presence_penalty": 0, "logprobs": None, "echo": False,
                   "ignore_eos": True}),
    (COMPLETIONS, {"prompt": [1, 2, 3], "stream": True,
                   "stream_options": {"include_usage": True}}),
    (CHAT, _chat(max_completion_tokens=8, top_k=-1, min_p=0.1, stop="x", logprobs=False,
                 response_format={"type": "text"}, tool_choice="auto",
                 chat_template_kwargs={"enable_thinking": False},
                 tools=[{"type": "function", "function": {"name": "get_time",
                                                          "parameters": {"type": "object"}}}],
                 messages=[{"role": "developer", "content": "Be brief."},
                           {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                        {"type": "text", "text": "there"}]},
                           {"role": "assistant", "content": None,
                            "tool_calls": [{"id": "c1", "type": "function", "function": {
                                "name": "get_time", "arguments": "{}"}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])),
])
async def test_valid_requests_pass_validation_and_meet_the_absent_engine(client, path, body):
    resp = await client.post(path, json=body)
    err = await _error(resp, 503)
    assert err["code"] == "engine_unavailable"
    assert resp.headers["Retry-After"] == "5"
    prefix = "chatcmpl-" if path == CHAT else "cmpl-"
    assert resp.headers["X-Request-Id"].startswith(prefix)


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
